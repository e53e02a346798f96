"""A stand-in for the Hugging Face Hub on 127.0.0.1: the endpoints huggingface_hub's snapshot_download and
hf_hub_download call, serving a tiny Llama built from assets/tiny-llama, for tests without network.

    python -m pytest tests/test_hub.py -q

Endpoints (read from huggingface_hub's hf_api.py repo_info / list_repo_tree and file_download.py
get_hf_file_metadata / http_get): GET /api/models/{repo}/revision/{rev}, GET /api/models/{repo}/tree/{rev},
HEAD and GET /{repo}/resolve/{rev}/{file} with X-Repo-Commit, ETag and Content-Length. Errors carry the
X-Error-Code huggingface_hub maps to its exceptions: RepoNotFound (404), GatedRepo (401 without the token),
RevisionNotFound, EntryNotFound. `HubServer.requests` lists every (method, path) served; `move_branch` points a
branch at another commit, as a push to the model would. Two nodes' views of one Hub: `HubServer(same_hub_as=other)`
serves the other's repos and branches (one push moves both), with its own `delay_s` before each file it sends (a
slow node's link) and its own requests; `after_request(method, path)`, if set, runs once each request is served (a
push at a chosen moment).
"""

from __future__ import annotations

import hashlib
import http.server
import json
import os
import threading
import time
import urllib.parse

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = "tiny-org/tiny-llama"
GATED = "tiny-org/gated-llama"
TOKEN = "hf_test_token"  # the token that opens GATED
DECOYS = {"pytorch_model.bin": b"not to be downloaded", "original/consolidated.00.pth": b"not to be downloaded",
          "model.gguf": b"not to be downloaded", "README.md": b"# tiny"}


def tiny_model_files(seed: int) -> dict[str, bytes]:
    """{file: bytes} of a tiny Llama as save_pretrained writes it (safetensors), with assets/tiny-llama's tokenizer."""
    import tempfile

    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(os.path.join(ROOT, "assets", "tiny-llama")))
    files = {}
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        for name in os.listdir(tmp):
            with open(os.path.join(tmp, name), "rb") as f:
                files[name] = f.read()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        with open(os.path.join(ROOT, "assets", "tiny-llama", name), "rb") as f:
            files[name] = f.read()
    return {**files, **DECOYS}


def commit_of(files: dict[str, bytes]) -> str:
    h = hashlib.sha1()
    for name in sorted(files):
        h.update(name.encode() + hashlib.sha1(files[name]).digest())
    return h.hexdigest()


class HubServer:
    """Serves `repos` ({repo: {commit: {file: bytes}}}) with branches ({repo: {branch: commit}})."""

    def __init__(self, same_hub_as: HubServer | None = None, delay_s: float = 0.0):
        self.repos: dict[str, dict[str, dict[str, bytes]]] = same_hub_as.repos if same_hub_as else {}
        self.branches: dict[str, dict[str, str]] = same_hub_as.branches if same_hub_as else {}
        self.requests: list[tuple[str, str]] = []
        self.delay_s = delay_s
        self.after_request = None
        handler = type("Handler", (_Handler,), {"hub": self})
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def add(self, repo: str, files: dict[str, bytes], branch: str = "main") -> str:
        commit = commit_of(files)
        self.repos.setdefault(repo, {})[commit] = files
        self.branches.setdefault(repo, {})[branch] = commit
        return commit

    def move_branch(self, repo: str, branch: str, commit: str) -> None:
        self.branches[repo][branch] = commit

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def resolve(self, repo: str, rev: str) -> str | None:
        if rev in self.repos.get(repo, {}):
            return rev
        return self.branches.get(repo, {}).get(rev)


class _Handler(http.server.BaseHTTPRequestHandler):
    hub: HubServer

    def log_message(self, *args):  # quiet: the test asserts on hub.requests instead
        pass

    def do_HEAD(self):
        self._serve(body=False)
        if self.hub.after_request:
            self.hub.after_request(self.command, self.path)

    def do_GET(self):
        self._serve(body=True)
        if self.hub.after_request:
            self.hub.after_request(self.command, self.path)

    def _error(self, status: int, code: str) -> None:
        self.send_response(status)
        self.send_header("X-Error-Code", code)
        self.send_header("Content-Type", "application/json")
        body = json.dumps({"error": code}).encode()
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command == "GET":
            self.wfile.write(body)

    def _send(self, body: bytes, headers: dict[str, str], with_body: bool) -> None:
        self.send_response(200)
        for k, v in {**headers, "Content-Length": str(len(body))}.items():
            self.send_header(k, v)
        self.end_headers()
        if with_body:
            self.wfile.write(body)

    def _serve(self, body: bool) -> None:
        path = urllib.parse.urlparse(self.path).path
        self.hub.requests.append((self.command, path))
        parts = [urllib.parse.unquote(p) for p in path.strip("/").split("/")]
        api = parts[:2] == ["api", "models"]
        repo = "/".join(parts[2:4] if api else parts[0:2])
        rest = parts[4:] if api else parts[2:]
        if repo not in self.hub.repos:
            return self._error(404, "RepoNotFound")
        if repo == GATED and self.headers.get("Authorization") != f"Bearer {TOKEN}":
            return self._error(401, "GatedRepo")
        if len(rest) < 2 or rest[0] not in ("revision", "tree", "resolve"):
            return self._error(404, "EntryNotFound")
        commit = self.hub.resolve(repo, rest[1])
        if commit is None:
            return self._error(404, "RevisionNotFound")
        files = self.hub.repos[repo][commit]
        if rest[0] == "revision":
            info = {"id": repo, "sha": commit, "private": False, "siblings": [{"rfilename": f} for f in sorted(files)]}
            return self._send(json.dumps(info).encode(), {"Content-Type": "application/json"}, body)
        if rest[0] == "tree":
            tree = [{"type": "file", "path": f, "size": len(b), "oid": hashlib.sha1(b).hexdigest()}
                    for f, b in sorted(files.items())]
            return self._send(json.dumps(tree).encode(), {"Content-Type": "application/json"}, body)
        name = "/".join(rest[2:])
        if name not in files:
            return self._error(404, "EntryNotFound")
        data = files[name]
        if body and self.hub.delay_s:
            time.sleep(self.hub.delay_s)
        self._send(data, {"X-Repo-Commit": commit, "ETag": f'"{hashlib.sha1(data).hexdigest()}"',
                          "Content-Type": "application/octet-stream"}, body)

"""A real S3-compatible server (moto in server mode, the one s3fs's own tests use) on 127.0.0.1, for the tests.

    python -m pytest tests/test_s3.py -q

`s3_server` (a pytest fixture, session scope) starts it on a free port, creates BUCKET, and returns the
environment a run needs: AWS_ENDPOINT_URL and dummy credentials, the standard variables boto3 and s3fs read.
`s3_env` (function scope) puts that environment into os.environ for one test and takes it out after.
"""

from __future__ import annotations

import os
import re
import socket
import time

import pytest

BUCKET = "ckpt-test"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(port: int | None = None):
    """(server, env): a moto S3 server on 127.0.0.1 (`port`, or a free one) holding BUCKET. Servers of one
    process share their buckets (moto keeps them in process memory), so one stopped and started again on its port
    is the same store back online."""
    moto_server = pytest.importorskip("moto.server")
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port or _free_port(), verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    env = {"AWS_ENDPOINT_URL": f"http://{host}:{port}", "AWS_ACCESS_KEY_ID": "testing",
           "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
    try:
        s3_client(env).create_bucket(Bucket=BUCKET)
    except Exception as e:  # noqa: BLE001 - already there (another server of this process made it)
        if "BucketAlreadyOwnedByYou" not in str(e):
            raise
    return server, env


def stop_server(server) -> None:
    server.stop()


@pytest.fixture(scope="session")
def s3_server():
    server, env = start_server()
    try:
        yield env
    finally:
        server.stop()


@pytest.fixture
def s3_env(s3_server, monkeypatch):
    for key, value in s3_server.items():
        monkeypatch.setenv(key, value)
    return s3_server


def s3_client(env: dict):
    """A boto3 client of the test server (for checks the code under test must not do itself)."""
    import boto3

    return boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
                        aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"], region_name=env["AWS_DEFAULT_REGION"])


class S3Proxy:
    """An HTTP proxy in front of the test server, for what moto cannot do itself: refuse requests (`refuse(method,
    path) -> (status, code) or None`, e.g. 503 SlowDown, 403 AccessDenied), hold part uploads a while (`hold_parts_s`,
    so parallel ones overlap for sure), ignore request headers (`strip`, lower-case names taken out before the request
    goes on: {"if-none-match", "if-match"} makes a server that ignores conditional writes, as some S3-compatible stores
    do), and record every request: `requests` [(method, path, query, keys, range)] with `keys` the keys a
    DeleteObjects request names and `range` a GET's Range header, `max_parallel_parts` the most part uploads in
    flight at once."""

    def __init__(self, target_endpoint: str):
        import http.client
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
        from urllib.parse import urlsplit

        target = urlsplit(target_endpoint)
        proxy = self
        self.refuse = lambda method, path: None
        self.hold_parts_s, self.requests, self.refused, self.strip = 0.0, [], 0, set()
        self.max_parallel_parts, self._parts_now, self._lock = 0, 0, threading.Lock()

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    out = b""
                    while size := int(self.rfile.readline().split(b";")[0], 16):
                        out += self.rfile.read(size)
                        self.rfile.readline()
                    self.rfile.readline()
                    return out
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            def _reply(self, status: int, headers: list, body: bytes) -> None:
                self.send_response(status)
                head = self.command == "HEAD"  # no body, but the object's Content-Length
                for k, v in headers:
                    if k.lower() not in ("transfer-encoding", "connection", "server", "date") and \
                            (head or k.lower() != "content-length"):
                        self.send_header(k, v)
                if not head:
                    self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(b"" if head else body)

            def _handle(self) -> None:
                body = self._body()
                path, _, query = self.path.partition("?")
                part = "partNumber=" in query
                with proxy._lock:
                    deleting = self.command == "POST" and "delete" in query.split("&")  # DeleteObjects: POST ?delete
                    keys = re.findall(r"<Key>([^<]*)</Key>", body.decode(errors="replace")) if deleting else []
                    proxy.requests.append((self.command, path, query, keys, self.headers.get("Range")))
                    refusal = proxy.refuse(self.command, path)
                    proxy.refused += refusal is not None
                if refusal is not None:
                    status, code = refusal
                    xml = f"<?xml version='1.0' encoding='UTF-8'?><Error><Code>{code}</Code><Message>refused by the " \
                          f"test proxy</Message></Error>".encode()
                    return self._reply(status, [("Content-Type", "application/xml")], xml)
                if part:
                    with proxy._lock:
                        proxy._parts_now += 1
                        proxy.max_parallel_parts = max(proxy.max_parallel_parts, proxy._parts_now)
                    time.sleep(proxy.hold_parts_s)
                try:
                    conn = http.client.HTTPConnection(target.hostname, target.port, timeout=60)
                    headers = {k: v for k, v in self.headers.items()
                               if k.lower() != "transfer-encoding" and k.lower() not in proxy.strip}
                    headers["Content-Length"] = str(len(body))
                    conn.request(self.command, self.path, body=body, headers=headers)
                    resp = conn.getresponse()
                    self._reply(resp.status, resp.getheaders(), resp.read())
                    conn.close()
                finally:
                    if part:
                        with proxy._lock:
                            proxy._parts_now -= 1

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def delete_requests(self) -> list[list[str]]:
        """The keys of each DeleteObjects request so far."""
        return [r[3] for r in self.requests if r[0] == "POST" and "delete" in r[2].split("&")]

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def s3_proxy(s3_env, monkeypatch):
    """An S3Proxy in front of the test server, its endpoint in os.environ for this test (in-process clients)."""
    proxy = S3Proxy(s3_env["AWS_ENDPOINT_URL"])
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    try:
        yield proxy
    finally:
        proxy.stop()

"""What a model folder IS, independent of where it lives: fingerprints of its config.json, weights and tokenizer.

    python -m pytest tests/test_resume_config.py -q -k moved

Each checkpoint's meta.json records them ("model_content": {config key: fingerprint}). A resume whose
model.config_path / name_or_path / tokenizer_path names another folder compares fingerprints, not paths: an
identical copy (the run continued on another machine) is a logged change, an edited one is refused as before
(finetune/resume_rules.py RESUME_REFUSED), naming what differs: the config.json fields with both values, or the
weights' fingerprint. For that meta.json also records "model_files": {config key: {"config": config.json,
"weights": fingerprint}}. A checkpoint saved before these records is compared with its saved folder when that
folder still exists.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from typing import Callable

from ckpt.lora_base import base_fingerprint
from finetune.config import identity_keys
from finetune.model import TOKENIZER_FILES

MODEL_PATH_KEYS = identity_keys()  # the keys declared identity=True (finetune/config.py); roles: folder_fingerprint
TOKENIZER_EXTRA = ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja", "merges.txt")


def _sha(chunks) -> str:
    h = hashlib.sha256()
    for chunk in chunks:
        h.update(chunk)
    return "sha256:" + h.hexdigest()[:32]


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _config_json(folder: str) -> bytes:
    """config.json as canonical JSON: the same settings written with other spacing or key order are the same."""
    with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
        return json.dumps(json.load(f), sort_keys=True).encode()


@functools.lru_cache(maxsize=8)
def folder_fingerprint(key: str, folder: str) -> str | None:
    """The fingerprint of `folder` in the role of config `key` (None if it cannot be read): config.json for
    config_path; config.json and the weights' base_fingerprint for name_or_path; the tokenizer files for
    tokenizer_path. Cost: a few small files plus base_fingerprint's 8 MiB, once per process and folder."""
    try:
        if key == "model.tokenizer_path":
            names = sorted(n for n in os.listdir(folder) if n in TOKENIZER_FILES + TOKENIZER_EXTRA)
            return _sha(n.encode() + _read(os.path.join(folder, n)) for n in names) if names else None
        parts = [_config_json(folder)]
        if key == "model.name_or_path":
            parts.append(base_fingerprint(folder)["fingerprint"].encode())
        return _sha(parts)
    except Exception:  # noqa: BLE001 - an unreadable or incomplete folder is "not the same"
        return None


@functools.lru_cache(maxsize=8)
def folder_parts(key: str, folder: str) -> dict | None:
    """Once per process and folder, as folder_fingerprint (every save's meta.json records it, on every rank):
    {"config": config.json, "weights": the weights' fingerprint (name_or_path only)} of `folder` in the role of
    config `key`; None for the tokenizer folder or a folder that cannot be read."""
    if key == "model.tokenizer_path" or not folder:
        return None
    try:
        return {"config": json.loads(_config_json(folder)),
                "weights": base_fingerprint(folder)["fingerprint"] if key == "model.name_or_path" else None}
    except Exception:  # noqa: BLE001 - as folder_fingerprint: unreadable means nothing to name
        return None


def model_files(cfg_model) -> dict[str, dict]:
    """meta.json's "model_files": folder_parts of the model folders this run uses, to name what a refused
    resume changed even once the folder is gone (config.json is a few KB)."""
    out = {}
    for key in MODEL_PATH_KEYS:
        parts = folder_parts(key, getattr(cfg_model, key.split(".")[1]))
        if parts:
            out[key] = parts
    return out


def what_differs(saved: dict | None, current: dict | None) -> str:
    """'hidden_size: 64 -> 96, num_hidden_layers: 2 -> 3; the weights' fingerprint differs (a -> b)' between two
    folder_parts, or '' when one side is unknown."""
    if not saved or not current:
        return ""
    a, b = saved["config"], current["config"]
    show = lambda cfg, k: repr(cfg[k]) if k in cfg else "(absent)"  # noqa: E731
    fields = [f"{k}: {show(a, k)} -> {show(b, k)}" for k in sorted(set(a) | set(b)) if show(a, k) != show(b, k)]
    out = ", ".join(fields[:8]) + (f" (+{len(fields) - 8} more)" if len(fields) > 8 else "")
    if saved.get("weights") and current.get("weights") and saved["weights"] != current["weights"]:
        out += ("; " if out else "") + f"the weights' fingerprint differs ({saved['weights']} -> {current['weights']})"
    return out


def model_content(cfg_model) -> dict[str, str]:
    """meta.json's "model_content": {config key: fingerprint} of the model folders this run uses."""
    out = {}
    for key in MODEL_PATH_KEYS:
        folder = getattr(cfg_model, key.split(".")[1])
        fp = folder_fingerprint(key, folder) if folder else None
        if fp:
            out[key] = fp
    return out


def content_change_since(meta: dict, cfg_model) -> Callable[[str, str], str | None]:
    """For resume_changes: None if this run's folder for `key` is the one the checkpoint trained with
    (`saved_path`), by the recorded fingerprint, or for an older checkpoint by the saved folder's content if it
    still exists; else what differs (what_differs: '' when the checkpoint's side is unknown)."""
    recorded, files = meta.get("model_content") or {}, meta.get("model_files") or {}

    def change(key: str, saved_path: str) -> str | None:
        current = getattr(cfg_model, key.split(".")[1])
        mine = folder_fingerprint(key, current) if current else None
        theirs = recorded.get(key) or (folder_fingerprint(key, saved_path) if saved_path else None)
        if mine is not None and mine == theirs:
            return None
        return what_differs(files.get(key) or folder_parts(key, saved_path), folder_parts(key, current))

    return change

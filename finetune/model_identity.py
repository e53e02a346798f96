"""What a model folder IS, independent of where it lives: fingerprints of its config.json, weights and tokenizer.

    python -m pytest tests/test_resume_config.py -q -k moved

Each checkpoint's meta.json records them ("model_content": {config key: fingerprint}). A resume whose
model.config_path / name_or_path / tokenizer_path names another folder compares fingerprints, not paths: an
identical copy (the run continued on another machine) is a logged change, an edited one is refused as before
(finetune/resume_rules.py RESUME_REFUSED). A checkpoint saved before this record is compared with its saved folder
when that folder still exists.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from typing import Callable

from ckpt.adapter import base_fingerprint
from finetune.model import TOKENIZER_FILES

MODEL_PATH_KEYS = ("model.name_or_path", "model.config_path", "model.tokenizer_path")
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


def model_content(cfg_model) -> dict[str, str]:
    """meta.json's "model_content": {config key: fingerprint} of the model folders this run uses."""
    out = {}
    for key in MODEL_PATH_KEYS:
        folder = getattr(cfg_model, key.split(".")[1])
        fp = folder_fingerprint(key, folder) if folder else None
        if fp:
            out[key] = fp
    return out


def same_content_as(meta: dict, cfg_model) -> Callable[[str, str], bool]:
    """For resume_changes: is this run's folder for `key` the one the checkpoint trained with (`saved_path`),
    by the recorded fingerprint, or for an older checkpoint by the saved folder's content if it still exists."""
    recorded = meta.get("model_content") or {}

    def same(key: str, saved_path: str) -> bool:
        current = getattr(cfg_model, key.split(".")[1])
        mine = folder_fingerprint(key, current) if current else None
        theirs = recorded.get(key) or (folder_fingerprint(key, saved_path) if saved_path else None)
        return mine is not None and mine == theirs

    return same

"""The commit protocol: a checkpoint exists only once its marker, with a manifest of every file, is durable.

    python -m ckpt verify runs/tiny/checkpoints/step-000020

Order on save: every rank's DCP files are written and fsynced (FileSystemWriter(sync_files=True));
DCP's finish step (rank 0 writes .metadata) returns only after all ranks reported; then rank 0 hashes
every file (off the training path, in the background for async saves) and writes commit.json via
tmp + fsync + rename + directory fsync. A crash at any moment leaves either no marker (ignored on
resume) or a complete one.
"""

from __future__ import annotations

import hashlib
import json
import os
import time

from .layout import COMMIT_FILE, step_of

_CHUNK = 8 << 20


class VerifyError(Exception):
    """A checkpoint failed verification; the message names the file and the problem."""


def file_checksum(path: str) -> str:
    h = hashlib.sha256()  # hashlib releases the GIL on large buffers: training threads keep running
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_atomic(path: str, obj: dict) -> None:
    """tmp + fsync + rename + fsync(dir): readers see the old file or the whole new one, never half."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(path) or ".")


def build_manifest(ckpt_path: str) -> dict[str, dict]:
    files = {}
    for name in sorted(os.listdir(ckpt_path)):
        full = os.path.join(ckpt_path, name)
        if name == COMMIT_FILE or ".tmp" in name or not os.path.isfile(full):
            continue
        files[name] = {"size": os.path.getsize(full), "sha256": file_checksum(full)}
    return files


def commit_checkpoint(ckpt_path: str, world_size: int) -> dict:
    """Hash every file and write the commit marker last. Call on one rank after the save finished."""
    fsync_dir(ckpt_path)  # the data files' directory entries are durable before the marker can be
    marker = {"step": step_of(ckpt_path), "world_size": world_size, "committed_at": time.time(),
              "files": build_manifest(ckpt_path)}
    if ".metadata" not in marker["files"]:
        raise VerifyError(f"{ckpt_path}: no .metadata after save; refusing to commit")
    write_json_atomic(os.path.join(ckpt_path, COMMIT_FILE), marker)
    return marker


def read_marker(ckpt_path: str) -> dict:
    path = os.path.join(ckpt_path, COMMIT_FILE)
    if not os.path.isfile(path):
        raise VerifyError(f"{path}: missing commit marker (checkpoint never committed)")
    try:
        with open(path) as f:
            marker = json.load(f)
        files = marker["files"]
        assert isinstance(files, dict) and all("size" in v and "sha256" in v for v in files.values())
    except Exception as e:  # noqa: BLE001 - any unreadable marker is the same verdict
        raise VerifyError(f"{path}: corrupt commit marker ({type(e).__name__})") from None
    return marker


def verify_checkpoint(ckpt_path: str, checksums: bool = True) -> dict:
    """Marker present and well formed, every listed file present with its size (and checksum), no
    unlisted data files. Returns the marker; raises VerifyError naming the first bad file."""
    if not os.path.isdir(ckpt_path):
        raise VerifyError(f"{ckpt_path}: not a directory")
    marker = read_marker(ckpt_path)
    for name, info in marker["files"].items():
        full = os.path.join(ckpt_path, name)
        if not os.path.isfile(full):
            raise VerifyError(f"{full}: missing")
        if os.path.getsize(full) != info["size"]:
            raise VerifyError(f"{full}: size {os.path.getsize(full)} != {info['size']} in manifest")
        if checksums and file_checksum(full) != info["sha256"]:
            raise VerifyError(f"{full}: checksum mismatch")
    for name in os.listdir(ckpt_path):
        if name.endswith(".distcp") and name not in marker["files"]:
            raise VerifyError(f"{os.path.join(ckpt_path, name)}: data file not in manifest")
    meta = os.path.join(ckpt_path, "meta.json")
    try:
        with open(meta) as f:
            json.load(f)
    except (OSError, ValueError):
        raise VerifyError(f"{meta}: unreadable") from None
    return marker

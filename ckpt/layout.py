"""Where things live inside a checkpoint directory; the only module that builds checkpoint paths.

    <ckpt.dir>/
      .lock                   held (flock) by rank 0 of the job that owns this directory
      step-000020/            one checkpoint: DCP shards (__<rank>_<n>.distcp) + .metadata
        meta.json             human-readable: step, world size, versions, time, config hash
        config.yaml           the resolved training config
        commit.json           written last, atomically: manifest of every file with size + checksum
      .trash/                 folders retention (or a save in their way) took out of the listing, unmarked,
                              until every rank has deleted its share of their files (retention.py)
"""

from __future__ import annotations

import json
import os
import re
import time

from .storage import join, scheme_of, storage_for

COMMIT_FILE = "commit.json"
META_FILE = "meta.json"
CONFIG_FILE = "config.yaml"
LOCK_FILE = ".lock"
TRASH_DIR = ".trash"
_STEP_DIR = re.compile(r"^step-(\d{6,})$")


def step_dir(ckpt_dir: str, step: int) -> str:
    return join(ckpt_dir, f"step-{step:06d}")


def step_of(path: str) -> int | None:
    m = _STEP_DIR.match(os.path.basename(os.path.normpath(path)))
    return int(m.group(1)) if m else None


def trash_dir(ckpt_dir: str) -> str:
    return os.path.join(ckpt_dir, TRASH_DIR)


def trash_slot(path: str) -> str:
    """A fresh place in its ckpt.dir's .trash for `path`: not a step-NNNNNN name, and not taken (a rename onto
    an empty folder would replace it silently)."""
    parent, name = os.path.split(os.path.normpath(path))
    return os.path.join(trash_dir(parent), f"{name}.{os.getpid()}-{time.time_ns()}")


def list_step_dirs(ckpt_dir: str) -> list[tuple[int, str]]:
    """(step, path) of every step-NNNNNN folder, committed or not, oldest first (never what is in .trash). On an
    object store: every step-NNNNNN prefix (one listing; what belongs to a checkpoint is its marker's business)."""
    if scheme_of(ckpt_dir) is not None:
        names = storage_for(ckpt_dir).listdir(ckpt_dir)
        return sorted((step_of(n), join(ckpt_dir, n)) for n in names if step_of(n) is not None)
    if not os.path.isdir(ckpt_dir):
        return []
    found = []
    for name in os.listdir(ckpt_dir):
        step = step_of(name)
        if step is not None and os.path.isdir(os.path.join(ckpt_dir, name)):
            found.append((step, os.path.join(ckpt_dir, name)))
    return sorted(found)


def is_marked_committed(path: str) -> bool:
    """Cheap check: the marker exists. `commit.verify_checkpoint` is the full check."""
    return storage_for(path).exists(join(path, COMMIT_FILE))


def read_meta(path: str, missing_ok: bool = False) -> dict:
    """The checkpoint's meta.json; with missing_ok, {} for a missing or unreadable one (listings, retention)."""
    try:
        return json.loads(storage_for(path).read(join(path, META_FILE)))
    except (OSError, ValueError):
        if missing_ok:
            return {}
        raise


def read_saved_config(path: str) -> str | None:
    """The training config saved beside the shards (text), or None for a checkpoint without one."""
    try:
        return storage_for(path).read(join(path, CONFIG_FILE)).decode()
    except FileNotFoundError:
        return None


def latest_committed_step(ckpt_dir: str) -> int | None:
    steps = [s for s, p in list_step_dirs(ckpt_dir) if is_marked_committed(p)]
    return steps[-1] if steps else None

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

from .storage import join, storage_for
from .storage.local import trash_dir  # noqa: F401 - a name of the layout
from .storage.lock import LOCK_FILE  # noqa: F401 - a name of the layout, kept by the lock protocols

COMMIT_FILE = "commit.json"
META_FILE = "meta.json"
CONFIG_FILE = "config.yaml"
_STEP_DIR = re.compile(r"^step-(\d{6,})$")


def step_dir(ckpt_dir: str, step: int) -> str:
    return join(ckpt_dir, f"step-{step:06d}")


def step_of(path: str) -> int | None:
    m = _STEP_DIR.match(os.path.basename(os.path.normpath(path)))
    return int(m.group(1)) if m else None


def list_step_dirs(ckpt_dir: str) -> list[tuple[int, str]]:
    """(step, path) of every step-NNNNNN folder, committed or not, oldest first (never what is in .trash). On an
    object store: every step-NNNNNN prefix (one listing; what belongs to a checkpoint is its marker's business)."""
    names = storage_for(ckpt_dir).list_folders(ckpt_dir)
    return sorted((step_of(n), join(ckpt_dir, n)) for n in names if step_of(n) is not None)


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

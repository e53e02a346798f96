"""Retention: which checkpoint folders go after a commit, and how a folder is removed safely.

    python -m pytest tests/test_ckpt_unit.py tests/test_eval.py -q

Runs on rank 0 right after a commit, when no other save can be in flight. The commit marker is removed
first, so a crash halfway leaves an uncommitted folder, never a marked partial one.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from typing import Callable

from .layout import COMMIT_FILE, is_marked_committed, list_step_dirs, read_meta


def apply_retention(ckpt_dir: str, newest: int, keep_last: int, keep_best: int, on_log: Callable[[str], None]) -> None:
    """Delete committed checkpoints beyond keep_last (oldest first) and dead partial folders older
    than `newest`, the step just committed. Folders of later steps are left alone: they are from an
    earlier run (e.g. skipped as corrupt on resume) and must not push out the checkpoint just made."""
    dirs = [(s, p) for s, p in list_step_dirs(ckpt_dir) if s <= newest]
    committed = [(s, p) for s, p in dirs if is_marked_committed(p)]
    doomed = committed[:-keep_last] if keep_last else []
    best = best_scored(committed, keep_best)
    doomed = [(s, p) for s, p in doomed if s not in best]
    doomed += [(s, p) for s, p in dirs if s < newest and not is_marked_committed(p)]
    for s, p in doomed:
        remove_checkpoint(p)
        on_log(f"retention: deleted {p}")


def clear_stale(path: str, on_log: Callable[[str], None]) -> None:
    """Remove a folder (or anything else) in the way of this step's save. It is not a checkpoint this job
    trusts: resume verified newer ones and skipped it, or it is this job's own failed attempt. If it
    cannot be removed (a damaged tree), it is moved aside so the save goes on."""
    remove_checkpoint(path)
    if os.path.lexists(path):
        aside = f"{path}.damaged-{os.getpid()}-{int(time.time())}"
        os.replace(path, aside)
        on_log(f"checkpoint: moved damaged {path} aside to {aside}")


def remove_checkpoint(path: str) -> None:
    """Marker first: a crash halfway through leaves an uncommitted folder, never a marked partial one.
    Anything may stand where a file or folder belongs (a folder named commit.json, a file named step-N)."""
    if not os.path.isdir(path) or os.path.islink(path):
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)
        return
    marker = os.path.join(path, COMMIT_FILE)
    if os.path.isdir(marker) and not os.path.islink(marker):
        shutil.rmtree(marker, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.remove(marker)
    shutil.rmtree(path, ignore_errors=True)


def best_scored(checkpoints: list[tuple[int, str]], k: int) -> set[int]:
    """Steps of the k checkpoints with the lowest meta.json `score` (the trainer's eval loss); unscored never count."""
    scored = [(meta["score"], s) for s, p in checkpoints if k and "score" in (meta := read_meta(p, missing_ok=True))]
    return {s for _, s in sorted(scored)[:k]}


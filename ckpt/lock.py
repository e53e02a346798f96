"""One job per ckpt.dir: rank 0 takes <ckpt.dir>/.lock with the lock class its storage backend names (a folder's
flock, an object store's compare-and-swap: ckpt/storage/lock.py has both protocols), and every rank raises rank 0's
refusal.

    python -m pytest tests/test_ckpt_unit.py -q -k lock
"""

from __future__ import annotations

from common.dist import on_rank0_then_share
from .errors import CheckpointError
from .storage import storage_for
from .storage.lock import STALE_S, DirLock, LockError, ObjectLock  # noqa: F401 - imported from here


def lock_for_job(ckpt_dir: str, group) -> DirLock | ObjectLock | None:
    """Rank 0 takes <ckpt_dir>/.lock and returns it, held until `release()`; the other ranks return None. If
    another live job holds it, every rank raises CheckpointError with rank 0's message."""
    held: list = []

    def take() -> None:  # returns nothing: the lock (an open file, a heartbeat thread) stays on rank 0
        store = storage_for(ckpt_dir)
        lock = store.lock_class(ckpt_dir, store)
        try:
            lock.acquire()
        except LockError as e:
            raise CheckpointError(str(e)) from None
        held.append(lock)
    on_rank0_then_share(take, group, CheckpointError)
    return held[0] if held else None

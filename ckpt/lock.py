"""One job per ckpt.dir: rank 0 takes <ckpt.dir>/.lock with the lock class its storage backend names (a folder's
flock, an object store's compare-and-swap: ckpt/storage/lock.py has both protocols), and every rank raises rank 0's
refusal. Before it, every rank refuses a storage backend that one process or one node sees alone where the job spans
more (Storage.sharing_problem). On an object store, rank 0 first proves that the store enforces the create-only writes and the
compare-and-swap the lock and the commit marker rely on (Storage.check_guarantees, ckpt/storage/base.py).

    python -m pytest tests/test_ckpt_unit.py -q -k lock
"""

from __future__ import annotations

import torch.distributed as dist

from common.dist import on_rank0_then_share
from .errors import CheckpointError
from .storage import storage_for
from .storage.base import GuaranteeError
from .storage.lock import STALE_S, DirLock, LockError, ObjectLock, not_writable  # noqa: F401 - imported from here

UNCHECKED_STORE = "ckpt.unchecked_store=true"  # how a user runs on a store that fails the probe, for its error line


def lock_for_job(ckpt_dir: str, group, unchecked_store: bool = False, nodes: int = 1) -> DirLock | ObjectLock | None:
    """Rank 0 takes <ckpt_dir>/.lock and returns it, held until `release()`; the other ranks return None. If
    another live job holds it, every rank raises CheckpointError with rank 0's message. Before that, on an object
    store: if the store does not enforce create-only writes or compare-and-swap, every rank raises, unless
    `unchecked_store` (then rank 0 writes one warning line). `nodes`: how many nodes the job's ranks run on."""
    processes = dist.get_world_size() if dist.is_initialized() else 1
    problem = storage_for(ckpt_dir).sharing_problem(ckpt_dir, processes, nodes)
    if problem:  # the same verdict on every rank: no collective
        raise CheckpointError(problem)
    held: list = []

    def take() -> None:  # returns nothing: the lock (an open file, a heartbeat thread) stays on rank 0
        store = storage_for(ckpt_dir)
        lock = store.lock_class(ckpt_dir, store)
        try:
            try:
                store.check_guarantees(ckpt_dir, unchecked_store, UNCHECKED_STORE, lock.warn)
            except OSError as e:  # the probe's requests: the store unreachable, or refusing access
                raise not_writable(ckpt_dir, e) from None
            lock.acquire()
        except (LockError, GuaranteeError) as e:
            raise CheckpointError(str(e)) from None
        held.append(lock)
    on_rank0_then_share(take, group, CheckpointError)
    return held[0] if held else None

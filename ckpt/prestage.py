"""The async stager's host buffers, allocated before the first save in a background thread, so that the first
save blocks training no longer than the next ones.

    python -m pytest tests/test_staging_wait.py -q

DCP's StateDictStager keeps one host buffer per source storage (a parameter shard, an AdamW moment) and reuses
it on every later save; the first save allocates them all on the training thread (shared memory in process
mode), faulting in every page: at 0.5B parameters 4.5 s of blocking against 0.8 s for the next save. Here the
same buffers are created ahead of time and entered in the stager's cache, with zeros written to fault the
pages in; the first save then only copies. Nothing reads the live tensors off the training thread: the state
dict is built on the caller's thread (it only holds references) and the thread touches new memory only.
The first save joins the thread first (DCP's stager is not thread-safe), so at worst it waits for what it
would otherwise have done itself.
"""

from __future__ import annotations

import threading

import torch
from torch.distributed.checkpoint.staging import DefaultStager
from torch.distributed.checkpoint.stateful import Stateful

from .uploader import make_stager


def _local_storages(obj, out: dict) -> dict:
    """id -> untyped storage of every plain tensor in `obj` (DTensors by their local shard), as the stager
    keys its cache."""
    if isinstance(obj, dict):
        for v in obj.values():
            _local_storages(v, out)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _local_storages(v, out)
    elif isinstance(obj, torch.Tensor):
        local = obj.to_local() if hasattr(obj, "to_local") else obj
        storage = local.untyped_storage()
        out.setdefault(id(storage), storage)
    return out


def _allocate(stager: DefaultStager, storages: list) -> None:
    inner = stager._state_dict_stager  # the one place that reaches into DCP's stager
    if inner.pin_memory:  # CUDA: DCP stages in the background already, and registers the unpinning itself
        return
    cache = inner._cached_storage_mapping
    with torch.no_grad():
        for storage in storages:
            if storage in cache:
                continue
            buf = (type(storage)._new_shared(storage.size(), device="cpu") if inner.share_memory
                   else type(storage)(storage.size(), device="cpu"))
            buf.fill_(0)  # fault the pages in here, not on the training thread
            cache[storage] = buf


def allocate_in_background(stager: DefaultStager, state: dict) -> threading.Thread:
    """Start allocating `stager`'s buffers for `state` (Statefuls and plain values, as saved); join the
    returned thread before the stager is used."""
    flat = {k: v.state_dict() if isinstance(v, Stateful) else v for k, v in state.items()}
    storages = list(_local_storages(flat, {}).values())
    thread = threading.Thread(target=_allocate, args=(stager, storages), name="ckpt-staging-alloc", daemon=True)
    thread.start()
    return thread


class ReusedStager:
    """The one stager of a run's async saves: made once, its buffers allocated ahead of the first save when
    `prepare` is called, reused by every save (only the first would allocate), closed at the end."""

    def __init__(self, async_mode: str):
        self.async_mode = async_mode
        self._stager: DefaultStager | None = None
        self._allocating: threading.Thread | None = None

    def prepare(self, state: dict) -> None:
        """Allocate the buffers `state`'s saves stage into, in the background; once, after the optimizer
        state exists. A no-op for sync saves and after the first call."""
        if self.async_mode != "off" and self._stager is None:
            self._stager = make_stager(self.async_mode)
            self._allocating = allocate_in_background(self._stager, state)

    def ready(self) -> DefaultStager:
        """The stager, its background allocation finished (DCP's stager is not thread-safe)."""
        if self._stager is None:
            self._stager = make_stager(self.async_mode)
        if self._allocating is not None:
            self._allocating.join()
            self._allocating = None
        return self._stager

    def close(self) -> None:
        if self._stager is not None:
            self.ready().close()
            self._stager = None

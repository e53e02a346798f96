"""The async stager of CPU-resident state: host buffers allocated before the first save in a background thread and
reused by every save, which then only copies, so a save blocks training for about one copy of the rank's bytes.

    python -m pytest tests/test_staging_wait.py -q

`HostStager` is DCP's AsyncStager for state that lives in host memory (CPU training; `make_stager` picks DCP's
DefaultStager on CUDA, which stages with pinned memory on a stream in the background). Per source storage (a
parameter shard, an AdamW moment) it keeps one buffer (of only the tensor's bytes where the tensor is a contiguous
part of the storage: _span), shared memory in process mode, and per source tensor the staged tensor over that
buffer (a DTensor with the source's placement). A save walks the state, copies each into its buffer and returns
the cached staged tensors: nothing is allocated, no tensor is built. DCP's DefaultStager on CPU deep-copies every
tensor on every save (a new DTensor each time, ~0.6 ms per tensor here: 0.25 s per save at 400 tensors, as much
as the copy itself).
`allocate` makes the buffers and staged tensors ahead of the first save, writing zeros so the pages are faulted
in off the training thread; the state dict it reads is built on the caller's thread (it only holds references)
and the thread touches new memory only. The first save joins it first (the stager is not thread-safe).
"""

from __future__ import annotations

import copy
import threading

import torch
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor
from torch.utils.weak import WeakIdKeyDictionary


class HostStager:
    """DCP's AsyncStager protocol: `stage(state_dict)` returns the staged copy (done when it returns), `close()`.
    Buffers live as long as their source storage (weakly keyed, like DCP's) or until close()."""

    _synchronize_after_execute = False  # the copy is complete when stage() returns: nothing to wait for

    def __init__(self, shared: bool):
        self.shared = shared  # process mode: the uploader process maps the same pages
        # source storage -> (its size, {span of its bytes: (buffer, {layout of a source tensor: staged tensor})})
        self._staged = WeakIdKeyDictionary()

    @property
    def should_synchronize_after_execute(self) -> bool:
        return self._synchronize_after_execute

    def synchronize_staging(self) -> None:
        pass

    @torch.no_grad()
    def stage(self, state_dict):
        """A copy of `state_dict` whose tensors are this stager's buffers, holding the current values."""
        return self._walk(state_dict, copied=set())

    @torch.no_grad()
    def allocate(self, tensors: list) -> None:
        """Make the buffers (pages faulted in) and staged tensors of `tensors` without copying their values."""
        for t in tensors:
            self._staged_tensor(t, copied=None)

    def buffers(self) -> list:
        """Every staging buffer, one per span of a live source storage."""
        return [buf for _, spans in self._staged.values() for buf, _ in spans.values()]

    def close(self) -> None:
        self._staged = WeakIdKeyDictionary()

    def _walk(self, x, copied: set | None):
        if isinstance(x, dict):
            return {k: self._walk(v, copied) for k, v in x.items()}
        if type(x) in (list, tuple):
            return type(x)(self._walk(v, copied) for v in x)
        if isinstance(x, torch.Tensor):
            return self._staged_tensor(x, copied)
        return copy.deepcopy(x)  # step counters, learning rates, the data position, RNG bytes: small

    def _staged_tensor(self, t: torch.Tensor, copied: set | None) -> torch.Tensor:
        """The staged tensor of `t`; its span's buffer takes the current bytes once per save (`copied`: the
        spans copied in this save; None: allocate only)."""
        local = t.to_local() if isinstance(t, DTensor) else t
        storage = local.untyped_storage()
        start, nbytes = span = _span(local)
        spans = self._spans_of(storage)
        if span not in spans:
            buf = torch.UntypedStorage._new_shared(nbytes) if self.shared else torch.UntypedStorage(nbytes)
            buf.fill_(0)  # fault the pages in now (ahead of the first save: in the background)
            spans[span] = (buf, {})
        buf, views = spans[span]
        if copied is not None and (id(storage), span) not in copied:
            _bytes(buf, 0, nbytes).copy_(_bytes(storage, start, nbytes))
            copied.add((id(storage), span))
        layout = (local.storage_offset(), tuple(local.shape), tuple(local.stride()), local.dtype,
                  (t.device_mesh, t.placements, tuple(t.shape), tuple(t.stride())) if isinstance(t, DTensor) else None)
        if layout not in views:
            offset = local.storage_offset() - start // local.element_size()
            staged = torch.empty(0, dtype=local.dtype).set_(buf, offset, local.shape, local.stride())
            if isinstance(t, DTensor):
                staged = DTensor.from_local(staged, t.device_mesh, t.placements, run_check=False, shape=t.shape,
                                            stride=t.stride())
            views[layout] = staged
        return views[layout]

    def _spans_of(self, storage) -> dict:
        """The staged spans of `storage`, dropped when it was resized since."""
        if storage not in self._staged or self._staged[storage][0] != storage.nbytes():
            self._staged[storage] = (storage.nbytes(), {})
        return self._staged[storage][1]


def _span(local: torch.Tensor) -> tuple[int, int]:
    """(first byte, byte count) of its storage that the staged copy of `local` holds: a contiguous tensor's own
    bytes, else the whole storage. DCP clones, before writing it, every tensor whose storage holds more than its
    own bytes (FSDP2's last shard of an uneven dim 0 is such a view: with ckpt_bench's 289M shape, rank 1's two
    1194 x 896 MLP shards of every layer), so staging only those bytes spares the uploader a copy and its
    allocation at every save."""
    if local.is_contiguous() and local.nbytes > 0:
        return local.storage_offset() * local.element_size(), local.nbytes
    return 0, local.untyped_storage().nbytes()


def _bytes(storage, start: int, nbytes: int) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8).set_(storage, start, (nbytes,))


def make_stager(async_mode: str) -> HostStager | DefaultStager:
    """The stager of a run's async saves, reused across them. On CUDA, DCP's own: pinned host buffers filled on a
    stream in the background (StateDictStager caches them per source storage, so only the first save allocates).
    Shared memory in process mode, so the uploader process reads the staged copy with no copy of its own."""
    if not torch.cuda.is_available():
        return HostStager(shared=async_mode == "process")
    return DefaultStager(StagingOptions(use_pinned_memory=True, use_shared_memory=async_mode == "process",
                                        use_async_staging=True, use_non_blocking_copy=True))


def _tensors(obj, out: list) -> list:
    if isinstance(obj, dict):
        for v in obj.values():
            _tensors(v, out)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _tensors(v, out)
    elif isinstance(obj, torch.Tensor):
        out.append(obj)
    return out


def allocate_in_background(stager: HostStager, state: dict) -> threading.Thread:
    """Start allocating `stager`'s buffers for `state` (Statefuls and plain values, as saved); join the
    returned thread before the stager is used."""
    flat = {k: v.state_dict() if isinstance(v, Stateful) else v for k, v in state.items()}
    thread = threading.Thread(target=stager.allocate, args=(_tensors(flat, []),), name="ckpt-staging-alloc",
                              daemon=True)
    thread.start()
    return thread


class ReusedStager:
    """The one stager of a run's async saves: made once, its buffers allocated ahead of the first save when
    `prepare` is called, reused by every save (only the first would allocate), closed at the end."""

    def __init__(self, async_mode: str):
        self.async_mode = async_mode
        self._stager: HostStager | DefaultStager | None = None
        self._allocating: threading.Thread | None = None

    def prepare(self, state: dict) -> None:
        """Allocate the buffers `state`'s saves stage into, in the background; once, after the optimizer
        state exists. A no-op for sync saves, after the first call, and on CUDA (DCP stages in the background)."""
        if self.async_mode != "off" and self._stager is None:
            self._stager = make_stager(self.async_mode)
            if isinstance(self._stager, HostStager):
                self._allocating = allocate_in_background(self._stager, state)

    def ready(self) -> HostStager | DefaultStager:
        """The stager, its background allocation finished (a stager is not thread-safe)."""
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

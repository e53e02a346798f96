"""The garbage collector on DCP's coordinator during a save or a load: paused while it plans (and finishes), and
what the save leaves alive (DCP's plan cache) frozen after it.

    python -m pytest tests/test_hang.py -q -n 0 -k collector
    python bench/scale_beat.py --worlds 64 --out /tmp/b.json      # the beat gaps it removes, at the 70B shape

Rank 0 of the checkpoint group gathers W local plans, builds the global plan and DCP's Metadata (T x W chunks: ~10
Python objects each) and keeps them in DCP's plan cache for the next saves. Python's cyclic collector then runs
full (gen-2) collections over all of them, each one C call that holds the GIL: measured at the 70B shape and W=64
(bench/results/scale_beat.json), up to 2.9 CPU-seconds in one, and the objects grow with W. In a save on the
training process (ckpt.async_mode off or thread) the hang watchdog's beat thread (finetune/hang.py) waits for the
GIL meanwhile, and a reader's window (3 x CHECK_S) then calls the healthy coordinator frozen: a false hang, exit
76. So the coordinator's save runs with the collector disabled (reference counting still frees what it drops), and
afterwards gc.freeze() moves what is alive into the permanent generation, which later collections skip; then the
collector is enabled again as it was. The cost: a reference cycle made during the save is never collected (DCP's
own: a few objects per save). Process mode's coordinator is the uploader process, which runs no watchdog: untouched.
Saves that overlap (an async upload, the memory tier) are counted: the last one out freezes and enables.
The same pause serves the two other places rank 0 holds W plans: the global save plan itself (save_plan.py: in
process mode too, where it is only for speed) and a resume's dcp.load (resume.py: rank 0 unpickles W load plans at
startup, a phase the readers also check; profiled at the 70B shape and W=64, the collector was most of that
unpickling's time).
"""

from __future__ import annotations

import contextlib
import gc
import threading
from concurrent.futures import Future
from typing import Callable

import torch.distributed as dist


class _Pause:
    def __init__(self):
        self.lock, self.saves, self.was_enabled = threading.Lock(), 0, True

    def enter(self) -> None:
        with self.lock:
            if self.saves == 0:
                self.was_enabled = gc.isenabled()
                gc.disable()
            self.saves += 1

    def leave(self) -> None:
        with self.lock:
            self.saves -= 1
            if self.saves == 0:
                gc.freeze()  # O(1): the permanent generation takes every tracked object, none is traversed
                if self.was_enabled:
                    gc.enable()


_PAUSE = _Pause()


def coordinates(pg) -> bool:
    """Whether this process is DCP's coordinator for a save on `pg` (its rank 0)."""
    return not dist.is_initialized() or dist.get_rank(pg) == 0


@contextlib.contextmanager
def paused(coordinator: bool):
    """Around a save on the calling thread: the collector paused on the coordinator, what it leaves frozen."""
    if not coordinator:
        yield
        return
    _PAUSE.enter()
    try:
        yield
    finally:
        _PAUSE.leave()


def paused_until(coordinator: bool) -> Callable[[Future | None], None]:
    """An async save's: pause now (before DCP's thread starts planning); returns what ends the pause, to be called
    once with the upload's future (added as its done callback) or with None when the save did not start."""
    if not coordinator:
        return lambda future: None
    _PAUSE.enter()

    def until(future: Future | None) -> None:
        if future is None:
            _PAUSE.leave()
        else:
            future.add_done_callback(lambda _: _PAUSE.leave())
    return until

"""Stragglers: the rank persistently slower than the others is named in the log and in a `straggler` event.

    python -m pytest tests/test_hang.py -q -k straggler

Per step each rank splits its step time into waiting (blocked in the step's own collectives: the loss-token count
at its start and the loss at its end, see `waiting`) and computing (the rest). A slower rank reaches those
collectives late: its computing share grows, the others' waiting shares do. Every log interval two one-element
all_reduces tell every rank the slowest rank, its compute seconds (MAX of compute packed with the rank) and the
mean (SUM): O(1) bytes per rank, never a gather of W values. When the slowest rank's compute exceeds the mean by
more than train.straggler_margin for PERSISTENT intervals in a row, rank 0 logs one line and a `straggler` event
(step, rank, compute_s, mean_compute_s, margin); again only once another rank is the slowest, or it recovered.
"""

from __future__ import annotations

import contextlib
import time

import torch
import torch.distributed as dist

PERSISTENT = 3  # log intervals in a row before a rank is called a straggler
_PACK = 1e6  # compute microseconds, packed with the rank into one float64 (exact below 2**53)


class StragglerMonitor:
    def __init__(self, margin: float, log_interval: int, rank: int, world_size: int, device, log):
        """`margin`: train.straggler_margin (0: off); `log_interval`: run.log_interval; `log`: the run's RankZeroLog."""
        self.margin, self.log_interval, self.rank, self.world_size, self.device, self.log = (
            margin, log_interval, rank, world_size, device, log)
        self.compute_s = 0.0  # this rank's compute seconds since the last log interval
        self.streak = (None, 0)  # (slowest rank, intervals in a row over the margin)
        self.reported = None

    @property
    def on(self) -> bool:
        return self.margin > 0 and self.world_size > 1

    @contextlib.contextmanager
    def timed(self, step: int):
        """Around training `step`: its time counts as computing, less what `waiting` takes out. At a log
        interval, afterwards, the collective verdict (every rank reaches the same steps)."""
        t0 = time.perf_counter()
        yield
        self.compute_s += time.perf_counter() - t0
        if step % self.log_interval == 0:
            self.compare(step)

    @contextlib.contextmanager
    def waiting(self):
        """Around a collective of the step and the read of its result: that time is waiting, not computing."""
        t0 = time.perf_counter()
        yield
        self.compute_s -= time.perf_counter() - t0

    def compare(self, step: int) -> None:
        """Collective: every rank calls it at the same steps (each log interval)."""
        if not self.on:
            return
        packed = torch.tensor([round(max(self.compute_s, 0.0) * _PACK) * self.world_size + self.rank],
                              dtype=torch.float64, device=self.device)
        total = torch.tensor([self.compute_s], dtype=torch.float64, device=self.device)
        dist.all_reduce(packed, op=dist.ReduceOp.MAX)
        dist.all_reduce(total)
        self.compute_s = 0.0
        slowest_packed = int(packed.item())
        slowest, slowest_s = slowest_packed % self.world_size, (slowest_packed // self.world_size) / _PACK
        mean_s = total.item() / self.world_size
        over = slowest_s / mean_s - 1 if mean_s > 0 else 0.0
        self._judge(step, slowest, slowest_s, mean_s, over)

    def _judge(self, step: int, slowest: int, slowest_s: float, mean_s: float, over: float) -> None:
        if over <= self.margin:
            self.streak, self.reported = (None, 0), None
            return
        rank, n = self.streak
        self.streak = (slowest, n + 1 if rank == slowest else 1)
        if self.streak[1] >= PERSISTENT and self.reported != slowest:
            self.reported = slowest
            self.log.info(f"straggler: rank {slowest} computed {slowest_s:.3f}s against a mean of {mean_s:.3f}s "
                          f"(+{over:.0%}, train.straggler_margin {self.margin:g}) for {PERSISTENT} log intervals "
                          f"in a row, up to step {step}")
            self.log.event("straggler", step=step, rank=slowest, compute_s=round(slowest_s, 6),
                           mean_compute_s=round(mean_s, 6), margin=round(over, 4))

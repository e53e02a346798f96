"""Stragglers: the rank persistently slower than the others is named in the log and in a `straggler` event.

    python -m pytest tests/test_hang.py -q -k straggler

Per step each rank splits its step time into waiting (blocked in the step's own collectives: the loss-token count
at its start and the loss at its end, see `waiting`; and inside FSDP's pre-forward hook of each block, where the
block's all-gather is waited for, see `watch_blocks`) and computing (the rest). A slower rank reaches those
collectives late: its computing share grows, the others' waiting shares do. On CUDA the host only launches
kernels and every rank's host waits alike (FSDP's collectives tie the ranks together on the device), so there a
rank's compute is its device's own time in the blocks' forward: CUDA events recorded on the compute stream after
FSDP made it wait for the block's all-gather and before its post-forward, summed once the step has synchronised
(two events per block and micro batch, read at the end of each step: bounded by the config, not the world size),
plus its host's own time from the step's start to its first block's pre-forward (taking the batch, the H2D copies,
a GC pause, CPU contention; the step's collectives there, `waiting`, taken out). Not counted on CUDA: host time
after the first block's start (between blocks, in backward, in the optimizer step), which overlaps the device's
work and cannot be told from a wait on it by the host's clock.
Every log interval two one-element all_reduces tell every rank the slowest rank, its compute seconds (MAX of compute packed with the rank) and the
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
        self.on_device = device.type == "cuda"  # compute is the device's time in the blocks (CUDA events)
        self.in_step, self._hook_t0, self._events = False, None, []  # events: (start, end) pairs, CUDA only
        # CUDA: the host's own time from the step's start to its first block (data, H2D, a GC pause, CPU contention),
        # less its waits in the step's collectives meanwhile: (step start, waited so far), None once a block began
        self._host = None

    def watch_blocks(self, blocks) -> None:
        """Hooks on each fully_shard-ed block: one before FSDP's pre-forward and one after (between them: the
        wait for the block's all-gather, subtracted on the host), one before FSDP's post-forward (on CUDA: the
        block's forward on the device, between two events). Only inside `timed` steps (not eval, not sample).
        With model.compile=true the hooks run inside each block's compiled call: kept out of dynamo (it would trace
        torch.cuda.Event into the graph, and guard on this monitor's state, recompiling the block at every call)."""
        if not self.on:
            return
        for block in blocks:
            block.register_forward_pre_hook(self._before_fsdp, prepend=True)  # runs before FSDP's own (prepended)
            block.register_forward_pre_hook(self._block_begins)
            block.register_forward_hook(self._block_ends, prepend=True)

    @torch._dynamo.disable  # not traced into a compiled block (as FSDP keeps its own hooks out)
    def _before_fsdp(self, _module, _args) -> None:
        self._hook_t0 = time.perf_counter() if self.in_step else None
        if self._host is not None and self._hook_t0 is not None:  # the step's first block: its host part is over
            start, waited = self._host
            self.compute_s += self._hook_t0 - start - waited
            self._host = None

    @torch._dynamo.disable  # not traced into a compiled block (as FSDP keeps its own hooks out)
    def _block_begins(self, _module, _args) -> None:
        if self._hook_t0 is not None and not self.on_device:
            self.compute_s -= time.perf_counter() - self._hook_t0  # waiting for the block's all-gather
        self._hook_t0 = None
        if self.in_step and self.on_device:
            self._events.append([torch.cuda.Event(enable_timing=True), None])
            self._events[-1][0].record()

    @torch._dynamo.disable  # not traced into a compiled block (as FSDP keeps its own hooks out)
    def _block_ends(self, _module, _args, _out) -> None:
        if self.in_step and self.on_device and self._events and self._events[-1][1] is None:
            self._events[-1][1] = torch.cuda.Event(enable_timing=True)
            self._events[-1][1].record()

    def _device_compute_s(self) -> float:
        """The blocks' forward time on this rank's device since the last call (the step has synchronised)."""
        events, self._events = self._events, []
        return sum(start.elapsed_time(end) for start, end in events if end is not None) / 1000

    @property
    def on(self) -> bool:
        return self.margin > 0 and self.world_size > 1

    @contextlib.contextmanager
    def timed(self, step: int):
        """Around training `step`: its time counts as computing, less what `waiting` takes out. At a log
        interval, afterwards, the collective verdict (every rank reaches the same steps)."""
        t0, self.in_step = time.perf_counter(), True
        self._host = (t0, 0.0) if self.on_device else None
        try:
            yield
        finally:
            self.in_step, self._host = False, None
        if self.on_device:
            self.compute_s += self._device_compute_s()
        else:
            self.compute_s += time.perf_counter() - t0
        if step % self.log_interval == 0:
            self.compare(step)

    @contextlib.contextmanager
    def waiting(self):
        """Around a collective of the step and the read of its result: that time is waiting, not computing."""
        t0 = time.perf_counter()
        yield
        if not self.on_device:
            self.compute_s -= time.perf_counter() - t0
        elif self._host is not None:  # before the step's first block: not the host's own time
            self._host = (self._host[0], self._host[1] + time.perf_counter() - t0)

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

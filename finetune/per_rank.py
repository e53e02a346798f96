"""Per-rank values at rank 0, once per log interval: each rank's peak memory, and the pattern for any per-rank value.

    python -m pytest tests/test_per_rank.py -q

The pattern (docs/loggers.md, "Per-rank values"): each rank measures a few numbers; at a log interval (every rank
reaches the same steps) `gather_to_rank0` brings them to rank 0 in one dist.gather of k float64s per rank, a CPU
tensor: the values are host numbers already, and with the "cpu:gloo,cuda:nccl" default group a CPU tensor goes
over gloo, whose full mesh is open since init, not over NCCL (a CUDA tensor there: a NCCL gather, rank 0 setting
up point-to-point connections to each of W-1 peers on its GPU, and a device sync). Rank 0 records each as a list
indexed by rank in that step's metrics.jsonl record; finetune/loggers.py PER_RANK sends every entry to TensorBoard
and W&B as <name>/rank_<r>; `python -m finetune.metrics` draws a per-rank panel.
Cost at 2048 ranks, k = 2 numbers: every rank but 0 sends one 16 B message to rank 0, which receives 2047 of them
(32 KiB) one after another over TCP, per log interval (not per step); metrics.jsonl grows by ~40 KB per interval.

Peak memory, this rank's since the previous interval (the peak is reset after each read):
- CUDA: torch.cuda.max_memory_allocated (`peak_memory_gib`, what tensors held) and max_memory_reserved
  (`peak_reserved_gib`, what the caching allocator took from the GPU: what runs out first in an OOM).
- CPU: the process's peak resident set (VmHWM in /proc/self/status), reset by writing 5 to
  /proc/self/clear_refs (Linux >= 4.0); where that is refused, the peak since the process started.
A rank whose peak is FAR_RATIO times the median of the other ranks' and at least FAR_GIB above it is named at the
end of the step line: the rank that is about to run out of memory first, and by how much.
"""

from __future__ import annotations

import contextlib
import statistics

import torch
import torch.distributed as dist

from common.procfs import kib_field

GIB = 2 ** 30
FAR_RATIO, FAR_GIB = 1.2, 1.0  # "far above the others": 20% above their median and 1 GiB (not noise on small runs)


def gather_to_rank0(values: list[float], rank: int, world_size: int) -> list[list[float]] | None:
    """Every rank's `values` (the same count on each), on rank 0 as [rank][i]; None on the other ranks.
    Collective: every rank calls it at the same step; over the default group's CPU backend (gloo)."""
    mine = torch.tensor(values, dtype=torch.float64)  # on the CPU whatever the training device: gloo, not NCCL
    if world_size == 1:
        return [values]
    bucket = [torch.empty_like(mine) for _ in range(world_size)] if rank == 0 else None
    dist.gather(mine, bucket, dst=0)
    return [t.tolist() for t in bucket] if rank == 0 else None


class PeakMemory:
    """This rank's peak memory since the last `read()`, in GiB, by name (the record's fields)."""

    def __init__(self, device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.names = ("peak_memory_gib", "peak_reserved_gib") if self.cuda else ("peak_memory_gib",)

    def read(self) -> list[float]:
        if self.cuda:
            peaks = [torch.cuda.max_memory_allocated(self.device), torch.cuda.max_memory_reserved(self.device)]
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            peaks = [kib_field("/proc/self/status", "VmHWM")]
            with contextlib.suppress(OSError):  # refused: the peak since the start, still a peak
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")
        return [round(b / GIB, 4) for b in peaks]


def far_above(peaks: list[float]) -> tuple[int, float] | None:
    """(rank, median of the others) when the highest peak is far above the other ranks' median, else None."""
    if len(peaks) < 2:
        return None
    top = max(range(len(peaks)), key=peaks.__getitem__)
    others = statistics.median(p for r, p in enumerate(peaks) if r != top)
    return (top, others) if 0 < others * FAR_RATIO <= peaks[top] and peaks[top] - others >= FAR_GIB else None


class RankPeaks:
    """Per log interval: every rank's peak memory at rank 0 (the record's fields) and, when one rank's is far
    above the others', the words the step line ends with."""

    def __init__(self, rank: int, world_size: int, device):
        self.rank, self.world_size, self.device = rank, world_size, device
        self.memory = PeakMemory(device)

    def gather(self) -> dict[str, list[float]]:
        """Collective. {field: [value of rank 0, 1, ...]} on rank 0; {} elsewhere."""
        rows = gather_to_rank0(self.memory.read(), self.rank, self.world_size)
        return {} if rows is None else {name: [row[i] for row in rows] for i, name in enumerate(self.memory.names)}

    @staticmethod
    def warning(fields: dict[str, list[float]]) -> str:
        """' | peak memory: rank 3 31.20 GiB, 1.5x the others' median 20.80 GiB' when one is far above; else ''."""
        peaks = fields.get("peak_memory_gib", [])
        far = far_above(peaks)
        if far is None:
            return ""
        rank, others = far
        return (f" | peak memory: rank {rank} {peaks[rank]:.2f} GiB, {peaks[rank] / others:.1f}x the others' "
                f"median {others:.2f} GiB")

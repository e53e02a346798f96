"""The global order of samples and the batch stream: what exact resume depends on.

    python -m pytest tests/test_data.py -q -k "world_size or order or resume_position or batch_split"

The order of samples is a pure function of (seed, epoch, global sample index), so the only data
state a checkpoint needs is one integer: how many samples the whole job has consumed. Rank r of W
takes a contiguous slice of each global batch, so the union over ranks of global batch b is the same
set of samples for any W, and resuming at another world size continues the exact same stream.
Change nothing here without the bit-identical resume tests (tests/test_world_size.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from finetune.data.errors import DataError
from common.dist import divisibility_problem

BATCH_KEY = "data.global_batch_size"  # the config key BatchSplit splits over the ranks (named in its errors)


@dataclass(frozen=True)
class BatchSplit:
    """How one global batch is split: ranks x accumulation steps x micro batch."""
    global_batch: int
    world_size: int
    micro_batch: int
    accum_steps: int

    @staticmethod
    def make(global_batch: int, micro_batch: int, world_size: int) -> "BatchSplit":
        """The global batch is fixed; micro_batch is an upper bound (memory), lowered to the largest divisor
        of the per-rank batch, so any world size that divides the global batch works, e.g. on a resume."""
        problem = divisibility_problem(BATCH_KEY, global_batch, world_size)
        if problem:
            raise DataError(problem)
        per_rank = global_batch // world_size
        micro = max(m for m in range(1, min(micro_batch, per_rank) + 1) if per_rank % m == 0)
        return BatchSplit(global_batch, world_size, micro, per_rank // micro)


class GlobalOrder:
    """Global sample index g -> row of the data set: a fresh permutation per epoch from (seed, epoch)."""

    def __init__(self, num_rows: int, seed: int):
        self.num_rows, self.seed, self._perms = num_rows, seed, {}

    def row(self, g: int) -> int:
        epoch, pos = divmod(g, self.num_rows)
        if epoch not in self._perms:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perms = {epoch: torch.randperm(self.num_rows, generator=gen).numpy()}  # keep one epoch
        return int(self._perms[epoch][pos])

    def rows(self, start: int, count: int) -> list[int]:
        return [self.row(g) for g in range(start, start + count)]


class BatchStream:
    """Yields this rank's micro batches of each global batch; its only state is the global position.

    `position` counts samples consumed by the whole job (all ranks), so it means the same at any
    world size. Stateful: state_dict()/load_state_dict() go into every checkpoint.
    """

    def __init__(self, samples, seed: int, epochs: int, split: BatchSplit, rank: int):
        self.samples, self.split, self.rank = samples, split, rank
        self.order = GlobalOrder(len(samples), seed)
        self.total = epochs * len(samples)
        self.position = 0

    def has_next(self) -> bool:
        return self.position + self.split.global_batch <= self.total

    def global_rows(self) -> list[int]:
        """Rows of the next global batch in order (what every rank together will consume)."""
        return self.order.rows(self.position, self.split.global_batch)

    def next_global_batch(self) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
        """This rank's micro batches (input_ids, labels, position_ids) of the next global batch; advances position."""
        p = self.split
        per_rank = p.global_batch // p.world_size
        rows = self.order.rows(self.position + self.rank * per_rank, per_rank)
        self.position += p.global_batch
        return [self.samples.batch(rows[i: i + p.micro_batch]) for i in range(0, per_rank, p.micro_batch)]

    def state_dict(self) -> dict:
        return {"position": self.position, "num_rows": len(self.samples), "seed": self.order.seed}

    def load_state_dict(self, state: dict) -> None:
        if state["num_rows"] != len(self.samples):
            raise DataError(f"checkpoint was made on a data set of {state['num_rows']} samples, this one has "
                            f"{len(self.samples)}; the data position cannot be continued")
        self.position = int(state["position"])
        if int(state.get("seed", self.order.seed)) != self.order.seed:  # only allowed by ckpt.resume_config_check=warn
            self.order = GlobalOrder(len(self.samples), int(state["seed"]))  # the position counts in that order

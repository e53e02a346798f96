"""The save planner's global step on the coordinator, with a check of the global plan that is O(n log n) in chunks
instead of torch's O(W^2) for tensors FSDP shards along a dimension other than their largest.

    python -m pytest tests/test_save_plan.py -q -n 0
    python bench/scale_coord.py --worlds 8 --plan-worlds 16,64 --plan-only --out /tmp/c.json   # rank 0's plan step

Why: DCP's coordinator checks the global save plan (torch 2.13 default_planner._validate_global_plan): every chunk in
bounds, no two chunks of a tensor overlapping, the chunks' volumes adding up to the tensor's. Its overlap check
sweeps along each tensor's LARGEST dimension. FSDP shards along dim 0; for k_proj, v_proj (1,024 x 8,192 at 70B) and
down_proj (8,192 x 28,672) dim 1 is larger, every chunk spans all of it, no chunk ever leaves the sweep's active
set, and torch compares all W^2/2 pairs: 3 of a Llama layer's 9 weights, times 3 with the AdamW moments, at every
first save (job start, every resume). `validate_global_plan` makes the same checks, with the same messages, but
sweeps along the dimension whose chunk offsets are most distinct (the one the chunks are split on): an FSDP shard
then meets only its neighbours. For the same chunks it finds exactly the pairs torch's finds (any sweep dimension
reaches every overlapping pair; see the function), so a plan is refused or accepted alike.
Upstream change that makes this module unnecessary: `_validate_global_plan` choosing its sweep dimension from the
chunks (most distinct offsets) instead of the tensor's size; then `save_planner` can go back to DefaultSavePlanner.
"""

from __future__ import annotations

import logging
import math
import sys
from bisect import bisect_right, insort
from collections import ChainMap

import torch.distributed.checkpoint.default_planner as dp
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, ChunkStorageMetadata, Metadata
from torch.distributed.checkpoint.planner import SavePlan

logger = logging.getLogger(__name__)


def sweep_dim(chunks: list[ChunkStorageMetadata]) -> int:
    """The dimension the chunks are split on: the one with the most distinct offsets (the first of equals)."""
    dims = len(chunks[0].offsets)
    return max(range(dims), key=lambda d: len({c.offsets[d] for c in chunks}))


def overlapping(key: str, chunks: list[ChunkStorageMetadata]) -> list[str]:
    """torch's message for each pair of `chunks` that torch's `_check_box_overlap` says overlap.

    A sweep along any dimension d meets every such pair: sorted by their start along d, chunk i (earlier) is still
    active when j comes, because i is dropped only once a start reaches i's end, and overlapping means j starts
    before i ends. Along the split dimension the active set holds the chunks that straddle the current start: one or
    two for FSDP's shards, the chunks of one row for a grid (so a grid of a x b chunks costs n x min(a, b))."""
    d = sweep_dim(chunks)
    order = sorted(range(len(chunks)), key=lambda i: (chunks[i].offsets[d], *chunks[i].offsets))
    active: list[tuple[int, int]] = []  # (end along d, chunk), sorted by end
    errors = []
    for i in order:
        current = chunks[i]
        start = current.offsets[d]
        del active[:bisect_right(active, (start, sys.maxsize))]  # the chunks that end at or before this start
        for _, j in active:
            if dp._check_box_overlap(current, chunks[j]):  # looked up on the module: the tests count the calls
                msg = f"key:{key} has overlapping chunks: {current} {chunks[j]}"
                logger.warning(msg)
                errors.append(msg)
        insort(active, (start + current.sizes[d], i))
    return errors


def validate_global_plan(global_plan: list[SavePlan], metadata: Metadata) -> list[str]:
    """torch's `_validate_global_plan` (same checks, same messages; overlap pairs in another order)."""
    errors: list[str] = []
    for key, value in metadata.state_dict_metadata.items():
        if isinstance(value, BytesStorageMetadata) or len(value.size) == 0:
            continue
        volume = 0
        for chunk in value.chunks:
            if not dp._check_box_bounds(value.size, chunk):
                msg = f"key:{key} has out of bounds chunk: tensor-size:{value.size} chunk: {chunk}"
                logger.warning(msg)
                errors.append(msg)
            volume += math.prod(chunk.sizes)
        if len(value.chunks) > 1:
            errors += overlapping(key, value.chunks)
        if len(global_plan) > 1 and volume != math.prod(value.size):
            msg = f"key:{key} invalid fill tensor-volume: {math.prod(value.size)} chunks-volume: {volume}"
            logger.warning(msg)
            errors.append(msg)
    return errors


class SweepSavePlanner(dp.DefaultSavePlanner):
    """DefaultSavePlanner (plan caching and all) whose global plan is checked by `validate_global_plan`.

    `_create_global_plan` is the narrowest hook: torch 2.13's calls the module function `_validate_global_plan`
    directly, so it is repeated here as it is there (dedup, the global plan and Metadata, planner_data merged), with
    only the check replaced; plan caching (`_create_global_plan_with_caching`) calls it unchanged."""

    def _create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        global_plan, metadata = dp.create_default_global_save_plan(self._dedup_save_plans(all_plans))
        if self.flatten_state_dict:
            metadata.planner_data = dict(ChainMap(*[p.planner_data for p in global_plan]))
        errors = validate_global_plan(global_plan, metadata)
        if errors:
            summary = "; ".join(errors)
            if len(summary) > 500:
                summary = summary[:500] + "... (truncated)"
            raise ValueError(f"Failed to validate global plan: {summary}")
        return global_plan, metadata

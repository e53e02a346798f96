"""The save planner's global step on the coordinator, with a check of the global plan that is O(n log n) in chunks
instead of torch's O(W^2) for tensors FSDP shards along a dimension other than their largest.

    python -m pytest tests/test_save_plan.py -q -n 0
    python bench/scale_coord.py --plan-only --plan-worlds 64 --layer-worlds 256 --out /tmp/c.json   # rank 0 plans

Why: DCP's coordinator checks the global save plan (torch 2.13 default_planner._validate_global_plan): every chunk in
bounds, no two chunks of a tensor overlapping, the chunks' volumes adding up to the tensor's. Its overlap check
sweeps along each tensor's LARGEST dimension. FSDP shards along dim 0; for k_proj, v_proj (1,024 x 8,192 at 70B) and
down_proj (8,192 x 28,672) dim 1 is larger, every chunk spans all of it, no chunk ever leaves the sweep's active
set, and torch compares all W^2/2 pairs: 3 of a Llama layer's 9 weights, times 3 with the AdamW moments, at every
first save (job start, every resume). `validate_global_plan` makes the same checks, with the same messages, but
sweeps along the dimension whose chunk offsets are most distinct (the one the chunks are split on): an FSDP shard
then meets only its neighbours. For the same chunks it finds exactly the pairs torch's finds (any sweep dimension
reaches every overlapping pair; see the function), so a plan is refused or accepted alike.
The rest of the coordinator's step is torch's too, made cheaper where it touches each of the T x W items: the
dedup (`dedup`: one dict lookup per item), the index hints (`global_save_plan`: no MetadataIndex.__init__ per item)
and no cyclic garbage collection meanwhile (collector.py `paused`); tests/test_save_plan.py checks they give torch's
result.
Upstream change that makes this module unnecessary: `_validate_global_plan` choosing its sweep dimension from the
chunks (most distinct offsets) instead of the tensor's size; then `save_planner` can go back to DefaultSavePlanner.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import sys
from bisect import bisect_right, insort
from collections import ChainMap

import torch.distributed.checkpoint.default_planner as dp
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata, MetadataIndex,
                                                   TensorStorageMetadata)
from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType

from . import collector

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


def dedup(all_plans: list[SavePlan], to_lowest_rank: bool) -> list[SavePlan]:
    """torch's `dedup_save_plans` (an item several plans hold stays in one: the lowest rank's, or the plan with the
    fewest bytes planned so far, in the order items first appear), with one dict lookup per item instead of its
    per-plan sets of every index; a plan that keeps all its items is returned as it is."""
    owners: dict[MetadataIndex, int | set[int]] = {}
    first: dict[MetadataIndex, WriteItem] = {}
    for p, plan in enumerate(all_plans):
        for item in plan.items:
            o = owners.get(item.index)
            if o is None:
                owners[item.index] = p
            elif isinstance(o, int):
                owners[item.index] = {o, p}  # a set built in plan order, as torch's: min() breaks ties alike
            else:
                o.add(p)
            first[item.index] = item  # as torch's: the last plan's item, whose size counts
    size = [0] * len(all_plans)
    drop: list[set[MetadataIndex]] = [set() for _ in all_plans]
    for index, o in owners.items():
        if isinstance(o, int):
            chosen = o
        else:
            chosen = min(o) if to_lowest_rank else min(o, key=lambda p: size[p])
            for p in o - {chosen}:
                drop[p].add(index)
        if not to_lowest_rank:
            size[chosen] += first[index].tensor_storage_size() or 1
    return [dataclasses.replace(plan, items=[i for i in plan.items if i.index not in gone]) if gone else plan
            for plan, gone in zip(all_plans, drop)]


def _with_hint(item: WriteItem, hint: int) -> WriteItem:
    """`item` with its index's position hint set: torch's two dataclasses.replace calls without re-running
    MetadataIndex.__init__ (which rebuilds the offsets' torch.Size) for each of T x W items."""
    index = object.__new__(MetadataIndex)
    index.__dict__.update(item.index.__dict__, index=hint)
    new = object.__new__(WriteItem)
    new.__dict__.update(item.__dict__, index=index)
    return new


def global_save_plan(all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
    """torch's `create_default_global_save_plan` (rewrite_index_hints=True): the same plans and Metadata."""
    md: dict = {}
    new_plans = []
    for plan in all_plans:
        items = []
        for item in plan.items:
            fqn = item.index.fqn
            if item.type != WriteItemType.SHARD and fqn in md:
                raise AssertionError("item.index.fqn not in md")
            if item.type == WriteItemType.BYTE_IO:
                md[fqn] = BytesStorageMetadata()
                items.append(item)
                continue
            data = item.tensor_data
            if data is None:
                raise AssertionError("item.tensor_data is not None")
            entry = md.get(fqn)
            if entry is None:
                entry = md[fqn] = TensorStorageMetadata(properties=data.properties, size=data.size, chunks=[])
            items.append(_with_hint(item, len(entry.chunks)))
            if data.chunk is None:
                raise AssertionError(f"Cannot create MD for tensor without bounds. FQN: {fqn}")
            entry.chunks.append(data.chunk)
        new_plans.append(dataclasses.replace(plan, items=items))
    return new_plans, Metadata(md)


class SweepSavePlanner(dp.DefaultSavePlanner):
    """DefaultSavePlanner (plan caching and all) whose global plan is checked by `validate_global_plan`.

    `_create_global_plan` is the narrowest hook: torch 2.13's calls the module function `_validate_global_plan`
    directly, so it is repeated here as it is there (dedup, the global plan and Metadata, planner_data merged), with
    only the check replaced; plan caching (`_create_global_plan_with_caching`) calls it unchanged."""

    def _create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        # no cyclic collection while rank 0 builds T x W objects from the W plans (at W=32 it took 60% of the
        # global plan's time); sync and thread saves are paused already, process mode's uploader is not
        with collector.paused(coordinator=True):
            return self._checked_global_plan(all_plans)

    def _checked_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        global_plan, metadata = global_save_plan(dedup(all_plans, self.dedup_save_to_lowest_rank))
        if self.flatten_state_dict:
            metadata.planner_data = dict(ChainMap(*[p.planner_data for p in global_plan]))
        errors = validate_global_plan(global_plan, metadata)
        if errors:
            summary = "; ".join(errors)
            if len(summary) > 500:
                summary = summary[:500] + "... (truncated)"
            raise ValueError(f"Failed to validate global plan: {summary}")
        return global_plan, metadata

"""ckpt/save_plan.py: the global save plan's check gives torch's verdicts, in O(W) comparisons for FSDP's shards.

    python -m pytest tests/test_save_plan.py -q -n 0
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed.checkpoint.default_planner as dp
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

from ckpt.save_plan import SweepSavePlanner, validate_global_plan
from ckpt.uploader import save_planner


def dim0_shards(shape, world):
    """FSDP2's dim-0 shards: ceil(rows / W) rows each, the last ones short or empty (at offset rows)."""
    per = math.ceil(shape[0] / world)
    out = []
    for r in range(world):
        lo = min(r * per, shape[0])
        out.append(((lo, *[0] * (len(shape) - 1)), (min(per, shape[0] - lo), *shape[1:])))
    return out


def grid(shape, a, b):
    """A 2-D split into a x b chunks (e.g. FSDP on dim 0 times TP on dim 1), the last of each row/column short."""
    pa, pb = math.ceil(shape[0] / a), math.ceil(shape[1] / b)
    return [((i * pa, j * pb), (min(pa, shape[0] - i * pa), min(pb, shape[1] - j * pb))) for i in range(a)
            for j in range(b)]


def plans(tensors: dict[str, list]) -> list[SavePlan]:
    """One local plan per chunk index (rank), each rank writing its chunk of every tensor."""
    ranks = max(len(chunks) for _, chunks in tensors.values())
    props = TensorProperties(dtype=torch.float32)
    out = []
    for r in range(ranks):
        items = []
        for fqn, (shape, chunks) in tensors.items():
            if r >= len(chunks):
                continue
            off, size = map(torch.Size, chunks[r])
            items.append(WriteItem(index=MetadataIndex(fqn, off), type=WriteItemType.SHARD, tensor_data=TensorWriteData(
                chunk=ChunkStorageMetadata(off, size), properties=props, size=torch.Size(shape))))
        out.append(SavePlan(items, planner_data={fqn: (fqn,) for fqn in tensors}))
    return out


def normalized(errors: list[str]) -> list[str]:
    """Messages with each overlapping pair in one order (the sweeps meet a pair from either side)."""
    out = []
    for e in errors:
        head, sep, pair = e.partition("overlapping chunks: ")
        if sep:
            a, _, b = pair.partition(" ChunkStorageMetadata(")
            e = head + sep + " | ".join(sorted([a, "ChunkStorageMetadata(" + b]))
        out.append(e)
    return sorted(out)


def verdicts(tensors):
    """(torch's errors, ours), normalized, for the global plan of `tensors` = {fqn: (shape, chunks)}."""
    global_plan, md = dp.create_default_global_save_plan(plans(tensors))
    return normalized(dp._validate_global_plan(global_plan, md)), normalized(validate_global_plan(global_plan, md))


def with_shape(shape, chunks):
    return {"t": (shape, chunks)}


VALID = {
    "k_proj-like, dim 0 smaller than dim 1": with_shape((64, 512), dim0_shards((64, 512), 8)),
    "uneven last shard": with_shape((10, 40), dim0_shards((10, 40), 4)),
    "more ranks than rows: empty shards at the end": with_shape((6, 32), dim0_shards((6, 32), 8)),
    "dim 0 larger (embed-like)": with_shape((96, 16), dim0_shards((96, 16), 8)),
    "1-D norm weight": with_shape((33,), dim0_shards((33,), 4)),
    "2-D grid": with_shape((12, 30), grid((12, 30), 3, 4)),
    "2-D grid, uneven": with_shape((13, 31), grid((13, 31), 4, 3)),
    "3-D, split on dim 1": {"t": ((4, 20, 50), [((0, r * 5, 0), (4, 5, 50)) for r in range(4)])},
}


def _broken(chunks, i, off=None, size=None):
    chunks = list(chunks)
    o, s = chunks[i]
    chunks[i] = (off or o, size or s)
    return chunks


SHARDS = dim0_shards((16, 64), 4)  # rows 0-3, 4-7, 8-11, 12-15
INVALID = {
    "overlap (and over-fill)": with_shape((16, 64), _broken(SHARDS, 1, off=(3, 0))),
    "overlap with a gap (fill right)": with_shape((16, 64), _broken(_broken(SHARDS, 1, size=(5, 64)), 2, off=(8, 0),
                                                                     size=(3, 64))),
    "gap: under-fill": with_shape((16, 64), _broken(SHARDS, 3, size=(3, 64))),
    "out of bounds": with_shape((16, 64), _broken(SHARDS, 3, size=(5, 64))),
    "out of bounds along dim 1": with_shape((16, 64), _broken(SHARDS, 0, size=(4, 65))),
    "duplicate chunk": with_shape((16, 64), SHARDS + [SHARDS[2]]),
    "grid overlap": with_shape((12, 30), _broken(grid((12, 30), 3, 4), 5, off=(4, 7))),
    "zero-size chunk inside another": with_shape((16, 64), SHARDS + [((5, 0), (0, 64))]),
}


@pytest.mark.parametrize("name", VALID)
def test_valid_plans_pass_both(name):
    theirs, ours = verdicts(VALID[name])
    assert theirs == [] and ours == []


@pytest.mark.parametrize("name", INVALID)
def test_invalid_plans_fail_alike(name):
    theirs, ours = verdicts(INVALID[name])
    assert theirs, "the case must be one torch refuses"
    assert ours == theirs


def test_planner_refuses_an_invalid_plan_with_torchs_error():
    local = plans(INVALID["overlap (and over-fill)"])
    with pytest.raises(ValueError, match="^Failed to validate global plan: key:t has overlapping chunks"):
        SweepSavePlanner()._create_global_plan(local)
    with pytest.raises(ValueError, match="^Failed to validate global plan: key:t has overlapping chunks"):
        dp.DefaultSavePlanner()._create_global_plan(local)


def test_global_plan_and_metadata_are_torchs():
    tensors = {"a.k": ((64, 512), dim0_shards((64, 512), 8)), "a.emb": ((96, 16), dim0_shards((96, 16), 8)),
               "a.norm": ((33,), dim0_shards((33,), 8))}
    ours, theirs = SweepSavePlanner()._create_global_plan(plans(tensors)), \
        dp.DefaultSavePlanner()._create_global_plan(plans(tensors))
    assert ours == theirs


def test_plan_caching_still_works(tmp_path):
    """The project's planner: a second save with unchanged local plans reuses the cached global plan."""
    local = plans({"t": ((64, 512), dim0_shards((64, 512), 4))})
    planner = save_planner(str(tmp_path), None)
    assert isinstance(planner, SweepSavePlanner)
    delta, md = planner.create_global_plan(local)
    assert delta == planner.global_plan and len(md.state_dict_metadata["t"].chunks) == 4
    again = save_planner(str(tmp_path), None)
    delta2, md2 = again.create_global_plan([SavePlan([], usable=False)] * 4)
    assert all(not p.usable for p in delta2) and md2 is md


def comparisons(validate, world: int, monkeypatch) -> int:
    """Box comparisons `validate` makes for a k_proj-like tensor (dim 0 of 1,024 rows, smaller than dim 1) in W
    dim-0 shards."""
    calls = [0]
    check = dp._check_box_overlap

    def counted(a, b):
        calls[0] += 1
        return check(a, b)
    monkeypatch.setattr(dp, "_check_box_overlap", counted)
    global_plan, md = dp.create_default_global_save_plan(plans(with_shape((1024, 8192), dim0_shards((1024, 8192),
                                                                                                     world))))
    assert validate(global_plan, md) == []
    return calls[0]


def test_comparisons_grow_linearly_in_w(monkeypatch):
    """4x the ranks: at most ~4x the comparisons (torch's: ~16x, W^2/2; shown so that this test is one torch's check
    fails)."""
    ours = [comparisons(validate_global_plan, w, monkeypatch) for w in (64, 256)]
    assert ours[1] <= 4 * ours[0] + 8, ours
    theirs = [comparisons(dp._validate_global_plan, w, monkeypatch) for w in (64, 256)]
    assert theirs[1] > 12 * theirs[0] and theirs[0] >= 64 * 63 // 2, theirs


def replicated(world):
    """Each rank's dim-0 shards plus items every rank holds (AdamW's step, replicated norms) and a rank's own bytes."""
    out = plans({"a.k": ((64, 512), dim0_shards((64, 512), world)), "a.e": ((96, 16), dim0_shards((96, 16), world))})
    props = TensorProperties(dtype=torch.float32)
    for r, plan in enumerate(out):
        for fqn, shape in (("s.step", ()), ("s.norm", (7,)), ("s.big", (300,))):
            off = torch.Size([0] * len(shape))
            plan.items.append(WriteItem(index=MetadataIndex(fqn, off), type=WriteItemType.TENSOR,
                                        tensor_data=TensorWriteData(ChunkStorageMetadata(off, torch.Size(shape)), props,
                                                                    torch.Size(shape))))
        plan.items.append(WriteItem(index=MetadataIndex(f"rng{r}"), type=WriteItemType.BYTE_IO))
    return out


@pytest.mark.parametrize("lowest", [False, True])
def test_dedup_and_global_plan_are_torchs_with_replicated_items(lowest):
    ours = SweepSavePlanner(dedup_save_to_lowest_rank=lowest)._create_global_plan(replicated(5))
    theirs = dp.DefaultSavePlanner(dedup_save_to_lowest_rank=lowest)._create_global_plan(replicated(5))
    assert ours == theirs
    assert [[i.index.index for i in p.items] for p in ours[0]] == [[i.index.index for i in p.items] for p in theirs[0]]
    assert sum(len(p.items) for p in ours[0]) == 5 * 3 + 3  # shards, replicated items once, rng per rank


def test_collector_state_restored_when_the_plan_is_refused():
    import gc
    assert gc.isenabled()
    with pytest.raises(ValueError):
        SweepSavePlanner()._create_global_plan(plans(INVALID["gap: under-fill"]))
    assert gc.isenabled()

"""The Hub's tensor layout <-> the model's in-memory one, by transformers' own conversion rules.

    python -m pytest tests/test_moe.py -q -k layout

transformers 5 keeps some weights fused in memory (Mixture-of-Experts: `mlp.experts.gate_up_proj`, [experts,
2 * width, hidden]) and publishes them one tensor per expert (`block_sparse_moe.experts.0.w1.weight` for Mixtral,
`mlp.experts.0.gate_proj.weight` for Qwen3-MoE). Its conversion_mapping.py declares the conversion per model type
(WeightRenaming, WeightConverter with MergeModulelist, Concatenate, ...): from_pretrained runs it forward,
save_pretrained in reverse. Here the same declarations, driven as transformers drives them (same key order, same
op objects), run on stand-ins that hold no data but record where each file tensor's elements sit in the in-memory
tensor: a `Placement` per file tensor. The loader then reads each rank's slices of the files, the export writes
each saved chunk to the file tensors it covers; neither ever holds more than its own bytes.

Ops are followed through torch.stack/cat (load) and torch.chunk/squeeze (export); a rule using any other
(Transpose, PermuteForRope, ...) is refused in one line naming it.
"""

from __future__ import annotations

import math
from copy import deepcopy
from dataclasses import dataclass

import torch

from ..errors import CheckpointError


@dataclass(frozen=True)
class Placement:
    """One file tensor as a box of one in-memory tensor: `file tensor == memory[name][start:start + size]` with
    the size-1 dims `dropped` squeezed out (the dim MergeModulelist stacked the experts along)."""
    key: str  # the tensor's name in the files
    shape: tuple[int, ...]  # its shape there
    name: str  # the in-memory state-dict name
    start: tuple[int, ...]  # in the in-memory tensor's dims
    size: tuple[int, ...]
    dropped: tuple[int, ...] = ()

    @property
    def whole(self) -> bool:
        """The file tensor is the whole in-memory tensor (perhaps under another name): DCP reads it as it is."""
        return not self.dropped and not any(self.start) and self.size == self.shape


def overlap(start, size, p: Placement) -> tuple[list[int], list[int]] | None:
    """(lo, hi): where the box (start, size) of p's in-memory tensor meets file tensor p, or None if nowhere."""
    lo = [max(a, s) for a, s in zip(start, p.start)]
    hi = [min(a + n, s + m) for a, n, s, m in zip(start, size, p.start, p.size)]
    return None if any(a >= b for a, b in zip(lo, hi)) else (lo, hi)


def file_index(lo, hi, p: Placement) -> tuple[slice, ...]:
    """The slices of file tensor p that hold its in-memory tensor's box [lo, hi) (one that overlap returned)."""
    return tuple(slice(a - s, b - s) for d, (a, b, s) in enumerate(zip(lo, hi, p.start)) if d not in p.dropped)


class UnsupportedOp(Exception):
    """A torch function a conversion op calls that the stand-ins do not follow (a transpose, a permutation)."""


class Misfit(Exception):
    """File tensors that a rule joins but whose shapes do not join (an expert missing, another width)."""


def _dim(d: int, ndim: int) -> int:
    return d + ndim if d < 0 else d


class _Stacked:
    """Load side: a tensor made of file tensors, each (key, its shape, start, size, dropped) in this one's dims."""

    def __init__(self, shape, parts):
        self.shape, self.parts = tuple(shape), parts

    @classmethod
    def leaf(cls, key: str, shape) -> "_Stacked":
        return cls(shape, [(key, tuple(shape), (0,) * len(shape), tuple(shape), ())])

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.stack:
            return cls._stack(args[0], kwargs.get("dim", args[1] if len(args) > 1 else 0))
        if func is torch.cat:
            return cls._cat(args[0], kwargs.get("dim", args[1] if len(args) > 1 else 0))
        raise UnsupportedOp(getattr(func, "__name__", str(func)))

    @classmethod
    def _stack(cls, items, dim):
        d = _dim(dim, len(items[0].shape) + 1)
        if len({t.shape for t in items}) != 1:
            raise Misfit(f"stacked tensors of shapes {sorted({t.shape for t in items})}")
        parts = [(k, ks, st[:d] + (i,) + st[d:], sz[:d] + (1,) + sz[d:],
                  tuple(sorted([x + (x >= d) for x in dr] + [d])))
                 for i, t in enumerate(items) for k, ks, st, sz, dr in t.parts]
        shape = items[0].shape
        return cls(shape[:d] + (len(items),) + shape[d:], parts)

    @classmethod
    def _cat(cls, items, dim):
        d, at, parts = _dim(dim, len(items[0].shape)), 0, []
        if len({t.shape[:d] + t.shape[d + 1:] for t in items}) != 1:
            raise Misfit(f"concatenated tensors of shapes {[list(t.shape) for t in items]} along dim {d}")
        for t in items:
            parts += [(k, ks, st[:d] + (st[d] + at,) + st[d + 1:], sz, dr) for k, ks, st, sz, dr in t.parts]
            at += t.shape[d]
        shape = items[0].shape
        return cls(shape[:d] + (at,) + shape[d + 1:], parts)

    def contiguous(self):
        return self

    def placements(self, name: str) -> list[Placement]:
        return [Placement(k, ks, name, st, sz, dr) for k, ks, st, sz, dr in self.parts]


class _Window:
    """Export side: a box of in-memory tensor `name` (start, extent in its dims), of which dims `kept` remain."""

    def __init__(self, name, start, size, kept):
        self.name, self.start, self.extent, self.kept = name, tuple(start), tuple(size), tuple(kept)

    @classmethod
    def whole(cls, name: str, shape) -> "_Window":
        return cls(name, (0,) * len(shape), shape, range(len(shape)))

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.extent[m] for m in self.kept)

    def size(self, dim=None):
        return self.shape if dim is None else self.shape[_dim(dim, len(self.shape))]

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.chunk:
            chunks = args[1] if len(args) > 1 else kwargs["chunks"]
            return args[0]._chunk(chunks, kwargs.get("dim", args[2] if len(args) > 2 else 0))
        raise UnsupportedOp(getattr(func, "__name__", str(func)))

    def _chunk(self, chunks: int, dim: int):
        """torch.chunk's split: pieces of ceil(n / chunks) along `dim`, the last one shorter."""
        m = self.kept[_dim(dim, len(self.kept))]
        step = math.ceil(self.extent[m] / chunks)
        out = []
        for at in range(0, self.extent[m], step):
            start, size = list(self.start), list(self.extent)
            start[m], size[m] = self.start[m] + at, min(step, self.extent[m] - at)
            out.append(_Window(self.name, start, size, self.kept))
        return tuple(out)

    def squeeze(self, dim=None):
        if dim is None:
            return _Window(self.name, self.start, self.extent, [m for m in self.kept if self.extent[m] != 1])
        d = _dim(dim, len(self.kept))
        if self.extent[self.kept[d]] != 1:
            return self
        return _Window(self.name, self.start, self.extent, self.kept[:d] + self.kept[d + 1:])

    def contiguous(self):
        return self

    def placement(self, key: str) -> Placement:
        dropped = tuple(m for m in range(len(self.extent)) if m not in self.kept)
        return Placement(key, self.shape, self.name, self.start, self.extent, dropped)



def _rules(model, loading: bool):
    """transformers' transforms for `model` as from_pretrained (loading) or save_pretrained (reversed) uses them:
    (renamings, converters, {source pattern: converter})."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import PrefixChange, WeightConverter, WeightRenaming

    if loading:
        rules = get_model_conversion_mapping(model)
    else:  # revert_weight_conversion for a model not made by from_pretrained: no legacy renames, no PrefixChange
        rules = [r.reverse_transform() for r in get_model_conversion_mapping(model, add_legacy=False)[::-1]
                 if not isinstance(r, PrefixChange)]
    renamings = [r for r in rules if isinstance(r, WeightRenaming)]
    converters = [r for r in rules if isinstance(r, WeightConverter)]
    return renamings, converters, {p: c for c in converters for p in c.source_patterns}


def _run(converter, first_key: str, model) -> dict:
    """The converter's own convert() on the stand-ins; an op they cannot follow refuses the model in one line."""
    try:
        out = converter.convert(first_key, model=model, config=model.config)
    except UnsupportedOp as e:
        ops = ", ".join(type(op).__name__ for op in getattr(converter, "operations", []))
        raise CheckpointError(f"{type(model).__name__}: transformers converts '{first_key}' with {ops}, which the "
                              f"sharded load and export cannot follow ({e})") from None
    except Misfit as e:
        raise CheckpointError(f"the tensors of the files that make {type(model).__name__}'s '{first_key}' do not fit "
                              f"together: {e}") from None
    return {k: v[0] if isinstance(v, list) else v for k, v in out.items()}


def hub_to_memory(model, file_shapes: dict[str, tuple], memory: dict[str, tuple]):
    """Where the files' tensors go in `model`, as from_pretrained maps them: ({in-memory name: [Placement]},
    {in-memory name: the shape its placements compose}, [file keys no rule maps to a model tensor]).
    `memory`: the model's state-dict names and shapes (the names its files hold when nothing is converted)."""
    from transformers.core_model_loading import dot_natural_key, rename_source_key

    renamings, converters, by_pattern = _rules(model, loading=True)
    direct, pending, unmapped = {}, {}, []
    for key in sorted(file_shapes, key=dot_natural_key):  # the order from_pretrained collects them in
        name, pattern = rename_source_key(key, renamings, converters)
        if name not in memory and key in memory:
            name, pattern = key, None
        if name not in memory:
            unmapped.append(key)
        elif pattern is None:
            direct[name] = Placement(key, tuple(file_shapes[key]), name, (0,) * len(file_shapes[key]),
                                     tuple(file_shapes[key]))
        else:
            converter = pending.setdefault(name, deepcopy(by_pattern[pattern]))  # one per target, as transformers
            converter.add_tensor(name, key, pattern, _Stacked.leaf(key, file_shapes[key]))
    placements = {name: [p] for name, p in direct.items()}
    shapes = {name: p.shape for name, p in direct.items()}
    for name, converter in pending.items():
        for full, box in _run(converter, name, model).items():
            placements[full], shapes[full] = box.placements(full), box.shape
    return placements, shapes, unmapped


def memory_to_hub(model, memory: dict[str, tuple]) -> list[Placement]:
    """The tensors save_pretrained writes for `model`'s state-dict names and shapes `memory` (tied aliases left
    out), in its order, each a Placement in the in-memory tensor it comes from. revert_weight_conversion's walk."""
    from transformers.core_model_loading import (WeightConverter, WeightRenaming, apply_converters, apply_renamings,
                                                 dot_natural_key)

    renamings, converters, by_pattern = _rules(model, loading=False)
    pending = {}
    for name in sorted(memory, key=dot_natural_key):
        key, pattern = apply_converters(name, converters)
        if pattern is not None:
            rule = pending.setdefault(key, deepcopy(by_pattern[pattern]))
        else:
            key, pattern = apply_renamings(name, renamings), name
            rule = pending.setdefault(key, WeightRenaming(name, key))
        rule.add_tensor(key, name, pattern, _Window.whole(name, memory[name]))
    out = []
    for first, rule in pending.items():
        for key, window in _run(rule, first, model).items():
            out.append(window.placement(apply_renamings(key, renamings) if isinstance(rule, WeightConverter) else key))
    return out

"""Hugging Face weights in: a local safetensors model read into the fully_shard-ed model at start-up.

    python -m pytest tests/test_hf.py -q -k load

DCP's HuggingFaceStorageReader plans reads against each rank's DTensor shards, so a rank reads only its own
slices of the safetensors files; the full model never exists in one place. Files in the Hub's layout where the
model fuses tensors in memory (MoE experts: one file tensor per expert) are mapped by transformers' own rules
(convert.py) and read part by part, each rank only the parts its shard covers (FSDP shards the fused tensor's
expert dim, so a rank reads only its experts).
"""

from __future__ import annotations

import re

import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

from ..errors import CheckpointError
from ..reading import few, safetensors_headers, tied_aliases
from .convert import Placement, file_index, hub_to_memory, overlap


def check_hf_keys(model: torch.nn.Module, model_sd: dict, headers: dict, hf_dir: str) -> dict[str, list[Placement]]:
    """{state-dict name: the file tensors it is read from}. Names map as from_pretrained maps them (convert.py:
    transformers' renames, and per-expert tensors stacked into the fused ones). Missing or unexpected names and
    shape mismatches are errors that name the model class: a silently skipped tensor would leave random or stale
    weights in training."""
    cls = type(model).__name__
    aliases = tied_aliases(model)
    wanted = {k: tuple(v.shape) for k, v in model_sd.items() if k not in aliases}
    try:
        placements, shapes, unmapped = hub_to_memory(model, {k: tuple(h["shape"]) for k, h in headers.items()}, wanted)
    except CheckpointError as e:
        raise CheckpointError(f"{hf_dir} does not fit {cls}: {e}") from None
    missing = [k for k in wanted if k not in placements]
    # HF's own list of leftovers it ignores on load (e.g. rotary inv_freq in old Llama files)
    ignore = [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or []]
    unexpected = [k for k in unmapped if not any(p.search(k) for p in ignore)]
    if missing or unexpected:
        raise CheckpointError(
            f"{hf_dir} does not fit {cls}: " + "; ".join(
                part for part in (f"missing {few(missing)}" if missing else "",
                                  f"unexpected {few(unexpected)}" if unexpected else "") if part) +
            f". Tensor names must be {cls}'s, as its save_pretrained writes them (or its state-dict names)")
    for k in wanted:
        if shapes[k] != wanted[k]:
            what = few([p.key for p in placements[k]], 2)
            raise CheckpointError(f"{hf_dir} does not fit {cls}: '{k}' is {list(shapes[k])} in the files ({what}) "
                                  f"but {list(wanted[k])} in the model (config.json and weights disagree?)")
    return {k: placements[k] for k in wanted}


def local_box(tensor: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(offsets, sizes) of this rank's shard of a DTensor in the full tensor; the whole of a plain tensor."""
    if hasattr(tensor, "__create_chunk_list__"):
        (chunk,) = tensor.__create_chunk_list__()
        return tuple(chunk.offsets), tuple(chunk.sizes)
    return (0,) * tensor.dim(), tuple(tensor.shape)


@torch.no_grad()
def read_pieces(dest: torch.Tensor, placements: list[Placement], headers: dict, opened: dict) -> None:
    """Fill this rank's shard of `dest` from the parts of the file tensors it covers (safetensors slices read
    from the mapped files: a rank reads its own experts' rows, nothing else)."""
    local = dest.to_local() if hasattr(dest, "to_local") else dest
    offsets, sizes = local_box(dest)
    for p in placements:
        box = overlap(offsets, sizes, p)
        if box is None:
            continue
        lo, hi = box
        path = headers[p.key]["file"]
        if path not in opened:
            opened[path] = safe_open(path, framework="pt")
        part = opened[path].get_slice(p.key)[file_index(lo, hi, p)]
        local[tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, offsets))].copy_(
            part.reshape([b - a for a, b in zip(lo, hi)]))


def load_hf_weights(model: torch.nn.Module, hf_dir: str, process_group=None, file_name=None) -> None:
    """Read a local HF safetensors model (one file, or sharded with an index) into the fully_shard-ed
    `model`, in place, on every rank. bf16/fp16 files are converted to the parameters' dtype as they are
    copied; tied aliases (lm_head.weight) are filled through their source; non-persistent buffers
    (rotary inv_freq) are not in the files and were computed when the model was built. A tensor the files hold
    whole (perhaps renamed) is read by DCP; one they hold in parts (one per expert) part by part (read_pieces).
    `file_name(state-dict name)` gives a tensor's name in the files, or None for one they do not hold
    (LoRA: `q_proj.base_layer.weight` is `q_proj.weight` there, adapters are not there)."""
    headers = safetensors_headers(hf_dir)  # file headers only
    model_sd = get_model_state_dict(model)
    to_model = {k: k for k in model_sd} if file_name is None else \
        {file_name(k): k for k in model_sd if file_name(k) is not None}
    file_sd = {f: model_sd[k] for f, k in to_model.items()}
    placements = check_hf_keys(model, file_sd, headers, hf_dir)
    whole = {ps[0].key: name for name, ps in placements.items() if len(ps) == 1 and ps[0].whole}
    dcp.load({key: file_sd[name] for key, name in whole.items()}, storage_reader=HuggingFaceStorageReader(hf_dir),
             process_group=process_group)
    opened = {}  # file -> safe_open handle, for the files this rank's parts are in
    for name, ps in placements.items():
        if name not in whole.values():
            read_pieces(file_sd[name], ps, headers, opened)
    set_model_state_dict(model, {to_model[name]: file_sd[name] for name in placements},
                         options=StateDictOptions(strict=False))  # tied aliases (and adapters) are absent

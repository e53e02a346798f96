"""Hugging Face weights in: a local safetensors model read into the fully_shard-ed model at start-up.

    python -m pytest tests/test_hf.py -q -k load

DCP's HuggingFaceStorageReader plans reads against each rank's DTensor shards, so a rank reads only its own
slices of the safetensors files; the full model never exists in one place.
"""

from __future__ import annotations

import re

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

from ..errors import CheckpointError
from ..reading import check_safetensors_files, few, tied_aliases

def check_hf_keys(model: torch.nn.Module, model_sd: dict, saved: dict, hf_dir: str) -> list[str]:
    """The state-dict names to read. Missing or unexpected names and shape mismatches are errors that
    name the model class: a silently skipped tensor would leave random or stale weights in training."""
    cls = type(model).__name__
    aliases = tied_aliases(model)
    wanted = [k for k in model_sd if k not in aliases]
    missing = [k for k in wanted if k not in saved]
    # HF's own list of leftovers it ignores on load (e.g. rotary inv_freq in old Llama files)
    ignore = [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or []]
    unexpected = [k for k in saved if k not in model_sd and not any(p.search(k) for p in ignore)]
    if missing or unexpected:
        raise CheckpointError(
            f"{hf_dir} does not fit {cls}: " + "; ".join(
                part for part in (f"missing {few(missing)}" if missing else "",
                                  f"unexpected {few(unexpected)}" if unexpected else "") if part) +
            f". Tensor names must be {cls}'s state-dict names, as its save_pretrained writes them")
    for k in wanted:
        if tuple(saved[k].size) != tuple(model_sd[k].shape):
            raise CheckpointError(f"{hf_dir} does not fit {cls}: '{k}' is {list(saved[k].size)} in the files but "
                                  f"{list(model_sd[k].shape)} in the model (config.json and weights disagree?)")
    return wanted


def load_hf_weights(model: torch.nn.Module, hf_dir: str, process_group=None, file_name=None) -> None:
    """Read a local HF safetensors model (one file, or sharded with an index) into the fully_shard-ed
    `model`, in place, on every rank. bf16/fp16 files are converted to the parameters' dtype as they are
    copied; tied aliases (lm_head.weight) are filled through their source; non-persistent buffers
    (rotary inv_freq) are not in the files and were computed when the model was built.
    `file_name(state-dict name)` gives a tensor's name in the files, or None for one they do not hold
    (LoRA: `q_proj.base_layer.weight` is `q_proj.weight` there, adapters are not there)."""
    check_safetensors_files(hf_dir)
    saved = HuggingFaceStorageReader(hf_dir).read_metadata().state_dict_metadata  # file headers only
    model_sd = get_model_state_dict(model)
    to_model = {k: k for k in model_sd} if file_name is None else \
        {file_name(k): k for k in model_sd if file_name(k) is not None}
    file_sd = {f: model_sd[k] for f, k in to_model.items()}
    state = {k: file_sd[k] for k in check_hf_keys(model, file_sd, saved, hf_dir)}
    dcp.load(state, storage_reader=HuggingFaceStorageReader(hf_dir), process_group=process_group)
    set_model_state_dict(model, {to_model[f]: v for f, v in state.items()},
                         options=StateDictOptions(strict=False))  # tied aliases (and adapters) are absent

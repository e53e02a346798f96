"""The read helpers every checkpoint reader shares: items of a DCP checkpoint in this process, the headers of
a HF safetensors folder, and the model a checkpoint was trained from (its folders, class, names and dtype).

    python -m pytest tests/test_hf.py tests/test_lora.py -q

Below hf/ (load.py, export.py, adapter.py) and describe.py; imports nothing of them. Nothing here needs a
process group.
"""

from __future__ import annotations

import json
import os
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from common.dtypes import DTYPE_NAMES
from common.hub import HubError, fetch
from .errors import CheckpointError
from .schema import schema_of
from .storage import storage_for

_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def few(names: list[str], n: int = 4) -> str:
    shown = ", ".join(repr(x) for x in names[:n])
    return shown + (f" (+{len(names) - n} more)" if len(names) > n else "")


def dcp_metadata(path: str):
    """DCP's Metadata of the checkpoint at `path`, a folder or an s3:// prefix."""
    return storage_for(path).dcp_reader(path).read_metadata()


def read_items(path: str, keys: list[str]) -> dict:
    """Load just `keys` (bytes items or plain tensors, in full) in this process, no process group needed."""
    md = dcp_metadata(path).state_dict_metadata
    state = {k: (torch.empty(md[k].size, dtype=md[k].properties.dtype)
                 if isinstance(md[k], TensorStorageMetadata) else None) for k in keys}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore")
        dcp.load(state, storage_reader=storage_for(path).dcp_reader(path), no_dist=True)
    return state


# ---------------------------------------------------------------- a HF safetensors folder

def check_safetensors_files(hf_dir: str) -> None:
    """The reader takes every *.safetensors in the folder, so a stray file from another save would mix in
    silently: with an index, the files must be exactly the ones it lists."""
    present = sorted(f for f in os.listdir(hf_dir) if f.endswith(".safetensors")) if os.path.isdir(hf_dir) else []
    if not present:
        raise CheckpointError(f"no *.safetensors files in {hf_dir}; only safetensors are read (re-save a "
                              "pytorch_model.bin model with save_pretrained(dir, safe_serialization=True))")
    index = os.path.join(hf_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            listed = sorted(set(json.load(f)["weight_map"].values()))
        if listed != present:
            raise CheckpointError(f"{hf_dir}: model.safetensors.index.json lists {few(listed)} but the folder "
                                  f"holds {few(present)}; remove the files of other saves")


def safetensors_headers(hf_dir: str) -> dict[str, dict]:
    """{tensor name: {file, dtype, shape, start (absolute byte offset), nbytes}} from the file headers only."""
    check_safetensors_files(hf_dir)
    out = {}
    for name in sorted(f for f in os.listdir(hf_dir) if f.endswith(".safetensors")):
        path = os.path.join(hf_dir, name)
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
        for key, t in header.items():
            if key != "__metadata__":
                begin, end = t["data_offsets"]
                out[key] = {"file": path, "dtype": t["dtype"], "shape": t["shape"], "start": 8 + n + begin,
                            "nbytes": end - begin}
    return out


# ---------------------------------------------------------------- the model a checkpoint was trained from

def tied_aliases(model: torch.nn.Module) -> dict[str, str]:
    """{alias: source} for parameters registered under two names, e.g. tied embeddings
    {'lm_head.weight': 'model.embed_tokens.weight'}. save_pretrained writes only the source."""
    first, aliases = {}, {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            aliases[name] = first[id(param)]
        else:
            first[id(param)] = name
    return aliases


def _existing_dir(path: str) -> str | None:
    for candidate in (path, os.path.join(_REPO_ROOT, path)):  # relative to where training ran, usually here
        if path and os.path.isdir(candidate):
            return candidate
    return None


def _hub_dir(named: str, commits: dict[str, str], weights: bool) -> str | None:
    """The cache's snapshot of Hub id `named` at the commit the checkpoint trained from (fetched if not cached),
    or None when `named` was no Hub id."""
    if named not in commits or _existing_dir(named) is not None:
        return None
    try:
        return fetch(named, commits[named], weights)[0]
    except HubError as e:
        raise CheckpointError(f"the model this checkpoint was trained from, Hub id {named} at commit "
                              f"{commits[named]}: {e}") from None


def source_dirs(ckpt_path: str, weights: bool = False) -> tuple[str, str]:
    """(model dir with config.json, tokenizer dir) the checkpoint was trained from (its schema, schema.py); a Hub
    id's snapshot at the recorded commit, with its safetensors when `weights` (a LoRA merge reads the base)."""
    schema = schema_of(ckpt_path)
    named = schema.model_dir
    model_dir = _hub_dir(named, schema.hub_commits, weights) or _existing_dir(named)
    if model_dir is None or not os.path.isfile(os.path.join(model_dir, "config.json")):
        raise CheckpointError(f"the model folder this checkpoint was trained from ({named!r}, as its meta.json schema "
                              "records) has no config.json here; run the export from the directory training ran in")
    tok_named = schema.tokenizer_dir or named
    tok_dir = _hub_dir(tok_named, schema.hub_commits, False) or _existing_dir(tok_named)
    if tok_dir is None:
        raise CheckpointError(f"tokenizer folder {tok_named!r} (as the checkpoint's meta.json schema records) "
                              "not found")
    return model_dir, tok_dir


def meta_model(config) -> torch.nn.Module:
    """The HF causal LM for `config`, built on `meta`: its names and layer types, no memory."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def model_names(model: torch.nn.Module) -> tuple[str, list[str], dict[str, str]]:
    """(class name, state-dict names, tied aliases) of a HF model (meta_model's: no memory)."""
    return type(model).__name__, list(model.state_dict()), tied_aliases(model)


def source_dtype(ckpt_path: str, config) -> torch.dtype:
    """The export dtype `auto` means: the source model's torch_dtype when training started from its weights
    (the schema's `pretrained`, from meta.json), fp32 for a random init (nothing to follow) or a non-float /
    unknown dtype."""
    pretrained = schema_of(ckpt_path).pretrained
    found = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(found, str):
        found = getattr(torch, found, None)
    return found if pretrained and found in DTYPE_NAMES else torch.float32

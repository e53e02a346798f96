"""LoRA checkpoints' two exports: a PEFT adapter folder, or the adapters merged into the base as a HF model.

    python -m ckpt export runs/lora/checkpoints/step-000100 out/adapter --adapter   # PeftModel.from_pretrained
    python -m ckpt export runs/lora/checkpoints/step-000100 out/merged              # full HF model, merged
    python -m pytest tests/test_lora.py -q

A LoRA checkpoint holds only the adapters and their optimizer state; meta.json's "lora" entry names the
base model folder and a fingerprint of its weights (lora_base.py: exporting against another base is refused,
naming both, as a resume is). The merged export streams the base one tensor
at a time from its safetensors files, adds peft's delta where an adapter applies (`lora_delta`: scaling *
B @ A, transposed for a layer that stores its weight (in, out)), and writes it to its place in the
pre-sized output files: peak memory is about two copies of the largest tensor, not the model.
"""

from __future__ import annotations

import os
import shutil

import torch
import torch.nn as nn
from safetensors import safe_open
from safetensors.torch import save_file
from torch.distributed.checkpoint.metadata import TensorProperties, TensorStorageMetadata

from common.dtypes import DTYPE_NAMES, DTYPES
from ..errors import CheckpointError
from ..lora_base import base_fingerprint, lora_info
from ..reading import (dcp_metadata, few, meta_model, model_names, read_items, safetensors_headers, source_dirs,
                       source_dtype)
from ..schema import schema_of
from .convert import Placement, file_index, hub_to_memory, memory_to_hub, overlap
from .files import (SAFETENSORS_DTYPES, OutTensor, assign_files, create_files, parse_size, replace_dir,
                    safetensors_header, write_index, write_model_files)

ADAPTER_SUFFIX = (".lora_A.default.weight", ".lora_B.default.weight")  # peft's names in the training model
_ST_DTYPES = {name: dtype for dtype, name in SAFETENSORS_DTYPES.items()}  # safetensors header name -> torch


# ---------------------------------------------------------------- peft's merge rule, per layer type

MERGEABLE = "Linear and transformers' Conv1D (GPT-2's family) layers"


def delta_transposed(layer: nn.Module) -> bool | None:
    """Whether peft's merge transposes B @ A for this base layer (its `fan_in_fan_out`): True for transformers'
    Conv1D, which stores its weight (in, out) and for which peft sets fan_in_fan_out itself; False for Linear.
    None for a layer type the merged export has no rule for (peft's Embedding, Conv, MultiheadAttention...)."""
    from transformers.pytorch_utils import Conv1D

    if isinstance(layer, Conv1D):
        return True
    if isinstance(layer, nn.Linear):
        return False
    return None


def unmergeable(layers: dict[str, nn.Module]) -> str | None:
    """'name (Type), ...' of the adapted layers that delta_transposed has no rule for; None if there are none."""
    bad = [f"{name} ({type(layer).__name__})" for name, layer in layers.items() if delta_transposed(layer) is None]
    return few(bad) if bad else None


def lora_delta(a: torch.Tensor, b: torch.Tensor, scaling: float, transposed: bool) -> torch.Tensor:
    """What peft's merge adds to the base weight, in fp32: scaling * B @ A, transposed for a fan_in_fan_out layer."""
    delta = b.float() @ a.float()
    return (delta.T if transposed else delta) * scaling


# ---------------------------------------------------------------- exports

def read_adapters(ckpt_path: str) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{module name: (lora_A, lora_B)} in full, in this process. Adapters are small (r x (in + out) per module)."""
    prefix = schema_of(ckpt_path).model_prefix
    keys = [k for k in dcp_metadata(ckpt_path).state_dict_metadata
            if k.startswith(prefix) and k.endswith(ADAPTER_SUFFIX)]
    items = read_items(ckpt_path, keys)
    out = {}
    for k in keys:
        module = k[len(prefix):-len(ADAPTER_SUFFIX[0])]
        if k.endswith(ADAPTER_SUFFIX[0]):
            out[module] = (items[k], items[prefix + module + ADAPTER_SUFFIX[1]])
    if not out:
        raise CheckpointError(f"{ckpt_path}: meta.json says LoRA but the checkpoint holds no adapter weights")
    return out


def base_dirs_checked(ckpt_path: str, lora: dict) -> tuple[str, str]:
    """(base folder, tokenizer folder) named in the checkpoint; refused if the base's weights are not the
    ones the adapters were trained on."""
    model_dir, tok_dir = source_dirs(ckpt_path, weights=True)
    found = base_fingerprint(os.path.abspath(model_dir))["fingerprint"]
    if found != lora["base_fingerprint"]:
        raise CheckpointError(f"{ckpt_path} was trained on base {lora['base']} ({lora['base_fingerprint']}), but "
                              f"{model_dir} now holds other weights ({found}); restore that base to export")
    return model_dir, tok_dir


def write_adapter(ckpt_path: str, lora: dict, tmp: str, dtype: str) -> dict:
    """adapter_config.json (peft's LoraConfig) + adapter_model.safetensors with peft's tensor names, in the
    trained dtype (fp32) unless asked otherwise."""
    from peft import LoraConfig

    dtype = "fp32" if dtype == "auto" else dtype
    adapters = read_adapters(ckpt_path)
    base = lora["base"]
    base = os.path.abspath(base) if os.path.isdir(base) else base
    LoraConfig(r=lora["r"], lora_alpha=lora["alpha"], lora_dropout=lora["dropout"], task_type="CAUSAL_LM",
               target_modules=sorted({m.rsplit(".", 1)[-1] for m in adapters}), base_model_name_or_path=base,
               inference_mode=True).save_pretrained(tmp)
    tensors = {}
    for module, (a, b) in adapters.items():
        tensors[f"base_model.model.{module}.lora_A.weight"] = a.to(DTYPES[dtype]).contiguous()
        tensors[f"base_model.model.{module}.lora_B.weight"] = b.to(DTYPES[dtype]).contiguous()
    save_file(tensors, os.path.join(tmp, "adapter_model.safetensors"), metadata={"format": "pt"})
    return {"class": f"PEFT LoRA adapter (r={lora['r']}) for {base}", "tensors": len(tensors), "files": 1,
            "bytes": sum(t.numel() * t.element_size() for t in tensors.values()), "dtype": dtype,
            "extras": "with adapter_config.json; load with PeftModel.from_pretrained(base, path)"}


def write_merged(ckpt_path: str, lora: dict, tmp: str, dtype: str, max_shard_size: str) -> dict:
    """The base with W + (alpha / r) * B @ A merged into every adapted weight, as HF safetensors + config."""
    from transformers import AutoConfig

    model_dir, tok_dir = base_dirs_checked(ckpt_path, lora)
    config = AutoConfig.from_pretrained(model_dir)
    model = meta_model(config)  # built once: its names, and the layer types the merge rule follows
    cls_name, _, aliases = model_names(model)
    memory = {n: tuple(t.shape) for n, t in model.state_dict().items() if n not in aliases}
    headers = safetensors_headers(model_dir)
    try:  # the base's tensors in either layout (MoE: per expert, or fused), as the sharded load maps them
        in_base, composed, _ = hub_to_memory(model, {k: tuple(h["shape"]) for k, h in headers.items()}, memory)
    except CheckpointError as e:
        raise CheckpointError(f"base {model_dir} does not fit {cls_name}: {e}") from None
    missing = [n for n in memory if composed.get(n) != memory[n]]
    if missing:
        raise CheckpointError(f"base {model_dir} does not fit {cls_name}: missing {missing[:4]}")
    adapters = read_adapters(ckpt_path)
    unknown = [m for m in adapters if m + ".weight" not in memory]
    if unknown:
        raise CheckpointError(f"{ckpt_path}: adapters for {unknown[:4]}, which base {model_dir} does not have")
    transposed = merge_rules(ckpt_path, model, adapters)
    outs = {p.key: p for p in memory_to_hub(model, memory)}  # save_pretrained's names and layout
    shapes = {k: TensorStorageMetadata(TensorProperties(dtype=_ST_DTYPES[headers[in_base[p.name][0].key]["dtype"]]),
                                       torch.Size(p.shape), []) for k, p in outs.items()}
    out_dtype = source_dtype(ckpt_path, config) if dtype == "auto" else DTYPES[dtype]  # auto: the base's
    files = assign_files(shapes, list(outs), out_dtype, parse_size(max_shard_size))
    written = create_files(tmp, files)
    scaling = lora["alpha"] / lora["r"]
    for fname, tensors in zip(written, files):
        fd, data_start = os.open(os.path.join(tmp, fname), os.O_RDWR), len(safetensors_header(tensors))
        try:
            for out in tensors:
                p = outs[out.name]
                module = p.name[:-len(".weight")]  # adapters sit on whole Linear weights, by in-memory name
                _write_one(fd, data_start, out, read_base(p, in_base[p.name], headers), adapters.get(module),
                           scaling, transposed.get(module, False))
            os.fsync(fd)
        finally:
            os.close(fd)
    write_index(tmp, files, written)
    write_model_files(model_dir, tok_dir, tmp, config, cls_name, out_dtype)
    return {"class": f"{cls_name} (LoRA r={lora['r']} merged)", "tensors": len(outs), "files": len(written),
            "bytes": sum(t.nbytes for ts in files for t in ts), "dtype": DTYPE_NAMES[out_dtype]}


def merge_rules(ckpt_path: str, model: nn.Module, adapters: dict) -> dict[str, bool]:
    """{adapted module: delta transposed?} from the base architecture's layer types (`model`: meta_model of the
    base's config), as peft chose them when it injected the adapters; a layer type with no rule is refused by name,
    never merged wrong."""
    layers = {m: model.get_submodule(m) for m in adapters}
    bad = unmergeable(layers)
    if bad:
        raise CheckpointError(f"{ckpt_path}: cannot merge LoRA into {bad}: the merged export merges {MERGEABLE} "
                              "only; export the adapters alone with --adapter")
    return {m: delta_transposed(layer) for m, layer in layers.items()}


def read_base(p: Placement, parts: list[Placement], headers: dict) -> torch.Tensor:
    """Output tensor p (a box of in-memory tensor p.name) read from the base files' parts of p.name: the file
    tensor itself when the base has save_pretrained's layout, slices of a fused one otherwise."""
    out = torch.empty(p.size, dtype=_ST_DTYPES[headers[parts[0].key]["dtype"]])
    for q in parts:
        box = overlap(p.start, p.size, q)
        if box is not None:
            lo, hi = box
            with safe_open(headers[q.key]["file"], "pt") as f:
                part = f.get_slice(q.key)[file_index(lo, hi, q)]
            out[tuple(slice(a - s, b - s) for a, b, s in zip(lo, hi, p.start))] = part.reshape(
                [b - a for a, b in zip(lo, hi)])
    return out.reshape(p.shape)


def _write_one(fd: int, data_start: int, out: OutTensor, tensor: torch.Tensor, adapter, scaling: float,
               transposed: bool) -> None:
    if adapter is not None:
        tensor = tensor.float() + lora_delta(*adapter, scaling, transposed)  # peft's merge: W + delta
    data = tensor.to(out.dtype).contiguous().view(torch.uint8).numpy()
    os.pwrite(fd, data, data_start + out.begin)
    out.written = data.nbytes


def export_lora(ckpt_path: str, out_dir: str, dtype: str = "auto", max_shard_size: str = "2GB",
                adapter_only: bool = False) -> dict:
    """Write the PEFT adapter folder (adapter_only) or the merged HF model of a verified LoRA checkpoint.
    Built beside `out_dir`, then renamed into place: it appears whole or not at all."""
    lora = lora_info(ckpt_path)
    if lora is None:
        raise CheckpointError(f"{ckpt_path} is a full fine-tuning checkpoint: --adapter needs a LoRA checkpoint "
                              "(model.lora.r > 0); export it without --adapter")
    out_dir = os.path.normpath(out_dir)
    tmp = f"{out_dir}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        info = write_adapter(ckpt_path, lora, tmp, dtype) if adapter_only else \
            write_merged(ckpt_path, lora, tmp, dtype, max_shard_size)
        replace_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"path": out_dir, **info}

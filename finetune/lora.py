"""LoRA (peft) under FSDP2: adapters on the meta model before `fully_shard`, the base frozen and loaded per rank.

    torchrun --nproc_per_node 2 train_fsdp.py --config configs/tiny.yaml model.lora.r=8 model.name_or_path=<hf dir>
    python -m pytest tests/test_lora.py -q

- `add_adapters` injects peft's LoRA layers into the meta model (`inject_adapter_in_model`): each targeted
  Linear (or transformers' Conv1D: GPT-2's family; other layer types are refused by name) becomes
  `<name>.base_layer` (frozen) + `<name>.lora_A/B.default` (trainable). `fully_shard` then shards base and
  adapter weights of a block together; the optimizer only ever sees the adapters.
- `base_file_name` maps the model's parameter names back to the names in the base model's safetensors, so
  the existing sharded import (`ckpt.hf.load.load_hf_weights`) reads the frozen base on every rank.
- `init_adapters` draws lora_A in full from a generator seeded by (seed, name), as peft initialises it
  (kaiming-uniform, a=sqrt(5)), and zeroes lora_B: the same adapters at any world size, and step 0 is the base.
- `lora_meta` is what meta.json records: the adapter settings, the base folder and its fingerprint.
"""

from __future__ import annotations

import json
import math
import os

import torch
import torch.nn as nn

from ckpt.hf.adapter import MERGEABLE, unmergeable
from ckpt.lora_base import base_fingerprint
from ckpt.reading import few
from finetune.model_files import model_folder
from finetune.shards import ModelError, copy_full_into, seed_for

ADAPTER = "default"  # peft's adapter name; it appears in parameter names (lora_A.default.weight)


def check_not_quantized(model_dir: str) -> None:
    """A base saved 4-bit/8-bit (bitsandbytes, GPTQ, AWQ: `quantization_config` in config.json) is QLoRA's
    input; its kernels are GPU-only and the sharded import reads plain tensors, so refuse it by name."""
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        return
    with open(path) as f:
        quant = json.load(f).get("quantization_config")
    if quant:
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else "?"
        raise ModelError(f"{model_dir} is a quantized model ({method}): QLoRA (LoRA on a 4-bit base) is not "
                         "supported, it needs GPU kernels; point model.name_or_path at the unquantized weights")


def add_adapters(model: nn.Module, lora_cfg, model_dir: str, base_dtype: torch.dtype) -> None:
    """Inject LoRA layers into `model` (still on meta) in place, freeze everything else and store it in
    `base_dtype` (the compute dtype): a frozen weight needs no fp32 master, so bf16 halves the base's memory.
    FSDP2 only asks the trainable parameters of a group to share a dtype (the fp32 adapters)."""
    from peft import LoraConfig, inject_adapter_in_model
    from peft.tuners.lora import LoraLayer

    check_not_quantized(model_dir)
    targets = lora_cfg.target_modules.strip()
    peft_cfg = LoraConfig(r=lora_cfg.r, lora_alpha=lora_cfg.alpha, lora_dropout=lora_cfg.dropout,
                          target_modules=targets if targets == "all-linear" else
                          [t.strip() for t in targets.split(",") if t.strip()])
    try:
        inject_adapter_in_model(peft_cfg, model, adapter_name=ADAPTER, low_cpu_mem_usage=True)
    except ValueError as e:  # peft: "Target modules {...} not found in the base model"
        raise ModelError(f"model.lora.target_modules={targets!r} on {type(model).__name__}: {e}") from None
    check_no_parameter_targets(model, targets)
    bad = unmergeable({name: m.get_base_layer() for name, m in model.named_modules() if isinstance(m, LoraLayer)})
    if bad:  # refused before training, not at the export: its merge and the weight import know no other layers
        raise ModelError(f"model.lora.target_modules={targets!r}: LoRA on {bad} is not supported; it applies to "
                         f"{MERGEABLE}")
    cast_frozen(model, base_dtype)


def check_no_parameter_targets(model: nn.Module, targets: str) -> None:
    """Refuse, in one line, what peft 0.21 adapts through `target_parameters` (its ParamWrapper): on transformers 5's
    MoE models `all-linear` (or gate/up/down_proj, w1/w2/w3) becomes the fused 3-D expert weights and the router.
    ParamWrapper registers a parametrization on the experts module at every forward, which FSDP2's swap of
    sharded and gathered parameters and the merged export here do not support."""
    from peft.tuners.lora.layer import ParamWrapper

    wrapped = [name for name, m in model.named_modules()  # the outer one of nested wrappers
               if isinstance(m, ParamWrapper) and not name.endswith(".base_layer")]
    if wrapped:
        raise ModelError(f"model.lora.target_modules={targets!r} on {type(model).__name__}: peft adapts the MoE "
                         f"experts' fused 3-D weights and routers ({few(wrapped, 2)}) through target_parameters, which "
                         "is not supported here; target the attention, e.g. model.lora.target_modules=q_proj,k_proj,"
                         "v_proj,o_proj (the experts stay frozen; docs/moe.md)")


def cast_frozen(model: nn.Module, dtype: torch.dtype) -> None:
    """Frozen parameters to `dtype`, in place, keeping ties (one new Parameter per old one). Free on meta."""
    new: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None and not p.requires_grad and p.dtype != dtype:
                if id(p) not in new:
                    new[id(p)] = nn.Parameter(p.detach().to(dtype), requires_grad=False)
                module._parameters[name] = new[id(p)]


def is_adapter_param(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def base_file_name(name: str) -> str | None:
    """Model parameter name -> tensor name in the base model's files; None for adapter weights."""
    if is_adapter_param(name):
        return None
    return name.replace(".base_layer.", ".")


@torch.no_grad()
def init_adapters(model: nn.Module, seed: int) -> None:
    """lora_A ~ kaiming-uniform(a=sqrt(5)) from a (seed, name) generator, lora_B = 0: world-size independent."""
    for name, param in model.named_parameters():
        if ".lora_A." in name:
            full = torch.empty(param.shape, dtype=torch.float32)
            nn.init.kaiming_uniform_(full, a=math.sqrt(5), generator=torch.Generator().manual_seed(seed_for(seed, name)))
            copy_full_into(param, full.to(param.device))  # drawn on CPU: the same numbers on any device
        elif ".lora_B." in name:
            copy_full_into(param, torch.zeros(param.shape, dtype=torch.float32, device=param.device))


def unadapted_experts(model: nn.Module) -> str | None:
    """One line when LoRA leaves a MoE model's fused 3-D expert weights frozen, else None: peft reaches them only
    through `target_parameters`, refused here (check_no_parameter_targets)."""
    experts = [name for name, p in model.named_parameters() if p.dim() == 3 and not p.requires_grad]
    if not experts:
        return None
    return (f"LoRA: the {len(experts)} fused 3-D expert weights ({experts[0]}, ...) are not adapted and stay frozen: "
            "peft reaches them only with target_parameters, which is not supported here (docs/lora.md)")


def param_summary(model: nn.Module) -> str:
    """'N params', or with frozen parameters 'T of N params trainable (LoRA, frozen base in <dtype>)'."""
    total = sum(p.numel() for p in model.parameters())
    frozen = [p for p in model.parameters() if not p.requires_grad]
    if not frozen:
        return f"{total:,} params"
    trainable = total - sum(p.numel() for p in frozen)
    return f"{trainable:,} of {total:,} params trainable (LoRA, frozen base in {str(frozen[0].dtype)[6:]})"


def lora_meta(cfg_model) -> dict:
    """meta.json's "lora" entry: adapter settings, base folder and base fingerprint (cached per process)."""
    lora = cfg_model.lora
    fp = base_fingerprint(model_folder(cfg_model, "model.name_or_path"))  # a Hub id: its snapshot
    return {"r": lora.r, "alpha": lora.alpha, "dropout": lora.dropout, "target_modules": lora.target_modules,
            "base": cfg_model.name_or_path, "base_fingerprint": fp["fingerprint"], "base_params": fp["params"]}

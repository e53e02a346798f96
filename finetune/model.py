"""Model: any HF causal LM, built on `meta`, `fully_shard`-ed per decoder block, then initialised or loaded.

    python -m pytest tests/test_train_e2e.py

Random init is world-size independent: each parameter, whatever its kind (MoE experts, routers, norms, sinks), is
drawn in full, on its device, as transformers' own `_init_weights` draws it, from a generator seeded by (seed,
parameter name), and each rank keeps only its shard, so W=1 and W=8 start from the same weights (on the same device
type: a GPU draws other numbers than a CPU from the same seed). tests/test_families.py checks it for every family.
"""

from __future__ import annotations

import inspect
import os
import sysconfig
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

from common.dtypes import DTYPES  # the one name -> dtype map (model.param_dtype, reduce_dtype, export.dtype)
from finetune.lora import add_adapters
from finetune.model_files import model_folder
from finetune.shards import ModelError, copy_full_into, seed_for


def model_source(cfg_model) -> str:
    """The local folder of the model (name_or_path, else config_path): a Hub id's snapshot in the cache."""
    return model_folder(cfg_model, "model.name_or_path" if cfg_model.name_or_path else "model.config_path")


# One of these (or a *.model / *.tiktoken file) is a tokenizer's vocabulary; without any, transformers ends in
# advice to install sentencepiece or tiktoken
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model", "tokenizer.tiktoken")


def tokenizer_dir(cfg_model) -> str:
    return model_folder(cfg_model, "model.tokenizer_path") if cfg_model.tokenizer_path else model_source(cfg_model)


def check_model_folder(cfg_model) -> None:
    """The model folder has config.json and the tokenizer folder a vocabulary file, or one line names the folder,
    the key and the missing file (before any process group, on every rank alike)."""
    src_key = "model.name_or_path" if cfg_model.name_or_path else "model.config_path"
    tok_key = "model.tokenizer_path" if cfg_model.tokenizer_path else src_key
    for key, path in ((src_key, model_source(cfg_model)), (tok_key, tokenizer_dir(cfg_model))):
        if not os.path.isdir(path):
            raise ModelError(f"{key}={path}: no such model folder")
    if not os.path.isfile(os.path.join(model_source(cfg_model), "config.json")):
        raise ModelError(f"{src_key}={model_source(cfg_model)}: the folder has no config.json (not a HF model folder)")
    names = os.listdir(tokenizer_dir(cfg_model))
    if not any(f in TOKENIZER_FILES or f.endswith((".model", ".tiktoken")) for f in names):
        raise ModelError(f"{tok_key}={tokenizer_dir(cfg_model)}: the folder has no tokenizer file (one of "
                         f"{', '.join(TOKENIZER_FILES)}); point model.tokenizer_path at the folder that has it")


def load_tokenizer(cfg_model):
    from transformers import AutoTokenizer

    check_model_folder(cfg_model)
    return AutoTokenizer.from_pretrained(tokenizer_dir(cfg_model))


def decoder_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated transformer blocks: HF's `_no_split_modules` classes, else the longest ModuleList."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    blocks = [m for m in model.modules() if type(m).__name__ in names]
    if not blocks:
        lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len({type(c) for c in m}) == 1]
        blocks = list(max(lists, key=len)) if lists else []
    if not blocks:
        raise ModelError(f"cannot find decoder blocks in {type(model).__name__}: no _no_split_modules and no "
                         "ModuleList of identical blocks; shard it by hand in finetune/model.py")
    return blocks


# What the trainer asks of a model's forward: train_fsdp.py's step and finetune/evaluate.py call
# model(input_ids=..., position_ids=..., use_cache=False).logits
FORWARD_ARGS = ("input_ids", "position_ids", "use_cache")


def check_family(model: nn.Module) -> None:
    """What the code assumes of a model family, checked in one place on the meta model, before any sharding: one line
    naming what is missing. tests/test_families.py runs every family of finetune/tiny_assets.py FAMILIES through
    the rest (init at any world size, the Hub's layout in and out, resume, LoRA)."""
    cls = type(model).__name__
    if not callable(getattr(model, "_init_weights", None)) or getattr(model, "config", None) is None:
        raise ModelError(f"{cls} is not a transformers PreTrainedModel (no config or _init_weights): random init "
                         "and the buffers of a model built on meta come from transformers' _init_weights")
    if model.get_output_embeddings() is None:
        raise ModelError(f"{cls} has no language-model head (get_output_embeddings() is None): the loss is "
                         "next-token prediction on the logits of a causal LM")
    params = inspect.signature(model.forward).parameters
    takes_any = any(p.kind == p.VAR_KEYWORD for p in params.values())
    missing = [a for a in FORWARD_ARGS if a not in params and not takes_any]
    if missing:
        raise ModelError(f"{cls}.forward takes no {', '.join(missing)}: the trainer calls model(input_ids=..., "
                         "position_ids=..., use_cache=False) (position_ids restart per packed document)")
    decoder_blocks(model)  # each becomes one fully_shard group


def resolve_param_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


def build_mesh(device: torch.device, world_size: int, replicas: int, timeout: timedelta | None = None):
    """1-D mesh (FSDP over all ranks), or with replicas > 1 a 2-D (replicate, shard) mesh: HSDP. fully_shard
    then all-gathers and reduce-scatters within a shard group (consecutive ranks: one node with torchrun)
    and all-reduces gradients across replicas, so only that all-reduce crosses the node boundary.
    `timeout`: the mesh groups' collective timeout (train.collective_timeout_minutes); torch gives the groups
    it splits off for a 2-D mesh its default, 30 min, whatever the default group has."""
    from torch.distributed.device_mesh import init_device_mesh

    if replicas == 1:
        mesh = init_device_mesh(device.type, (world_size,), mesh_dim_names=("shard",))
    elif world_size % replicas:
        raise ModelError(f"model.replicas={replicas} must divide the world size {world_size}")
    else:
        mesh = init_device_mesh(device.type, (replicas, world_size // replicas), mesh_dim_names=("replicate", "shard"))
    for dim in range(mesh.ndim if timeout is not None else 0):
        dist.distributed_c10d._set_pg_timeout(timeout, mesh.get_group(dim))
    return mesh


# model.attn_implementation -> (the package transformers imports for it, how to get it); eager and sdpa need none
FLASH_PACKAGES = {"flash_attention_2": ("flash_attn", "pip install flash-attn --no-build-isolation (>= 2.3.3)"),
                  "flash_attention_3": ("flash_attn_interface", "flash-attn-3, built from flash-attention's hopper/")}
ATTN_IMPLEMENTATIONS = ("eager", "sdpa", *FLASH_PACKAGES)  # model.attn_implementation offers these


def check_attn_implementation(cfg_model) -> None:
    """Refuse a flash attention that cannot run here, in one line, before the model (or a process group) exists:
    transformers would fail later, or fall back to downloading a kernel from the hub."""
    impl = cfg_model.attn_implementation
    if impl not in FLASH_PACKAGES:
        return
    from transformers.utils import is_flash_attn_2_available, is_flash_attn_3_available

    package, how = FLASH_PACKAGES[impl]
    if not torch.cuda.is_available():
        raise ModelError(f"model.attn_implementation={impl} needs a CUDA GPU, and there is none here "
                         "(torch.cuda.is_available() is False); use sdpa, which also keeps packed documents apart")
    if not (is_flash_attn_2_available() if impl == "flash_attention_2" else is_flash_attn_3_available()):
        raise ModelError(f"model.attn_implementation={impl} needs the {package} package, which is not installed "
                         f"(or too old): {how}; or use sdpa")
    if resolve_param_dtype(cfg_model.param_dtype, torch.device("cuda")) == torch.float32:
        raise ModelError(f"model.attn_implementation={impl} computes in bf16/fp16 only, but model.param_dtype="
                         f"{cfg_model.param_dtype}; use model.param_dtype=bf16 (or auto)")


def causal_lm_from_config(cfg_model) -> nn.Module:
    """The HF causal LM of the config dir, fp32, with model.attn_implementation (on the current default device)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    src = model_source(cfg_model)
    if not os.path.isfile(os.path.join(src, "config.json")):
        raise ModelError(f"no config.json in model directory {src}")
    try:
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(src), dtype=torch.float32,
                                                attn_implementation=cfg_model.attn_implementation)
    except (ValueError, ImportError) as e:  # e.g. a model class without SDPA support: one line, not a traceback
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ModelError(f"cannot build the model of {src} with model.attn_implementation="
                         f"{cfg_model.attn_implementation}: {why}") from None


def build_sharded_model(cfg_model, mesh, device: torch.device) -> nn.Module:
    """HF causal LM on `meta`, fully_shard each block then the root, then `to_empty` on `device`.

    Parameters hold fp32 masters; MixedPrecisionPolicy casts for compute. Values are garbage until
    `init_random` or a load fills them.
    """
    check_attn_implementation(cfg_model)
    src = model_source(cfg_model)
    with torch.device("meta"):
        model = causal_lm_from_config(cfg_model)
    check_family(model)
    if cfg_model.lora.r:  # adapters go in on meta, before fully_shard groups the parameters
        add_adapters(model, cfg_model.lora, src, base_dtype=resolve_param_dtype(cfg_model.param_dtype, device))
    if cfg_model.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    blocks = decoder_blocks(model)
    if cfg_model.compile:  # after activation checkpointing, before fully_shard: torchtitan's order
        compile_blocks(blocks)
    mp = MixedPrecisionPolicy(param_dtype=resolve_param_dtype(cfg_model.param_dtype, device),
                              reduce_dtype=DTYPES[cfg_model.reduce_dtype])
    kwargs = {"mesh": mesh, "mp_policy": mp}
    if cfg_model.cpu_offload:
        if device.type == "cpu":  # FSDP2's offload pins host memory, which needs an accelerator
            raise ModelError("model.cpu_offload=true needs a GPU: without one the parameters already live on the CPU")
        kwargs["offload_policy"] = CPUOffloadPolicy()
    for block in blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)  # default reshard_after_forward: the root stays gathered for backward
    model.to_empty(device="cpu" if cfg_model.cpu_offload else device)
    init_buffers(model)
    return model


def compile_blocks(blocks: list[nn.Module]) -> None:
    """model.compile: torch.compile (inductor) each decoder block in place.

    `nn.Module.compile` compiles the block's call and leaves the module where it is, so the parameter names (which
    init, HF loading and LoRA go by), state_dict keys, checkpoints and the export are the eager model's;
    `torch.compile(block)` would wrap it, `_orig_mod.` inside every name.
    FSDP2's hooks, added afterwards, run outside the compiled graph (torch marks them dynamo-disabled); the blocks
    share one graph, their parameters being its inputs (LoRA: two, the first block's input needs no gradient).
    Compilation happens at the first forward, and again for the first eval (no grad). No fullgraph=True (torchtitan
    sets it for its own blocks): an HF or peft block that breaks the graph then runs slower, not stops with a
    traceback; tests/test_compile.py checks that the Llama block, with and without LoRA, compiles in one graph."""
    for block in blocks:
        block.compile()


def check_compile(cfg_model) -> None:
    """Refuse model.compile where inductor cannot build kernels, in one line, before any process group (milliseconds):
    on CPU it needs a C++ compiler and Python.h, on CUDA Triton. Otherwise the first training step would end in a
    traceback from inside the compiler."""
    if not cfg_model.compile:
        return
    if torch.cuda.is_available():
        from torch.utils._triton import has_triton

        if not has_triton():
            raise ModelError("model.compile=true needs Triton to build CUDA kernels, and it is not installed (it comes "
                             "with torch's CUDA wheels: pip install triton); or set model.compile=false")
        return
    from torch._inductor.cpp_builder import get_cpp_compiler
    from torch._inductor.exc import InvalidCxxCompiler

    try:
        get_cpp_compiler()  # inductor's own search: $CXX or g++, run with --version
    except InvalidCxxCompiler as e:
        raise ModelError(f"model.compile=true needs a C++ compiler to build CPU kernels: {str(e).strip()}; install "
                         "g++ (or name one in $CXX), or set model.compile=false") from None
    headers = sysconfig.get_path("include")
    if not os.path.isfile(os.path.join(headers, "Python.h")):
        raise ModelError(f"model.compile=true: inductor's CPU kernels include Python.h, which is not in {headers}; "
                         "install the Python headers (python3-dev), or set model.compile=false")


def init_buffers(model: nn.Module) -> None:
    """Set the buffers that `to_empty` left uninitialised and no checkpoint holds (non-persistent: rotary
    inv_freq, Gemma3's embed_scale, which sits in a module that also owns the embedding weight).

    HF's `_init_weights` runs on every module with buffers, its parameters flagged as initialised so that
    HF's init functions skip them: they are loaded or drawn next, and drawing them here would be wasted.
    Buffers are not sharded; a random one is drawn from the generator seeded by the module's name, so it too is
    the same at any world size.
    """
    with _forked_rng(model):
        for mod_name, module in model.named_modules():
            if next(module.buffers(recurse=False), None) is None:
                continue
            params = list(module.parameters(recurse=False))
            for p in params:
                p._is_hf_initialized = True
            try:
                torch.manual_seed(seed_for(0, f"buffers:{mod_name}"))
                model._init_weights(module)
            finally:
                for p in params:
                    del p._is_hf_initialized


@torch.no_grad()
def init_random(model: nn.Module, seed: int, std: float) -> None:
    """Every parameter as transformers' own init gives it (model.init_std as the config's initializer_range):
    Normal(0, std) for Linear/Embedding/Conv1D weights and MoE experts, zeros for biases, ones for norms (zeros
    where the model computes 1 + weight, as Gemma does), GPT-2's scaled residual projections, ...

    The same at any world size: each parameter in turn is made in full on its device, and `_init_weights` runs, as
    transformers applies it (children before parents), on its module and then each module above it, the default
    generator seeded by (seed, name); every other parameter is flagged as initialised meanwhile, so HF's init
    functions skip it and one pass draws exactly one parameter. Each rank keeps its shard. One full tensor at a
    time: the largest parameter, not the model. A parameter `_init_weights` leaves untouched is refused by name."""
    config = model.config
    had, saved_std = hasattr(config, "initializer_range"), getattr(config, "initializer_range", None)
    config.initializer_range = std
    try:
        with _forked_rng(model), _flagged(model):
            chains = _init_chains(model)
            for name, param in model.named_parameters():
                owner, attr, chain = chains[name]
                copy_full_into(param, _drawn_by_hf(owner, attr, chain, seed_for(seed, name), name, param))
    finally:
        if had:
            config.initializer_range = saved_std
        else:
            del config.initializer_range


def _init_chains(model: nn.Module) -> dict:
    """{parameter name: (its module, its attribute, [(module, the _init_weights transformers applies to it)] from
    that module up to the root)}: a module is initialised by its nearest enclosing PreTrainedModel's _init_weights."""
    out = {}

    def walk(prefix: str, module: nn.Module, chain: list) -> None:
        is_pretrained = callable(getattr(module, "_init_weights", None)) and hasattr(module, "config")
        chain = [(module, module._init_weights if is_pretrained else chain[-1][1]), *chain]
        for attr, _ in module.named_parameters(recurse=False):
            out[prefix + attr] = (module, attr, chain)
        for child_name, child in module.named_children():
            walk(f"{prefix}{child_name}.", child, chain)

    walk("", model, [])
    return out


def _drawn_by_hf(owner: nn.Module, attr: str, chain: list, seed: int, name: str, param: torch.Tensor) -> torch.Tensor:
    """Parameter `attr` of `owner` in full (fp32, on the parameter's device), as transformers' init passes over
    `chain` draw it from the default generator seeded with `seed` (all other parameters flagged: `_flagged`)."""
    full = torch.full(param.shape, float("nan"), dtype=torch.float32, device=param.device)
    saved = owner._parameters[attr]
    owner._parameters[attr] = nn.Parameter(full, requires_grad=False)
    try:
        torch.manual_seed(seed)
        for module, init_weights in chain:
            init_weights(module)
    finally:
        owner._parameters[attr] = saved
    if torch.isnan(full).any():
        raise ModelError(f"cannot random-init {type(chain[-1][0]).__name__}: transformers' _init_weights leaves "
                         f"{name} ({type(owner).__name__}) uninitialised, so it could not be drawn the same at every "
                         "world size; load weights instead (model.name_or_path)")
    return full


@contextmanager
def _flagged(model: nn.Module):
    """Every parameter and buffer flagged as initialised (`_is_hf_initialized`: transformers' init functions skip
    it) for the duration; the flags are removed afterwards."""
    tensors = {id(t): t for t in (*model.parameters(), *model.buffers())}.values()
    for t in tensors:
        t._is_hf_initialized = True
    try:
        yield
    finally:
        for t in tensors:
            del t._is_hf_initialized


@contextmanager
def _forked_rng(model: nn.Module):
    """The global RNG (CPU, and the CUDA device the parameters are on) as it was before, afterwards: the seeds set
    per parameter here must not leak into dropout or data order."""
    devices = sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})
    with torch.random.fork_rng(devices=devices):
        yield

"""Will this config fit? Memory per GPU, host memory for async staging, checkpoint size and save time.

    python train_fsdp.py --config configs/llama3-8b-sft.yaml --plan --gpu-memory 80
    python train_fsdp.py --config configs/llama3-70b-multinode.yaml --plan      # its plan: 8 nodes x 8 GPUs of 80 GiB

The hardware is the config's plan.* keys (nodes, GPUs per node, GiB per GPU), each overridden by its flag.

No process group, no GPU and no weights: the model is built on `meta` from its config.json (from
`model.name_or_path` when that folder is here or a Hub id, whose config.json alone is fetched, else
`model.config_path`), so every parameter shape is
exact. Per-GPU figures follow FSDP2 as train_fsdp.py sets it up (fp32 master shards, compute in
`model.param_dtype`, one block gathered at a time plus the next one prefetched); activations are an
estimate, stated as such. Exit 0 when it fits, 1 with the reasons when it does not (or when the world
size does not divide the global batch), 2 for a bad config. The formulas are in docs/planner.md.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from dataclasses import dataclass

import torch

from ckpt.preflight import SHM_DIR
from common.hub import HubError, config_file, is_hub_id
from common.words import plural
from finetune.config import ModelConfig
from finetune.data import BatchSplit, DataError
from finetune.lora import add_adapters
from finetune.model import decoder_blocks
from finetune.optim import optimizer_kind

GIB = 2 ** 30
MASTER_BYTES = 4  # fp32 master weights and fp32 sharded gradients
LOGITS_COPIES = 3.3  # logits + their gradient + fp32 chunks of the chunked loss (bench/loss_memory.py: 2.3 above them)
CUDA_OVERHEAD_GIB = 3.0  # CUDA context, NCCL buffers, allocator fragmentation: an assumption, not a measurement
CPU_PROCESS_GIB = 0.6  # a CPU rank's own VmRSS: 0.38 GiB measured after imports + gloo, the rest data and malloc slack

# How each line's figure is known, by the start of its text (the first match): from the parameter shapes, a
# formula, a measurement on this project's CPU machine, or an assumption. The plan prints it beside each line.
HOW_KNOWN = (("activations", "estimate: formula"),
             ("logits", "estimate: formula, copies measured (bench/loss_memory.py)"),
             ("CUDA context", "assumed"),
             ("python", "measured 0.38 GiB, rest assumed"),
             ("", "exact: parameter shapes"))


def how_known(what: str) -> str:
    return next(tag for start, tag in HOW_KNOWN if what.startswith(start))


def known_split(items: list[tuple[str, float]]) -> str:
    """The total by how it is known: 'exact 15.00 GiB, estimate 10.0 GiB, ...' (the first word of each tag)."""
    split: dict[str, float] = {}
    for what, b in items:
        kind = how_known(what).split(":")[0].split()[0]
        split[kind] = split.get(kind, 0) + b
    return ", ".join(f"{kind} {size(b)}" for kind, b in split.items() if b)


def _positive(typ):
    """An argparse type: a finite number > 0 (a negative GPU memory or bandwidth is a typo, not a plan)."""
    def parse(text: str):
        try:
            value = typ(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a {typ.__name__} > 0, got {text!r}") from None
        if not (math.isfinite(value) and value > 0):
            raise argparse.ArgumentTypeError(f"must be a {typ.__name__} > 0, got {text!r}")
        return value
    parse.__name__ = typ.__name__
    return parse


PLAN_FLAGS = {"nodes": None, "gpus_per_node": None, "gpu_memory": None, "host_memory": None, "write_gbps": 10.0,
              "copy_gbps": 10.0, "cpu": False}  # dest -> default: given without --plan they would be silently ignored
TOPOLOGY = ("nodes", "gpus_per_node", "gpu_memory", "cpu")  # flags the config's plan.* section states too


def add_plan_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("plan (--plan: print the plan and exit, no process group)")
    g.add_argument("--plan", action="store_true", help="print memory per GPU, host staging, checkpoint size, save time")
    g.add_argument("--nodes", type=_positive(int), default=None, help="nodes to plan for (default: plan.nodes)")
    g.add_argument("--gpus-per-node", type=_positive(int), default=None,
                   help="GPUs (ranks) per node (default: plan.gpus_per_node; ranks with --cpu)")
    g.add_argument("--cpu", action="store_true",
                   help="plan CPU ranks (gloo): memory per rank process, async staging included, no CUDA context "
                        "(default: plan.cpu)")
    g.add_argument("--gpu-memory", type=_positive(float), default=None,
                   help="GiB per GPU: exit 1 when the plan needs more (default: plan.gpu_memory)")
    g.add_argument("--host-memory", type=_positive(float), default=None,
                   help="GiB of RAM (and of /dev/shm) per node to check")
    g.add_argument("--write-gbps", type=_positive(float), default=10.0,
                   help="aggregate write bandwidth of ckpt.dir's filesystem, GB/s (default 10)")
    g.add_argument("--copy-gbps", type=_positive(float), default=10.0,
                   help="GPU-to-host copy bandwidth per GPU while staging, GB/s (default 10)")


def planned_hardware(cfg, args: argparse.Namespace) -> tuple[argparse.Namespace, str]:
    """`args` with the topology the config states (its plan.* keys) where no flag overrides it, and the plan's
    first line, naming the topology and where each part of it came from."""
    args, origin = argparse.Namespace(**vars(args)), {}
    for dest in TOPOLOGY:
        flag = getattr(args, dest)
        given = flag not in (None, False)
        if not given:
            stated = getattr(cfg.plan, dest)
            setattr(args, dest, (stated or None) if dest == "gpu_memory" else stated)  # 0 GiB: not stated
        origin[dest] = f"--{dest.replace('_', '-')}" if given else f"plan.{dest}"
    args.origin = origin  # the GPU memory line names where its figure came from
    ranks = "CPU ranks" if args.cpu else "GPUs" + (f" of {args.gpu_memory:g} GiB" if args.gpu_memory else "")
    sources = ", ".join(origin[d] for d in TOPOLOGY if d != "cpu" and (d != "gpu_memory" or (args.gpu_memory and not args.cpu)))
    return args, (f"plan: {plural(args.nodes, 'node')} x {args.gpus_per_node} {ranks} = world size "
                  f"{args.nodes * args.gpus_per_node} (from {sources})")


def plan_flags_without_plan(args: argparse.Namespace) -> str | None:
    """The planner flags given without --plan (they only change the plan), as one message, or None."""
    given = [f"--{dest.replace('_', '-')}" for dest, default in PLAN_FLAGS.items() if getattr(args, dest) != default]
    if args.plan or not given:
        return None
    one = len(given) == 1
    return f"{', '.join(given)} only change{'s' if one else ''} the plan: add --plan (or drop {'it' if one else 'them'})"


# ---------------------------------------------------------------- the model's shapes, from config.json

@dataclass
class Shapes:
    """What the plan needs from the model: parameter counts by role, and the sizes activations scale with."""
    arch: str
    source: str
    params: int  # the model's own parameters (a LoRA model: the base, without its adapters)
    trainable: int  # what the optimizer updates (all of them, or the LoRA adapters)
    root_params: int  # outside the decoder blocks (embeddings, final norm, lm_head): the root FSDP group
    block_params: int  # one decoder block (the largest)
    sharded_trainable: list  # (dim0, numel) of each trainable tensor: FSDP2 pads dim 0 to a multiple of W
    sharded_frozen: list
    layers: int
    hidden: int
    kv_hidden: int
    intermediate: int  # the MLP width a token's activations scale with (mlp_width: top-k experts for MoE)
    vocab: int
    max_positions: int | None
    experts: int = 0  # routed experts per MoE block (0: a dense model)
    experts_per_token: int = 0


def mlp_width(hf) -> tuple[int, int, int]:
    """(the MLP width one token's activations scale with, routed experts, experts per token) of a HF config. A
    Mixture-of-Experts block (num_experts_per_tok) runs top-k experts of moe_intermediate_size (Mixtral:
    intermediate_size) per token, plus a shared expert where the family has one (Qwen2-MoE's
    shared_expert_intermediate_size, DeepSeek's n_shared_experts); a dense one its intermediate_size."""
    dense = getattr(hf, "intermediate_size", None) or 4 * hf.hidden_size
    top_k = getattr(hf, "num_experts_per_tok", None)
    if not top_k:
        return dense, 0, 0
    expert = getattr(hf, "moe_intermediate_size", None) or dense
    shared = getattr(hf, "shared_expert_intermediate_size", None) or \
        (getattr(hf, "n_shared_experts", None) or 0) * expert
    experts = getattr(hf, "num_local_experts", None) or getattr(hf, "num_experts", None) or \
        getattr(hf, "n_routed_experts", None) or 0
    return top_k * expert + shared, experts, top_k


def config_dir(cfg_model) -> tuple[str, str]:
    """(folder whose config.json describes the model, a note on where it came from)."""
    if cfg_model.name_or_path and os.path.isfile(os.path.join(cfg_model.name_or_path, "config.json")):
        return cfg_model.name_or_path, ""
    key = "model.name_or_path" if cfg_model.name_or_path else "model.config_path"
    value = cfg_model.name_or_path or cfg_model.config_path
    if is_hub_id(value):  # config.json alone, no weights: the Hub's one file, into the Hugging Face cache
        try:
            folder = os.path.dirname(config_file(value, cfg_model.revision))
        except HubError as e:
            raise ValueError(f"{key}={value}: {e}") from None
        return folder, f" (Hub id {value} at commit {os.path.basename(folder)}: its config.json only)"
    if cfg_model.name_or_path and cfg_model.config_path == ModelConfig().config_path:
        raise ValueError(f"model.name_or_path={cfg_model.name_or_path} is not on this machine; to plan without it, "
                         "set model.config_path to a folder with its config.json (e.g. assets/llama3.1-8b)")
    note = f" (model.name_or_path {cfg_model.name_or_path} is not here)" if cfg_model.name_or_path else ""
    if not os.path.isfile(os.path.join(cfg_model.config_path, "config.json")):
        raise ValueError(f"no config.json in model directory {cfg_model.config_path}")
    return cfg_model.config_path, note


def model_shapes(cfg_model) -> Shapes:
    from transformers import AutoConfig, AutoModelForCausalLM

    src, note = config_dir(cfg_model)
    hf = AutoConfig.from_pretrained(src)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf)
    lora = getattr(cfg_model, "lora", None)
    if lora is not None and lora.r:  # the adapters exactly as training adds them (peft, on meta)
        add_adapters(model, lora, src, base_dtype=torch.bfloat16)
    blocks = decoder_blocks(model)
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    shapes = [(p.shape[0] if p.dim() else 1, p.numel(), p.requires_grad) for p in model.parameters()]
    trainable = [(d, n) for d, n, grad in shapes if grad]
    frozen = [(d, n) for d, n, grad in shapes if not grad]
    heads = hf.num_attention_heads
    width, experts, top_k = mlp_width(hf)
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // heads
    return Shapes(
        arch=type(model).__name__, source=os.path.join(src, "config.json") + note,
        params=sum(n for _, n in (frozen or trainable)), trainable=sum(n for _, n in trainable),  # base size
        root_params=sum(p.numel() for p in model.parameters() if id(p) not in in_blocks),
        block_params=max(sum(p.numel() for p in b.parameters()) for b in blocks),
        sharded_trainable=trainable, sharded_frozen=frozen,
        layers=len(blocks), hidden=hf.hidden_size, kv_hidden=getattr(hf, "num_key_value_heads", heads) * head_dim,
        intermediate=width, vocab=hf.vocab_size, max_positions=getattr(hf, "max_position_embeddings", None),
        experts=experts, experts_per_token=top_k)


def shard_numel(tensors: list, world: int) -> int:
    """Elements one rank holds: FSDP2 splits dim 0 in ceil(dim0 / W) rows (the last ranks padded)."""
    return sum(math.ceil(dim0 / world) * (numel // max(dim0, 1)) for dim0, numel in tensors)


# ---------------------------------------------------------------- memory per GPU

def activation_bytes(s: Shapes, tokens: int, compute: int, checkpointing: bool) -> tuple[int, int]:
    """(decoder activations, logits + loss) of one micro batch of `tokens` tokens.

    Per token and layer a Llama-style block keeps for backward about 10 hidden-sized, 2 kv-sized and 4
    MLP-sized tensors in the compute dtype (norm outputs, q/k/v, attention output, residuals, gate, up,
    act(gate), their product) plus two fp32 RMSNorm inputs; SDPA keeps no seq x seq matrix. With activation
    checkpointing only each block's input is kept, plus one block recomputed at a time."""
    per_layer = compute * (10 * s.hidden + 2 * s.kv_hidden + 4 * s.intermediate) + 2 * 4 * s.hidden
    if checkpointing:
        decoder = tokens * (s.layers * s.hidden * compute + per_layer)
    else:
        decoder = tokens * s.layers * per_layer
    return decoder, int(tokens * s.vocab * compute * LOGITS_COPIES)


def compute_bytes(cfg, cpu: bool = False) -> int:
    if cfg.model.param_dtype == "auto":
        return 4 if cpu else 2  # auto = fp32 on CPU, bf16 on CUDA (finetune/model.py)
    return 4 if cfg.model.param_dtype == "fp32" else 2


def gpu_states(cfg, s: Shapes, world: int) -> list[tuple[str, int]]:
    """[(what, bytes)] of one rank's shards: parameters, gradients, optimizer state (finetune/optim.py's size)."""
    trainable = shard_numel(s.sharded_trainable, world)
    frozen = shard_numel(s.sharded_frozen, world)
    return [(f"parameters ({'fp32 masters' if not frozen else 'fp32 adapters + frozen base in compute dtype'})",
             MASTER_BYTES * trainable + compute_bytes(cfg) * frozen),
            ("gradients (fp32 shards)", MASTER_BYTES * trainable),
            (f"optimizer state ({cfg.train.optimizer}: {optimizer_kind(cfg.train).state_bytes} B per parameter)",
             optimizer_kind(cfg.train).state_bytes * trainable)]


def gpu_items(cfg, s: Shapes, world: int, micro_batch: int, accum: int = 1) -> list[tuple[str, float]]:
    """[(what, bytes)] on one GPU: the states FSDP2 shards (over W / model.replicas ranks: HSDP shards
    within a replica group), what it gathers for one block, activations."""
    compute = compute_bytes(cfg)
    reduce = 4 if cfg.model.reduce_dtype == "fp32" else 2
    decoder, logits = activation_bytes(s, micro_batch * cfg.data.seq_len, compute, cfg.model.activation_checkpointing)
    states = gpu_states(cfg, s, shard_world(cfg, world))
    if cfg.model.cpu_offload:  # CPUOffloadPolicy: the shards and the optimizer step live in host memory
        states = [(f"{what}: in host memory (model.cpu_offload)", 0) for what, _ in states]
    block_grads = s.block_params * s.trainable // s.params  # LoRA: the frozen base has no gradients
    if accum > 1 and not cfg.train.reduce_every_micro_batch:  # no-sync accumulation holds every unsharded grad
        states = states + [("unsharded gradients between micro batches (train.reduce_every_micro_batch=false)",
                            reduce * s.trainable)]
    return states + [
        ("gathered parameters (root + 2 blocks, compute dtype)", compute * (s.root_params + 2 * s.block_params)),
        ("unsharded gradients of one block before reduce-scatter", (compute + reduce) * block_grads),
        (f"activations, micro batch {micro_batch} x {cfg.data.seq_len}"
         f"{' (activation checkpointing)' if cfg.model.activation_checkpointing else ''}, estimate", decoder),
        (f"logits and chunked loss ({micro_batch * cfg.data.seq_len} tokens x vocab {s.vocab})", logits),
        ("CUDA context, NCCL, allocator slack (assumed)", CUDA_OVERHEAD_GIB * GIB)]


def cpu_items(cfg, s: Shapes, world: int, micro_batch: int, rank_staged: int) -> list[tuple[str, float]]:
    """[(what, bytes)] in one CPU rank's process (its VmRSS): the same sharded states as on a GPU, fused AdamW
    (no temporaries: bench/adamw_cpu.py; SGD's weight decay makes a temporary of one gradient tensor at a time on
    CPU, not counted), the root group's unsharded parameters and gradients (on CPU the
    embedding dwarfs a block), activations, and the async staging buffers, which live in the rank's own
    memory (shared-memory pages in process mode count in its VmRSS too)."""
    compute = compute_bytes(cfg, cpu=True)
    reduce = 4 if cfg.model.reduce_dtype in ("fp32", "auto") else 2
    decoder, logits = activation_bytes(s, micro_batch * cfg.data.seq_len, compute, cfg.model.activation_checkpointing)
    unsharded = max(s.root_params, s.block_params) * s.trainable // s.params  # LoRA: no base gradients
    mode = cfg.ckpt.async_mode
    return gpu_states(cfg, s, shard_world(cfg, world)) + [
        ("gathered parameters (root + 2 blocks, compute dtype)", compute * (s.root_params + 2 * s.block_params)),
        ("unsharded gradients of the root group or a block, before reduce-scatter",
         (compute + reduce) * unsharded),
        (f"activations, micro batch {micro_batch} x {cfg.data.seq_len}"
         f"{' (activation checkpointing)' if cfg.model.activation_checkpointing else ''}, estimate", decoder),
        (f"logits and chunked loss ({micro_batch * cfg.data.seq_len} tokens x vocab {s.vocab})", logits),
        (f"async staging buffers (ckpt.async_mode={mode}{': shared memory' if mode == 'process' else ''})",
         rank_staged if mode != "off" else 0),
        ("python, torch, transformers, gloo (0.38 GiB measured), data, malloc slack", CPU_PROCESS_GIB * GIB)]


def cpu_node_lines(total: float, args, tier_ram: int, problems: bool = False) -> list[str]:
    """The per-rank total and a node's sum with the memory tier's RAM (report lines), or the problem when
    --host-memory is below it."""
    node = total * args.gpus_per_node + tier_ram
    tier = f" + memory tier {size(tier_ram)}" if tier_ram else ""
    if problems:
        return [f"host memory: {size(node)} per node needed ({args.gpus_per_node} ranks x {size(total)}{tier}), "
                f"--host-memory {args.host_memory:g} GiB"] if args.host_memory and node > args.host_memory * GIB else []
    budget = f" of {args.host_memory:g} GiB" if args.host_memory else " (--host-memory GiB checks the fit)"
    return [f"  {'total':<72} {size(total):>10}",
            f"  {f'per node: {args.gpus_per_node} ranks{tier}':<72} {size(node):>10}{budget}"]


def item_lines(items: list[tuple[str, float]]) -> list[str]:
    return [f"  {what:<72} {size(b):>10}  [{how_known(what)}]" for what, b in items]


# ---------------------------------------------------------------- the plan

def size(n: float) -> str:
    for unit, scale in (("GiB", GIB), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}" if unit != "GiB" else f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def count(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(n)


def seconds(t: float) -> str:
    return f"{t:.2f} s" if t < 10 else f"{t:.0f} s"


def divisors(n: int) -> list[int]:
    return [w for w in range(1, n + 1) if n % w == 0]


def shard_world(cfg, world: int) -> int:
    """Ranks one copy of the state is sharded over: W, or W / model.replicas with HSDP."""
    return max(1, world // cfg.model.replicas)


def checkpoint_bytes(s: Shapes, world: int, state_bytes: int) -> tuple[int, int]:
    """(one checkpoint, one rank's part): the trainable fp32 weights and their optimizer state, `state_bytes` per
    parameter (finetune/optim.py: AdamW 8, so 12 bytes each)."""
    per_param = MASTER_BYTES + state_bytes
    return per_param * s.trainable, per_param * shard_numel(s.sharded_trainable, world)


def host_lines(cfg, rank_bytes: int, offload_bytes: int, ranks_per_node: int,
               host_gib: float | None, tier_ram: int = 0) -> tuple[list[str], list[str]]:
    """Host memory per node for async staging (ckpt/preflight.py checks the same at run time), for
    model.cpu_offload and for the memory tier (`tier_ram`), and the problems when --host-memory is given."""
    mode = cfg.ckpt.async_mode
    staged = rank_bytes * ranks_per_node if mode != "off" else 0
    offloaded = offload_bytes * ranks_per_node
    if mode == "off":
        lines = ["host per node: no async staging (ckpt.async_mode=off): every save blocks for the whole write"]
    else:
        where = "/dev/shm (and of RAM)" if mode == "process" else "pinned RAM"
        lines = [f"host per node: {size(staged)} of {where} to stage async saves (ckpt.async_mode={mode}: "
                 f"{plural(ranks_per_node, 'rank')} x {size(rank_bytes)})"]
    if offloaded:
        lines.append(f"host per node: {size(offloaded)} of pinned RAM for the offloaded parameters, gradients "
                     "and optimizer state (model.cpu_offload)")
    problems = []
    if host_gib is not None and staged + offloaded + tier_ram > host_gib * GIB:
        tier = f", memory tier {size(tier_ram)}: its line above" if tier_ram else ""
        problems.append(f"host memory: {size(staged + offloaded + tier_ram)} per node needed, --host-memory "
                        f"{host_gib:g} GiB (ckpt.async_mode=off stages nothing{tier})")
    return lines, problems


def memory_tier_lines(cfg, rank_bytes: int, ranks_per_node: int, nodes: int) -> tuple[list[str], int]:
    """The memory tier's need per node (ckpt/memory_tier/tier.py checks the same at start and turns the tier off if short):
    report lines, and the bytes of RAM: its staging buffers, and its steps where the folder is /dev/shm's."""
    c = cfg.ckpt
    if not c.memory_interval:
        return [], 0
    replicas = min(c.memory_replicas, nodes - 1)  # as ckpt/memory_tier/tier.py: at most one copy on each other node
    copies = f" x (1 + {plural(replicas, 'replica')})" if replicas else ""
    need, staging = (c.memory_keep + 1) * (1 + replicas) * ranks_per_node * rank_bytes, ranks_per_node * rank_bytes
    folder = os.path.normpath(c.memory_dir or SHM_DIR)
    in_ram = folder == SHM_DIR or folder.startswith(SHM_DIR + "/")  # a node's other folders: not known here
    return [f"memory tier (ckpt.memory_interval={c.memory_interval}): {size(need)} per node in "
            f"{c.memory_dir or SHM_DIR} ((memory_keep {c.memory_keep} + 1){copies} x "
            f"{plural(ranks_per_node, 'rank')} x {size(rank_bytes)}), and {size(staging)} of RAM "
            "to stage its saves"], staging + (need if in_ram else 0)


def make_plan(cfg, args, topology: str) -> tuple[list[str], list[str]]:
    """(report lines, problems): an empty problem list means the config fits the hardware `args` states
    (planned_hardware's; `topology` its line)."""
    s = model_shapes(cfg.model)
    world = args.nodes * args.gpus_per_node
    lines = [topology,
             f"model: {s.arch} from {s.source}: {count(s.params)} params ({s.params:,}), {s.layers} blocks, "
             f"hidden {s.hidden}, vocab {s.vocab}" + (f"; trainable (LoRA adapters) {s.trainable:,}"
                                                      if s.trainable != s.params else "")]
    problems = []
    g = cfg.data.global_batch_size
    try:
        batch = BatchSplit.make(g, cfg.data.micro_batch_size, world)
        lines.append(f"batch: global {g} = {plural(world, 'rank')} x {batch.accum_steps} accum x {batch.micro_batch} micro, "
                     f"seq {cfg.data.seq_len}; world sizes that divide it: {divisors(g)}")
        micro, accum = batch.micro_batch, batch.accum_steps
    except DataError as e:
        problems.append(str(e))
        micro, accum = min(cfg.data.micro_batch_size, g), 1
    if s.experts:  # no expert parallelism: FSDP gathers a whole block, so every expert, on every rank
        lines.append(f"MoE: {s.experts} experts per block, {s.experts_per_token} per token (activations: MLP width "
                     f"{s.intermediate}); every expert of a block is gathered on every rank (no expert parallelism)")
    if s.max_positions and cfg.data.seq_len > s.max_positions:
        problems.append(f"data.seq_len={cfg.data.seq_len} is above the model's max_position_embeddings={s.max_positions}")

    state_bytes = optimizer_kind(cfg.train).state_bytes
    ckpt, rank_bytes = checkpoint_bytes(s, shard_world(cfg, world), state_bytes)  # every replica stages its own shard
    items = cpu_items(cfg, s, world, micro, rank_bytes) if args.cpu else gpu_items(cfg, s, world, micro, accum)
    total = sum(b for _, b in items)
    lines.append("per rank (CPU process, VmRSS):" if args.cpu else "per GPU:")
    lines += item_lines(items)
    tier_lines, tier_ram = memory_tier_lines(cfg, rank_bytes, args.gpus_per_node, args.nodes)
    if args.cpu:  # the ranks of a node share its RAM; staging is in each rank's total already
        lines += cpu_node_lines(total, args, tier_ram)
        problems += cpu_node_lines(total, args, tier_ram, problems=True)
    else:
        budget = f" of {args.gpu_memory:g} GiB" if args.gpu_memory else " (--gpu-memory GiB checks the fit)"
        lines.append(f"  {'total':<72} {size(total):>10}{budget}")
    lines.append(f"  of which: {known_split(items)} (docs/planner.md: how each figure is known)")
    if not args.cpu and args.gpu_memory and total > args.gpu_memory * GIB:
        worst = max(items, key=lambda it: it[1])
        problems.append(f"GPU memory: {size(total)} per GPU needed, {args.origin['gpu_memory']} {args.gpu_memory:g} GiB; "
                        f"largest item: {worst[0]} {size(worst[1])} (more GPUs shard the states further; "
                        "model.activation_checkpointing=true and a smaller data.micro_batch_size cut activations)")

    if cfg.model.compile:  # inductor frees some intermediates and keeps others: not measured, so not modelled
        lines.append("model.compile: activations above are eager's estimate; what compiled blocks keep is not planned")
    offload = sum(b for what, b in gpu_states(cfg, s, shard_world(cfg, world))) if cfg.model.cpu_offload else 0
    more, host_problems = host_lines(cfg, rank_bytes, offload, args.gpus_per_node, args.host_memory, tier_ram)
    lines += more + tier_lines
    problems += [] if args.cpu else host_problems
    keep = cfg.ckpt.keep_last
    lines.append(f"checkpoint: {size(ckpt)} per save (fp32 {'adapters' if s.trainable != s.params else 'weights'}"
                 f" + {cfg.train.optimizer} state: {MASTER_BYTES + state_bytes} B x {s.trainable:,}), "
                 f"{size(rank_bytes)} per rank; keep_last {keep}: "
                 f"{'every one kept' if keep == 0 else f'{size(ckpt * (keep + 1))} on disk at peak'}; "
                 f"HF export {size(2 * s.params)} in bf16")
    write_s = ckpt / (args.write_gbps * 1e9)
    copy_s = rank_bytes / (args.copy_gbps * 1e9)
    lines.append(f"save time at {args.write_gbps:g} GB/s aggregate write (--write-gbps: assumed, set your filesystem's): "
                 f"a sync save {seconds(write_s)}; "
                 + (f"an async save blocks training ~{seconds(copy_s)} (staging at {args.copy_gbps:g} GB/s per GPU, "
                    f"--copy-gbps: assumed), committed after ~{seconds(copy_s + write_s)}" if cfg.ckpt.async_mode != "off" else
                    "async off: every save blocks for the whole write")
                 + f"; preemption lead time >= ~{seconds(copy_s + 2 * write_s)} (in-flight save + final save)")
    return lines, problems


def print_plan(cfg, args) -> int:
    """`train_fsdp.py --plan`: 0 when it fits, 1 with the reasons when it does not, 2 for a config it cannot read."""
    args, topology = planned_hardware(cfg, args)
    try:
        lines, problems = make_plan(cfg, args, topology)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    for p in problems:
        print(f"does not fit: {p}", file=sys.stderr)
    if problems:
        return 1
    unchecked = (" (host memory not checked: pass --host-memory GiB)" if args.cpu and not args.host_memory else
                 "" if args.cpu or args.gpu_memory else " (GPU memory not checked: set plan.gpu_memory or pass "
                 "--gpu-memory GiB)")
    print("OK: the plan fits" + unchecked)
    return 0

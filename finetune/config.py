"""The one typed config of a fine-tuning run: defaults < YAML preset < `key=value` overrides.

    python -c "from finetune.config import load_config; print(load_config('configs/tiny.yaml', ['train.max_steps=5']))"

Every field has a default and a one-line doc. Unknown keys and wrong types raise `ConfigError`
naming the key, before any process group exists.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import difflib
import importlib.util
import inspect
import json
import math
import os
import re
import typing
from dataclasses import dataclass, field

import yaml

from ckpt.policy import parse_interval
from ckpt.storage import is_url, unsupported
from finetune.hang import parse_hang_timeout
from finetune.schedule import SCHEDULES


class ConfigError(ValueError):
    """A config problem the user must fix; the message names the key."""


class ArgumentParser(argparse.ArgumentParser):
    """Command-line mistakes raise ConfigError, so they are reported like config mistakes: one `error:` line,
    once under torchrun (finetune/launch.py), instead of argparse's usage + error on every rank."""

    def error(self, message: str):
        raise ConfigError(f"{message} (python {self.prog} --help lists the arguments)")


@dataclass
class RunConfig:
    dir: str = "runs/tiny"  # where metrics.jsonl, config.yaml, checkpoints/ and hf/ go
    log_interval: int = 10  # print one line every N optimizer steps (metrics.jsonl gets every step)
    progress_bar: bool = True  # tqdm bar on rank 0, only when stdout is a terminal
    tensorboard: bool = False  # also write TensorBoard event files to <dir>/tensorboard (needs `tensorboard`)
    wandb: str = "off"  # off | offline | online: also log to Weights & Biases, files in <dir>/wandb (needs `wandb`)
    wandb_project: str = "fsdp-finetune"  # W&B project name


@dataclass
class LoRAConfig:
    r: int = 0  # LoRA rank (peft); 0 = off: full fine-tuning. >0 freezes the base from name_or_path
    alpha: float = 16.0  # LoRA scaling is alpha / r
    dropout: float = 0.0  # dropout on the adapter's input (uses the per-rank RNG that checkpoints restore)
    target_modules: str = "all-linear"  # q_proj,v_proj (module names), or all-linear: every block Linear, not lm_head
    quantize: str = "none"  # none | 4bit: a 4-bit base (QLoRA) needs GPU kernels and is not supported


@dataclass
class ModelConfig:
    name_or_path: str = ""  # local HF model dir (config.json + safetensors + tokenizer), or empty
    config_path: str = "assets/tiny-llama"  # HF config dir used when name_or_path is empty (random init)
    tokenizer_path: str = ""  # tokenizer dir; empty = name_or_path, else config_path
    param_dtype: str = "auto"  # fp32 | bf16 | auto (bf16 on CUDA, fp32 on CPU)
    reduce_dtype: str = "fp32"  # dtype of the gradient reduce-scatter
    attn_implementation: str = "sdpa"  # eager | sdpa | flash_attention_2 | flash_attention_3 (CUDA + flash_attn)
    activation_checkpointing: bool = False  # recompute each decoder block in backward
    compile: bool = False  # torch.compile each decoder block (inductor; a C++ compiler on CPU): docs/performance.md
    cpu_offload: bool = False  # FSDP2 CPUOffloadPolicy: params, grads and optimizer state on CPU
    init_std: float = 0.02  # std of the normal init for random-init models
    replicas: int = 1  # HSDP when > 1: shard within groups of W/replicas ranks (a node), replicate across groups
    lora: LoRAConfig = field(default_factory=LoRAConfig)  # model.lora.*: adapters instead of full fine-tuning


@dataclass
class DataConfig:
    path: str = "data/tiny/train.jsonl"  # local jsonl/json/parquet/arrow/txt file(s) (comma separated), a folder, or a hub name
    name: str = ""  # hub subset (config name) of data.path
    split: str = "train"  # split of data.path (hub name or a folder saved by `datasets`)
    revision: str = ""  # hub revision (commit, tag or branch) of data.path
    mixture: str = ""  # several sources with weights, 'path:weight; path:weight' (replaces data.path)
    eval_path: str = ""  # eval data: file(s), folder, hub name, or 'split:<name>' of data.path; empty = no eval
    format: str = "auto"  # text | chat | auto (chat when a `messages` column exists)
    text_field: str = "text"  # column holding plain text
    messages_field: str = "messages"  # column holding chat messages [{role, content}, ...]
    pack: bool = False  # concatenate documents into seq_len chunks (attention stays within each document)
    truncation: bool = True  # unpacked documents longer than seq_len are cut; false: such a row is an error
    seq_len: int = 64  # tokens per sample
    global_batch_size: int = 16  # samples per optimizer step, summed over all ranks
    micro_batch_size: int = 8  # cap on samples per forward on one rank: lowered to a divisor of the per-rank batch
    epochs: int = 1  # passes over the data; training ends when they run out, even before max_steps
    cache_dir: str = ""  # tokenized data, keyed by a hash of its inputs; default <run.dir>/data-cache (shared FS)
    num_proc: int = 0  # tokenizer processes on rank 0; 0 = the CPU cores available to it


@dataclass
class TrainConfig:
    max_steps: int = 100  # optimizer steps
    seed: int = 1234  # model init, data order and dropout all derive from it
    lr: float = 1e-3  # peak learning rate
    lr_schedule: str = "cosine"  # cosine | wsd (warmup-stable-decay); finetune/schedule.py
    min_lr_ratio: float = 0.1  # the schedule ends at lr * min_lr_ratio
    warmup_steps: int = 10  # linear warmup from 0
    decay_fraction: float = 0.2  # wsd: the last fraction of max_steps that decays linearly to lr * min_lr_ratio
    weight_decay: float = 0.01  # AdamW decoupled weight decay
    beta1: float = 0.9  # AdamW first-moment decay
    beta2: float = 0.95  # AdamW second-moment decay
    grad_clip: float = 1.0  # max global grad norm; 0 disables clipping
    collective_timeout_minutes: float = 10.0  # a training collective waiting longer ends the job (a rank stuck or dead)
    hang_timeout: str = "auto"  # s a step may last before exit 76 naming the stuck rank; auto; 0: off (finetune/hang.py)
    straggler_margin: float = 0.2  # log a rank computing this fraction over the mean 3 log intervals running (0: off)
    deterministic: bool = False  # torch.use_deterministic_algorithms: bit-identical reruns on GPU, a little slower
    reduce_every_micro_batch: bool = True  # false: one reduce-scatter per step, unsharded grads between (small models)
    eval_interval: int = 0  # eval loss on data.eval_path every N optimizer steps and at the end (0 = off)
    eval_batches: int = 0  # global batches of the eval set per evaluation (0 = all of it)
    sample_at_end: bool = True  # greedy-generate from sample_prompts at the end (rank 0 prints)
    sample_prompts: str = ""  # prompts separated by '|', sent as a user turn when the tokenizer has a chat template


@dataclass
class CkptConfig:
    dir: str = ""  # default <run.dir>/checkpoints
    interval: str = "50"  # save every N optimizer steps (0: none), or auto: Young/Daly sqrt(2 x save cost x MTBF)
    interval_minutes: float = 0.0  # also save once this many minutes of wall clock passed since the last save (0: off)
    mtbf_hours: float = 24.0  # the job's mean time between failures, for interval=auto
    async_mode: str = "process"  # off | thread | process (process: sooner commits at 0.5B; docs/performance.md)
    upload_nice: int = 19  # niceness 0-19 of async uploads and memory-tier copies: higher slows steps less, commits later
    keep_last: int = 3  # keep the newest k committed checkpoints (0 keeps all)
    keep_best: int = 0  # also keep the k checkpoints with the lowest eval loss (needs train.eval_interval)
    resume: str = "auto"  # auto (newest committed) | none | <path to a step-NNNNNN dir>
    save_at_end: bool = True  # synchronous final save at max_steps / end of data / exception
    continue_on_save_error: bool = False  # log a failed periodic save and keep training
    unchecked_store: bool = False  # run on an object store that ignores create-only/compare-and-swap, at your own risk
    timeout_minutes: float = 30.0  # checkpoint collectives (save, load) wait this long for a rank
    resume_config_check: str = "refuse"  # refuse | warn: resume with changed model/data/seed/batch (docs/resume-rules)
    memory_interval: int = 0  # also save to node-local memory every N steps (0: off; docs/memory-tier.md)
    memory_dir: str = ""  # default /dev/shm/fsdp-ckpt-<hash of ckpt.dir>-<user>; or node-local NVMe
    memory_keep: int = 1  # keep the newest 1 or 2 memory steps
    memory_replicas: int = 1  # copies of each node's memory steps on the next nodes (several nodes; ring by node)


@dataclass
class ExportConfig:
    at_end: bool = False  # write a HF model folder to <run.dir>/hf after training
    dtype: str = "auto"  # auto (the source model's torch_dtype, fp32 for random init) | fp32 | bf16 | fp16


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    ckpt: CkptConfig = field(default_factory=CkptConfig)
    export: ExportConfig = field(default_factory=ExportConfig)


_CHOICES = {
    "model.param_dtype": ("auto", "fp32", "bf16"),
    "model.reduce_dtype": ("fp32", "bf16"),
    "model.attn_implementation": ("eager", "sdpa", "flash_attention_2", "flash_attention_3"),
    "data.format": ("auto", "text", "chat"),
    "ckpt.async_mode": ("off", "thread", "process"),
    "train.lr_schedule": SCHEDULES,
    "export.dtype": ("auto", "fp32", "bf16", "fp16"),
    "ckpt.resume_config_check": ("refuse", "warn"),
    "run.wandb": ("off", "offline", "online"),
    "model.lora.quantize": ("none", "4bit"),
}


def _at_least(low):
    return lambda v: v >= low, f">= {low}"


def _above(low):
    return lambda v: v > low, f"> {low}"


def _between(low, high, high_open=False):
    return (lambda v: low <= v < high) if high_open else (lambda v: low <= v <= high), \
        f"in [{low}, {high}{')' if high_open else ']'}"


# Every int and float field: (check, allowed range in words). tests/test_config.py keeps this complete.
_RANGES = {
    "run.log_interval": _at_least(1),
    "model.init_std": _above(0),
    "model.replicas": _at_least(1),
    "model.lora.r": _at_least(0),
    "model.lora.alpha": _above(0),
    "model.lora.dropout": _between(0, 1, high_open=True),
    "data.seq_len": _at_least(2),  # the loss needs a next token
    "data.global_batch_size": _at_least(1),
    "data.micro_batch_size": _at_least(1),
    "data.epochs": _at_least(1),
    "train.max_steps": _at_least(1),
    "train.seed": _between(0, 2**32, high_open=True),
    "train.lr": _above(0),
    "train.min_lr_ratio": _between(0, 1),
    "train.warmup_steps": _at_least(0),
    "train.decay_fraction": _between(0, 1),
    "train.weight_decay": _at_least(0),
    "train.beta1": _between(0, 1, high_open=True),
    "train.beta2": _between(0, 1, high_open=True),
    "train.grad_clip": _at_least(0),
    "train.collective_timeout_minutes": _above(0),
    "train.straggler_margin": _at_least(0),
    "ckpt.interval_minutes": _at_least(0),
    "ckpt.mtbf_hours": _above(0),
    "ckpt.keep_last": _at_least(0),
    "ckpt.keep_best": _at_least(0),
    "ckpt.upload_nice": _between(0, 19),
    "train.eval_interval": _at_least(0),
    "train.eval_batches": _at_least(0),
    "data.num_proc": _at_least(0),
    "ckpt.timeout_minutes": _above(0),
    "ckpt.memory_interval": _at_least(0),
    "ckpt.memory_keep": _between(1, 2),
    "ckpt.memory_replicas": _at_least(0),
}


def _coerce(key: str, value, typ):
    """Return `value` as `typ` (bool/int/float/str), or raise ConfigError naming `key`."""
    if isinstance(value, str) and typ is not str:
        try:
            value = yaml.safe_load(value)  # "20" -> 20, "true" -> True, "1e-3" -> 0.001
        except yaml.YAMLError:
            pass
        if typ is float and isinstance(value, str):
            with contextlib.suppress(ValueError):
                value = float(value)  # YAML 1.1 reads "1e-3" as a string
    if typ is bool and isinstance(value, bool):
        return value
    if typ is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if typ is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if typ is str and isinstance(value, (str, int, float)) and not isinstance(value, bool):
        return str(value)
    raise ConfigError(f"config key '{key}' must be {typ.__name__}, got {value!r} ({type(value).__name__})")


def _apply(cfg: Config, key: str, value) -> None:
    parts = key.split(".")
    if len(parts) < 2:
        raise ConfigError(f"unknown config key '{key}' (keys look like section.name, e.g. train.max_steps)")
    sub = cfg
    for i, part in enumerate(parts[:-1]):  # model.lora.r walks into a nested section
        sub = getattr(sub, part, None)
        if sub is None or not dataclasses.is_dataclass(sub):
            raise ConfigError(f"unknown config key '{key}': no section '{'.'.join(parts[:i + 1])}'{_did_you_mean(key)}")
    name = parts[-1]
    hints = typing.get_type_hints(type(sub))
    if name not in hints or dataclasses.is_dataclass(getattr(sub, name)):
        raise ConfigError(f"unknown config key '{key}'{_did_you_mean(key)}")
    setattr(sub, name, _coerce(key, value, hints[name]))


def _fields(section, prefix: str = "") -> list[tuple[str, dataclasses.Field, type]]:
    """(key, field, type) of every config key under `section`, in the order of this file."""
    out, hints = [], typing.get_type_hints(section)
    for f in dataclasses.fields(section):
        if dataclasses.is_dataclass(hints[f.name]):
            out += _fields(hints[f.name], f"{prefix}{f.name}.")
        else:
            out.append((f"{prefix}{f.name}", f, hints[f.name]))
    return out


def _field_docs(section) -> dict[str, str]:
    """{field name: its one-line doc}: the comment after each field in this file's source."""
    docs = {}
    for line in inspect.getsource(section).splitlines():
        m = re.match(r"\s+(\w+): [^=]+=.*?  # (.*)$", line)
        if m:
            docs[m.group(1)] = m.group(2).strip()
    return docs


def all_keys() -> list[str]:
    return [key for key, _, _ in _fields(Config)]


def config_help() -> str:
    """`train_fsdp.py --help-config`: every key with its type, default and one-line doc, from the dataclasses."""
    lines, default = [], Config()
    for key, f, typ in _fields(Config):
        owner = _get(default, key.rsplit(".", 1)[0])
        doc = _field_docs(type(owner)).get(f.name, "")
        lines.append(f"{key} ({typ.__name__}, default {getattr(owner, f.name)!r}): {doc}")
    return "\n".join(lines)


def _did_you_mean(key: str) -> str:
    close = difflib.get_close_matches(key, all_keys(), n=1)
    return f"; did you mean '{close[0]}'?" if close else " (train_fsdp.py --help-config lists every key)"


def _get(cfg: Config, key: str):
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


def flatten(tree: dict, prefix: str = "") -> dict:
    flat = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            flat.update(flatten(v, key + "."))
        else:
            flat[key] = v
    return flat


# Paths that must be local (a URL there would otherwise become a local folder named `s3:`), and why ("": a URL
# of object storage is fine, docs/checkpoints.md).
_LOCAL_ONLY = {
    "run.dir": "metrics, logs and the exported model stay on a local or shared file system",
    "data.cache_dir": "the tokenized data cache is memory-mapped from a local or shared file system",
    "ckpt.dir": "",
    "ckpt.resume": "",
}


def _nested(a: str, b: str) -> bool:
    """Local folders `a` and `b` are one, or one holds the other (an object store's URL holds no local folder)."""
    if is_url(a) or is_url(b):
        return False
    a, b = os.path.realpath(a), os.path.realpath(b)
    return a == b or a.startswith(b.rstrip(os.sep) + os.sep) or b.startswith(a.rstrip(os.sep) + os.sep)


def validate(cfg: Config) -> None:
    for key, why in _LOCAL_ONLY.items():
        problem = unsupported(_get(cfg, key), f"config key '{key}'", local_only=why)
        if problem:
            raise ConfigError(problem)
    for key, allowed in _CHOICES.items():
        if _get(cfg, key) not in allowed:
            raise ConfigError(f"config key '{key}' must be one of {'|'.join(allowed)}, got {_get(cfg, key)!r}")
    for key, (ok, allowed) in _RANGES.items():
        value = _get(cfg, key)
        if not (math.isfinite(value) and ok(value)):
            raise ConfigError(f"config key '{key}' must be {allowed}, got {value!r}")
    try:
        parse_interval(cfg.ckpt.interval)
    except ValueError:
        raise ConfigError(f"config key 'ckpt.interval' must be a step count >= 0 or auto, "
                          f"got {cfg.ckpt.interval!r}") from None
    try:
        hang_s = parse_hang_timeout(cfg.train.hang_timeout)
    except ValueError:
        raise ConfigError(f"config key 'train.hang_timeout' must be seconds >= 0 (0: off) or auto, "
                          f"got {cfg.train.hang_timeout!r}") from None
    if hang_s and hang_s >= cfg.train.collective_timeout_minutes * 60:  # NCCL would abort first: no stacks, no 76
        raise ConfigError(f"config key 'train.hang_timeout={cfg.train.hang_timeout}' must be below "
                          f"train.collective_timeout_minutes ({cfg.train.collective_timeout_minutes:g} min = "
                          f"{cfg.train.collective_timeout_minutes * 60:g}s), or the collective timeout ends the job first")
    if cfg.ckpt.memory_dir and _nested(cfg.ckpt.memory_dir, cfg.ckpt.dir):
        raise ConfigError(f"config key 'ckpt.memory_dir={cfg.ckpt.memory_dir}' must be a folder apart from ckpt.dir "
                          f"({cfg.ckpt.dir}), neither inside it nor around it: the memory tier removes its step "
                          "folders when the run ends")
    if cfg.train.eval_interval and not cfg.data.eval_path:
        raise ConfigError("config key 'train.eval_interval' needs 'data.eval_path' (eval data)")
    if cfg.ckpt.keep_best and not cfg.train.eval_interval:
        raise ConfigError("config key 'ckpt.keep_best' needs 'train.eval_interval' > 0 (it ranks checkpoints by eval loss)")
    for key, package, wanted in (("run.tensorboard", "tensorboard", cfg.run.tensorboard),
                                 ("run.wandb", "wandb", cfg.run.wandb != "off")):
        if wanted and importlib.util.find_spec(package) is None:  # optional: only this run needs it
            raise ConfigError(f"config key '{key}' needs the {package} package, which is not installed: "
                              f"pip install {package} (version pinned in requirements.txt), or turn {key} off")
    validate_lora(cfg.model)


def validate_lora(model: ModelConfig) -> None:
    lora = model.lora
    if lora.quantize != "none":
        raise ConfigError(f"config key 'model.lora.quantize={lora.quantize}': QLoRA (a 4-bit quantized base) is "
                          "not supported: it needs bitsandbytes GPU kernels; use model.lora.quantize=none")
    if lora.r == 0:
        return
    if not lora.target_modules.strip():
        raise ConfigError("config key 'model.lora.target_modules' is empty (e.g. all-linear or q_proj,v_proj)")
    if not model.name_or_path:
        raise ConfigError(f"config key 'model.lora.r={lora.r}' needs model.name_or_path: LoRA adapts the weights "
                          "of a trained base model (a local HF folder), it does not start from random init")


def _read_yaml(path: str):
    try:
        with open(path, encoding="utf-8") as f:
            return yaml.safe_load(f) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        what = " ".join(str(x) for x in (getattr(e, "context", None), getattr(e, "problem", None)) if x) or str(e)
        raise ConfigError(f"config file {path} is not valid YAML{where}: {what}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read config file {path}: {e}") from None


def load_config(yaml_path: str | None, overrides: list[str] = ()) -> Config:
    """Defaults < YAML file < `key=value` overrides. Raises ConfigError on any bad key or value."""
    cfg = Config()
    if yaml_path:
        if not os.path.isfile(yaml_path):
            raise ConfigError(f"config file not found: {yaml_path}")
        tree = _read_yaml(yaml_path)
        if not isinstance(tree, dict):
            raise ConfigError(f"config file {yaml_path} must hold a mapping of sections")
        for key, value in flatten(tree).items():
            _apply(cfg, key, value)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override '{item}' must look like key=value")
        key, value = item.split("=", 1)
        _apply(cfg, key.strip(), value)
    if not cfg.ckpt.dir:
        cfg.ckpt.dir = os.path.join(cfg.run.dir, "checkpoints")
    if not cfg.data.cache_dir:
        cfg.data.cache_dir = os.path.join(cfg.run.dir, "data-cache")
    validate(cfg)
    return cfg


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def to_yaml(cfg: Config) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def config_hash(cfg: Config) -> str:
    """Hash of the resolved config, stored in each checkpoint's meta.json."""
    return hashlib.sha256(json.dumps(to_dict(cfg), sort_keys=True).encode()).hexdigest()[:16]

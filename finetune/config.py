"""The one typed config of a fine-tuning run: defaults < YAML preset < `key=value` overrides.

    python -c "from finetune.config import load_config; print(load_config('configs/tiny.yaml', ['train.max_steps=5']))"
    python -m pytest tests/test_config.py -q

Every field is declared once, beside its type and default, by `key(...)`: its one-line doc, its choices (from
the registry that implements them) or range, what a resume with another value does, whether it enters the
token-cache key (data fields) and whether it is part of the model identity. Validation, `--help-config`, the
resume rules (finetune/resume_rules.py, docs/resume-rules.md) and the cache key (finetune/data/cache.py) are
derived from these declarations; tests/test_config.py fails naming a field that leaves a decision out. Unknown
keys and wrong types raise `ConfigError` naming the key, before any process group exists.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import difflib
import importlib.util
import json
import math
import os
import typing
from dataclasses import dataclass, field

import yaml

from ckpt.manager import ASYNC_MODES
from ckpt.policy import parse_interval
from ckpt.storage import is_url, unsupported
from common.dtypes import DTYPES
from finetune.config_keys import TAKES_EFFECT, above, applies, at_least, between, key, parsed_by, refused
from finetune.data.sources import FORMATS
from finetune.hang import CAP_SHARE, parse_hang_timeout
from finetune.model import ATTN_IMPLEMENTATIONS
from finetune.optim import OPTIMIZERS
from finetune.schedule import SCHEDULES


class ConfigError(ValueError):
    """A config problem the user must fix; the message names the key."""


class ArgumentParser(argparse.ArgumentParser):
    """Command-line mistakes raise ConfigError, so they are reported like config mistakes: one `error:` line,
    once under torchrun (finetune/launch.py), instead of argparse's usage + error on every rank."""

    def error(self, message: str):
        raise ConfigError(f"{message} (python {self.prog} --help lists the arguments)")


# Resume effects several keys share.
_ANOTHER_DATA_SET = refused("the saved data position counts samples of another data set")
_ANOTHER_COLUMN = refused("samples would come from another column")
_OTHER_SAMPLES = refused("the saved data position counts other samples")
_NEW_SCHEDULE = applies("the LR schedule follows the new config from the resumed step on")
_IN_OPTIMIZER = applies("set in the restored optimizer")


# ---------------------------------------------------------------- the config

@dataclass
class RunConfig:
    dir: str = key("runs/tiny", "where metrics.jsonl, config.yaml, checkpoints/ and hf/ go", resume=TAKES_EFFECT)
    log_interval: int = key(10, "print one line every N optimizer steps (metrics.jsonl gets every step)",
                            range=at_least(1), resume=TAKES_EFFECT)
    progress_bar: bool = key(True, "tqdm bar on rank 0, only when stdout is a terminal", resume=TAKES_EFFECT)
    tensorboard: bool = key(False, "also write TensorBoard event files to <dir>/tensorboard (needs `tensorboard`)",
                            resume=TAKES_EFFECT)
    wandb: str = key("off", "also log to Weights & Biases, files in <dir>/wandb (needs `wandb`)",
                     choices=("off", "offline", "online"), resume=TAKES_EFFECT)
    wandb_project: str = key("fsdp-finetune", "W&B project name", resume=TAKES_EFFECT)


@dataclass
class LoRAConfig:
    r: int = key(0, "LoRA rank (peft); 0 = off: full fine-tuning. >0 freezes the base from name_or_path",
                 range=at_least(0), resume=refused("the saved adapters have another rank"))
    alpha: float = key(16.0, "LoRA scaling is alpha / r", range=above(0),
                       resume=refused("the saved adapters would be scaled otherwise (alpha / r)"))
    dropout: float = key(0.0, "dropout on the adapter's input (uses the per-rank RNG that checkpoints restore)",
                         range=between(0, 1, high_open=True), resume=TAKES_EFFECT)
    target_modules: str = key("all-linear", "q_proj,v_proj (module names), or all-linear: every block Linear, "
                              "not lm_head", resume=refused("other modules would carry the adapters"))
    quantize: str = key("none", "4bit: a 4-bit base (QLoRA) needs GPU kernels and is not supported",
                        choices=("none", "4bit"), resume=TAKES_EFFECT)


@dataclass
class ModelConfig:
    name_or_path: str = key("", "local HF model dir (config.json + safetensors + tokenizer), a Hub id (org/name), "
                            "or empty",
                            identity=True, resume=refused("the weights trained on are another model's"))
    config_path: str = key("assets/tiny-llama", "HF config dir or Hub id used when name_or_path is empty (random init)",
                           identity=True, resume=refused("the architecture trained is another one"))
    tokenizer_path: str = key("", "tokenizer dir or Hub id; empty = name_or_path, else config_path",
                              identity=True, resume=refused("token ids would mean other tokens"))
    revision: str = key("", "Hub branch, tag or commit of the Hub ids above (docs/hub.md); empty: the default branch",
                        resume=applies("compared by the commit it resolves to: another commit is refused "
                                       "(docs/hub.md)"))
    param_dtype: str = key("auto", "auto: bf16 on CUDA, fp32 on CPU", choices=("auto", "fp32", "bf16"),
                           resume=TAKES_EFFECT)
    reduce_dtype: str = key("fp32", "dtype of the gradient reduce-scatter", choices=("fp32", "bf16"),
                            resume=TAKES_EFFECT)
    attn_implementation: str = key("sdpa", "attention kernel; flash_attention_* need CUDA and flash_attn",
                                   choices=ATTN_IMPLEMENTATIONS,
                                   resume=TAKES_EFFECT)
    activation_checkpointing: bool = key(False, "recompute each decoder block in backward", resume=TAKES_EFFECT)
    compile: bool = key(False, "torch.compile each decoder block (inductor; a C++ compiler on CPU): "
                        "docs/performance.md", resume=TAKES_EFFECT)
    cpu_offload: bool = key(False, "FSDP2 CPUOffloadPolicy: params, grads and optimizer state on CPU",
                            resume=TAKES_EFFECT)
    init_std: float = key(0.02, "std of the normal init for random-init models", range=above(0),
                          resume=applies("no effect: the weights come from the checkpoint"))
    replicas: int = key(1, "HSDP when > 1: shard within groups of W/replicas ranks (a node), replicate across "
                        "groups", range=at_least(1), resume=TAKES_EFFECT)
    lora: LoRAConfig = field(default_factory=LoRAConfig)  # model.lora.*: adapters instead of full fine-tuning


@dataclass
class DataConfig:
    path: str = key("data/tiny/train.jsonl", "local jsonl/json/parquet/arrow/txt file(s) (comma separated), a "
                    "folder, or a hub name", cache="files", resume=_ANOTHER_DATA_SET)
    name: str = key("", "hub subset (config name) of data.path", cache="files", resume=_ANOTHER_DATA_SET)
    split: str = key("train", "split of data.path (hub name or a folder saved by `datasets`)", cache="files",
                     resume=_ANOTHER_DATA_SET)
    revision: str = key("", "hub revision (commit, tag or branch) of data.path", cache="files",
                        resume=_ANOTHER_DATA_SET)
    mixture: str = key("", "several sources with weights, 'path:weight; path:weight' (replaces data.path)",
                       cache="files", resume=_ANOTHER_DATA_SET)
    eval_path: str = key("", "eval data: file(s), folder, hub name, or 'split:<name>' of data.path; empty = no "
                         "eval", cache="files", resume=TAKES_EFFECT)
    format: str = key("auto", "auto: chat when a `messages` column exists; finetune/data/sources.py",
                      choices=FORMATS, cache=True, resume=refused("samples would be tokenized otherwise"))
    text_field: str = key("text", "column holding plain text", cache=True, resume=_ANOTHER_COLUMN)
    messages_field: str = key("messages", "column holding chat messages [{role, content}, ...]", cache=True,
                              resume=_ANOTHER_COLUMN)
    pack: bool = key(False, "concatenate documents into seq_len chunks (attention stays within each document)",
                     cache=False, resume=_OTHER_SAMPLES)
    truncation: bool = key(True, "unpacked documents longer than seq_len are cut; false: such a row is an error",
                           cache=False, resume=TAKES_EFFECT)
    seq_len: int = key(64, "tokens per sample", range=at_least(2), cache=False,  # the loss needs a next token
                       resume=_OTHER_SAMPLES)
    global_batch_size: int = key(16, "samples per optimizer step, summed over all ranks", range=at_least(1),
                                 cache=False,
                                 resume=refused("steps, the schedule and the data position count other batches"))
    micro_batch_size: int = key(8, "cap on samples per forward on one rank: lowered to a divisor of the per-rank "
                                "batch", range=at_least(1), cache=False, resume=TAKES_EFFECT)
    epochs: int = key(1, "passes over the data; training ends when they run out, even before max_steps",
                      range=at_least(1), cache=False, resume=TAKES_EFFECT)
    cache_dir: str = key("", "tokenized data, keyed by a hash of its inputs; default <run.dir>/data-cache "
                         "(shared FS)", cache=False, resume=TAKES_EFFECT)
    num_proc: int = key(0, "tokenizer processes on rank 0; 0 = the CPU cores available to it", range=at_least(0),
                        cache=False, resume=TAKES_EFFECT)


@dataclass
class TrainConfig:
    max_steps: int = key(100, "optimizer steps", range=at_least(1), resume=_NEW_SCHEDULE)
    seed: int = key(1234, "model init, data order and dropout all derive from it", range=between(0, 2**32, True),
                    resume=refused("the saved data position is only meaningful in the order made with its seed",
                                   then="the data order continues with the checkpoint's seed"))
    lr: float = key(1e-3, "peak learning rate", range=above(0), resume=_NEW_SCHEDULE)
    lr_schedule: str = key("cosine", "wsd: warmup-stable-decay; finetune/schedule.py", choices=SCHEDULES,
                           resume=_NEW_SCHEDULE)
    min_lr_ratio: float = key(0.1, "the schedule ends at lr * min_lr_ratio", range=between(0, 1),
                              resume=_NEW_SCHEDULE)
    warmup_steps: int = key(10, "linear warmup from 0", range=at_least(0), resume=_NEW_SCHEDULE)
    decay_fraction: float = key(0.2, "wsd: the last fraction of max_steps that decays linearly to lr * "
                                "min_lr_ratio", range=between(0, 1), resume=_NEW_SCHEDULE)
    optimizer: str = key("adamw", "sgd: momentum beta1, half AdamW's state; finetune/optim.py", choices=OPTIMIZERS,
                         resume=refused("the saved optimizer state is another optimizer's (finetune/optim.py)",
                                        then="then refused by check_same_optimizer: it holds no state of the new "
                                             "optimizer"))
    weight_decay: float = key(0.01, "weight decay: decoupled (adamw), L2 in the gradient (sgd)", range=at_least(0),
                              resume=_IN_OPTIMIZER)
    beta1: float = key(0.9, "adamw's first-moment decay; sgd's momentum", range=between(0, 1, True),
                       resume=_IN_OPTIMIZER)
    beta2: float = key(0.95, "adamw's second-moment decay (sgd: unused)", range=between(0, 1, True),
                       resume=_IN_OPTIMIZER)
    grad_clip: float = key(1.0, "max global grad norm; 0 disables clipping", range=at_least(0), resume=TAKES_EFFECT)
    collective_timeout_minutes: float = key(10.0, "a training collective waiting longer ends the job (a rank "
                                            "stuck or dead)", range=above(0), resume=TAKES_EFFECT)
    hang_timeout: str = key("auto", "s a step may last before exit 76 naming the stuck rank; auto; 0: off "
                            "(finetune/hang.py)", range=parsed_by(parse_hang_timeout, "seconds >= 0 (0: off) or auto"),
                            resume=TAKES_EFFECT)
    straggler_margin: float = key(0.2, "log a rank computing this fraction over the mean 3 log intervals running "
                                  "(0: off)", range=at_least(0), resume=TAKES_EFFECT)
    deterministic: bool = key(False, "torch.use_deterministic_algorithms: bit-identical reruns on GPU, a little "
                              "slower", resume=TAKES_EFFECT)
    reduce_every_micro_batch: bool = key(True, "false: one reduce-scatter per step, unsharded grads between "
                                         "(small models)", resume=TAKES_EFFECT)
    eval_interval: int = key(0, "eval loss on data.eval_path every N optimizer steps and at the end (0 = off)",
                             range=at_least(0), resume=TAKES_EFFECT)
    eval_batches: int = key(0, "global batches of the eval set per evaluation (0 = all of it)", range=at_least(0),
                            resume=TAKES_EFFECT)
    sample_at_end: bool = key(True, "greedy-generate from sample_prompts at the end (rank 0 prints)",
                              resume=TAKES_EFFECT)
    sample_prompts: str = key("", "prompts separated by '|', sent as a user turn when the tokenizer has a chat "
                              "template", resume=TAKES_EFFECT)


@dataclass
class CkptConfig:
    dir: str = key("", "default <run.dir>/checkpoints", resume=TAKES_EFFECT)
    interval: str = key("50", "save every N optimizer steps (0: none), or auto: Young/Daly sqrt(2 x save cost x "
                        "MTBF)", range=parsed_by(parse_interval, "a step count >= 0 or auto"), resume=TAKES_EFFECT)
    interval_minutes: float = key(0.0, "also save once this many minutes of wall clock passed since the last save "
                                  "(0: off)", range=at_least(0), resume=TAKES_EFFECT)
    mtbf_hours: float = key(24.0, "the job's mean time between failures, for interval=auto", range=above(0),
                            resume=TAKES_EFFECT)
    async_mode: str = key("process", "off: each save blocks; else in the background (process: sooner "
                          "commits at 0.5B; docs/performance.md)", choices=ASYNC_MODES, resume=TAKES_EFFECT)
    upload_nice: int = key(19, "niceness of async uploads and memory-tier copies: higher slows steps less, "
                           "commits later", range=between(0, 19), resume=TAKES_EFFECT)
    keep_last: int = key(3, "keep the newest k committed checkpoints (0 keeps all)", range=at_least(0),
                         resume=TAKES_EFFECT)
    keep_best: int = key(0, "also keep the k checkpoints with the lowest eval loss (needs train.eval_interval)",
                         range=at_least(0), resume=TAKES_EFFECT)
    resume: str = key("auto", "auto (newest committed) | none | <path to a step-NNNNNN dir>", resume=TAKES_EFFECT)
    save_at_end: bool = key(True, "synchronous final save at max_steps / end of data / exception",
                            resume=TAKES_EFFECT)
    continue_on_save_error: bool = key(False, "log a failed periodic save and keep training", resume=TAKES_EFFECT)
    unchecked_store: bool = key(False, "run on an object store that ignores create-only/compare-and-swap, at your "
                                "own risk", resume=TAKES_EFFECT)
    timeout_minutes: float = key(30.0, "checkpoint collectives (save, load) wait this long for a rank",
                                 range=above(0), resume=TAKES_EFFECT)
    resume_config_check: str = key("refuse", "what a resume with changed model/data/seed/batch does "
                                   "(docs/resume-rules.md)", choices=("refuse", "warn"), resume=TAKES_EFFECT)
    memory_interval: int = key(0, "also save to node-local memory every N steps (0: off; docs/memory-tier.md)",
                               range=at_least(0), resume=TAKES_EFFECT)
    memory_dir: str = key("", "default /dev/shm/fsdp-ckpt-<hash of ckpt.dir>-<user>; or node-local NVMe",
                          resume=TAKES_EFFECT)
    memory_keep: int = key(1, "keep the newest 1 or 2 memory steps", range=between(1, 2), resume=TAKES_EFFECT)
    memory_replicas: int = key(1, "copies of each node's memory steps on the next nodes (several nodes; ring by "
                               "node)", range=at_least(0), resume=TAKES_EFFECT)


@dataclass
class ExportConfig:
    at_end: bool = key(False, "write a HF model folder to <run.dir>/hf after training", resume=TAKES_EFFECT)
    dtype: str = key("auto", "auto: the source model's torch_dtype, fp32 for random init", choices=("auto", *DTYPES),
                     resume=TAKES_EFFECT)


_PLAN_ONLY = applies("no effect on a run: --plan reads it")


@dataclass
class PlanConfig:
    nodes: int = key(1, "nodes this config is meant for: what --plan plans (--nodes overrides)", range=at_least(1),
                     resume=_PLAN_ONLY)
    gpus_per_node: int = key(8, "GPUs (or ranks) per node this config is meant for (--gpus-per-node overrides)",
                             range=at_least(1), resume=_PLAN_ONLY)
    gpu_memory: float = key(0.0, "GiB per GPU: --plan exits 1 when the plan needs more (0: not checked; "
                            "--gpu-memory overrides)", range=at_least(0), resume=_PLAN_ONLY)
    cpu: bool = key(False, "the ranks are CPU processes (gloo): --plan plans their memory (--cpu)", resume=_PLAN_ONLY)


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    ckpt: CkptConfig = field(default_factory=CkptConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)  # the hardware --plan plans for (no effect on a run)


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


def all_keys() -> list[str]:
    return [key for key, _, _ in _fields(Config)]


def declarations(config_class: type = Config) -> dict[str, typing.Mapping]:
    """{key: its declaration (doc, choices, range, resume, cache, identity: see `key`)} of every key, in file order."""
    return {key: f.metadata for key, f, _ in _fields(config_class)}


def identity_keys() -> tuple[str, ...]:
    """The keys naming a model folder that each checkpoint records by content (finetune/model_identity.py)."""
    return tuple(k for k, d in declarations().items() if d.get("identity"))


def config_help() -> str:
    """`train_fsdp.py --help-config`: every key with its type, default, one-line doc and choices, from `key`."""
    lines, default = [], Config()
    for key, f, typ in _fields(Config):
        choices = "|".join(f.metadata.get("choices", ()))
        kind = f"{typ.__name__}: {choices}" if choices else typ.__name__
        lines.append(f"{key} ({kind}, default {_get(default, key)!r}): {f.metadata.get('doc', '')}")
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
    for key, f, _ in _fields(Config):
        value, choices, limits = _get(cfg, key), f.metadata.get("choices"), f.metadata.get("range")
        if choices and value not in choices:
            raise ConfigError(f"config key '{key}' must be one of {'|'.join(choices)}, got {value!r}")
        if limits and not ((isinstance(value, str) or math.isfinite(value)) and limits[0](value)):
            raise ConfigError(f"config key '{key}' must be {limits[1]}, got {value!r}")
    hang_s = parse_hang_timeout(cfg.train.hang_timeout)  # its declaration's range has accepted it
    most_s = CAP_SHARE * cfg.train.collective_timeout_minutes * 60  # what auto is held to: the verdict needs time
    if hang_s and hang_s > most_s:  # NCCL's watchdog, counting from the same moment, would abort first: no 76
        raise ConfigError(f"config key 'train.hang_timeout={cfg.train.hang_timeout}' must be at most {most_s:g}s, "
                          f"{CAP_SHARE:g} x train.collective_timeout_minutes ({cfg.train.collective_timeout_minutes:g} "
                          f"min = {cfg.train.collective_timeout_minutes * 60:g}s), or the collective timeout ends the "
                          "job before the hang is named")
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
                          "of a trained base model (a local HF folder or a Hub id), it does not start from random init")


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

"""What the trainer's checkpoints hold: the Statefuls under their keys, the schema that tells ckpt/'s readers
(inspect, reshard, export) about those keys, and the small files beside the shards (meta.json, config.yaml).

    python -m pytest tests/test_ckpt_resume.py tests/test_world_size.py -q

One place for the trainer's key strings: checkpoint_state and checkpoint_schema are built from the same
constants, and ckpt/ reads the schema from each checkpoint's meta.json instead of knowing them. A new
Stateful or a renamed key is changed here; nothing in ckpt/ changes.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, fields
from typing import ClassVar

import torch

from ckpt import CheckpointSchema, ModelOptimizer, RNGState, rng_key
from finetune.config import Config, config_hash, to_yaml
from finetune.data import BATCH_KEY
from finetune.lora import lora_meta
from finetune.model_identity import model_content, model_files
from finetune.optim import optimizer_kind

# checkpoint_state's keys. checkpoint_schema derives from them every key ckpt/'s readers need (recorded in meta.json);
# "app" and "progress" are the names existing checkpoints were saved under.
MODEL_OPTIM, SCHEDULER, PROGRESS, DATA = "app", "scheduler", "progress", "data"


@dataclass
class TrainProgress:
    """The small explicit dict of training progress (the data position lives in BatchStream). Every field is saved.
    A new field: add it here with its default, and its name to ADDED_LATER, so checkpoints written before it resume
    with that default (ckpt/state.py fit_to_checkpoint logs it). Removing or renaming a field makes those checkpoints
    refuse to resume, by name."""
    step: int = 0
    tokens: int = 0
    loss_tokens: int = 0
    ADDED_LATER: ClassVar[tuple[str, ...]] = ()  # fields older checkpoints may lack

    def fields_added_later(self) -> dict:
        return {f.name: f.default for f in fields(self) if f.name in self.ADDED_LATER}

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for f in fields(self):  # DCP may hand back a tensor or numpy scalar: keep the field's own type
            setattr(self, f.name, type(f.default)(state[f.name]))


def checkpoint_state(model, optimizer, scheduler, progress, stream, rank: int, with_rng: bool) -> dict:
    state = {MODEL_OPTIM: ModelOptimizer(model, optimizer), SCHEDULER: scheduler, PROGRESS: progress, DATA: stream}
    if with_rng:
        state[rng_key(rank)] = RNGState()
    return state


def model_state(state: dict) -> dict:
    """The model's part of checkpoint_state, the keys a resume checks under the schema's model_prefix."""
    return state[MODEL_OPTIM].state_dict()[ModelOptimizer.MODEL]


def checkpoint_schema(cfg: Config) -> CheckpointSchema:
    """What checkpoint_state saves, under which keys, for ckpt/'s readers (inspect, reshard, export)."""
    model = cfg.model.name_or_path or cfg.model.config_path
    return CheckpointSchema(model_prefix=f"{MODEL_OPTIM}.{ModelOptimizer.MODEL}.",
                            optim_prefix=f"{MODEL_OPTIM}.{ModelOptimizer.OPTIM}.",
                            train_state_keys=(f"{PROGRESS}.", f"{DATA}.", f"{SCHEDULER}.last_epoch",
                                              f"{SCHEDULER}._last_lr"),  # LambdaLR's state_dict keys
                            step_key=f"{PROGRESS}.step", position_key=f"{DATA}.position",  # TrainProgress, BatchStream
                            divides={BATCH_KEY: cfg.data.global_batch_size}, model_dir=model,
                            tokenizer_dir=cfg.model.tokenizer_path or model, pretrained=bool(cfg.model.name_or_path),
                            optimizer=cfg.train.optimizer, optimizer_state_bytes=optimizer_kind(cfg.train).state_bytes)


def checkpoint_files(cfg: Config, step: int, world_size: int, eval_loss: float | None = None) -> dict[str, str]:
    import transformers
    meta = {"step": step, "world_size": world_size, "torch": torch.__version__,
            "transformers": transformers.__version__, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "config_hash": config_hash(cfg), "model": cfg.model.name_or_path or cfg.model.config_path,
            "seed": cfg.train.seed, "schema": checkpoint_schema(cfg).to_meta(),
            "model_content": model_content(cfg.model),  # a resume from a moved copy compares these, not paths
            "model_files": model_files(cfg.model)}  # and names what differs when they do not match
    if eval_loss is not None:
        meta["score"] = eval_loss  # lower is better: ckpt.keep_best keeps the lowest (the eval loss of this step)
    if cfg.model.lora.r:
        meta["lora"] = lora_meta(cfg.model)  # base folder + fingerprint: a resume on another base is refused
    return {"meta.json": json.dumps(meta, indent=1) + "\n", "config.yaml": to_yaml(cfg)}

"""What a trainer's checkpoint holds, as the trainer tells it: key prefixes, train-state keys, the values the
world size must divide, and where the model came from. Recorded in meta.json, so `inspect`, `reshard` and
`export` read it from the checkpoint instead of knowing the trainer's strings.

    python -m pytest tests/test_ckpt_loop.py tests/test_world_size.py tests/test_hf.py -q

The trainer builds one (finetune/checkpoint_contents.py `checkpoint_schema`, from the same keys as its
`checkpoint_state`) and writes `schema.to_meta()` into every meta.json; every field is the trainer's to
give, none has a default here. `schema_of(path)` reads it back. A checkpoint written before meta.json carried a schema gets
`schema_of_checkpoint_without_schema`: the one place that knows the old trainer's layout; one written before
the schema named its optimizer gets OLDER_OPTIMIZER (AdamW was the only one then).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import yaml

from .layout import read_meta, read_saved_config


@dataclass(frozen=True)
class CheckpointSchema:
    model_prefix: str  # the model's state dict, under the Stateful key the trainer chose
    optim_prefix: str  # the optimizer's state dict
    train_state_keys: tuple[str, ...]  # prefixes of the small train-state items `inspect` prints
    step_key: str  # finished optimizer steps
    position_key: str  # the data stream's global sample index
    divides: dict[str, int]  # config key -> value the world size must divide
    model_dir: str  # the model folder trained from (config.json; weights when `pretrained`)
    tokenizer_dir: str
    pretrained: bool  # training started from model_dir's weights (export dtype auto follows them)
    optimizer: str  # whose state is under optim_prefix (the trainer's name for it)
    optimizer_state_bytes: int  # its state per trained fp32 parameter (`inspect` compares a LoRA checkpoint's size)

    def to_meta(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_meta(d: dict) -> "CheckpointSchema":
        d = {**OLDER_OPTIMIZER, **d}
        d["train_state_keys"] = tuple(d.get("train_state_keys", ()))
        return CheckpointSchema(**d)


# Every checkpoint written before the schema named its optimizer holds AdamW's state (exp_avg, exp_avg_sq: 8 bytes).
OLDER_OPTIMIZER = {"optimizer": "adamw", "optimizer_state_bytes": 8}


def schema_of(path: str) -> CheckpointSchema:
    """The schema recorded in `path`'s meta.json; for an older checkpoint, the layout it was written with."""
    meta = read_meta(path, missing_ok=True)
    if "schema" in meta:
        return CheckpointSchema.from_meta(meta["schema"])
    return schema_of_checkpoint_without_schema(path, meta)


def schema_of_checkpoint_without_schema(path: str, meta: dict) -> CheckpointSchema:
    """Checkpoints written before meta.json carried a schema (or assembled by hand): train_fsdp.py's keys of
    that time, frozen here, and the batch size and model folders read from the checkpoint's config.yaml.
    Deliberately the only code in ckpt/ that knows a trainer's strings; it never follows the trainer's changes,
    because every newer checkpoint carries its own schema."""
    try:
        cfg = yaml.safe_load(read_saved_config(path) or "") or {}
    except (OSError, yaml.YAMLError):
        cfg = {}
    model = cfg.get("model") or {}
    batch = (cfg.get("data") or {}).get("global_batch_size")
    named = model.get("name_or_path") or model.get("config_path") or meta.get("model", "")
    return CheckpointSchema(model_prefix="app.model.", optim_prefix="app.optim.",
                            train_state_keys=("progress.", "data.", "scheduler.last_epoch", "scheduler._last_lr"),
                            step_key="progress.step", position_key="data.position",
                            divides={"data.global_batch_size": int(batch)} if isinstance(batch, int) else {},
                            model_dir=named, tokenizer_dir=model.get("tokenizer_path") or named,
                            pretrained=bool(model.get("name_or_path")), **OLDER_OPTIMIZER)

"""What a trainer's checkpoint holds, as the trainer tells it: key prefixes, train-state keys, the values the
world size must divide, and where the model came from. Recorded in meta.json, so `inspect`, `reshard` and
`export` read it from the checkpoint instead of knowing the trainer's strings.

    python -m pytest tests/test_world_size.py tests/test_hf.py -q

train_fsdp.py builds one (`checkpoint_schema`) and writes `schema.to_meta()` into every meta.json.
`schema_of(path)` reads it back; for a checkpoint without one (written before meta.json carried it, or
assembled by hand) it derives the same fields from config.yaml and meta.json: the one place that knows
that older layout.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field

import yaml

from .layout import CONFIG_FILE, read_meta


@dataclass(frozen=True)
class CheckpointSchema:
    model_prefix: str = "app.model."  # the model's state dict, under the Stateful key the trainer chose
    optim_prefix: str = "app.optim."  # the optimizer's state dict
    train_state_keys: tuple[str, ...] = ("progress.", "data.", "scheduler.last_epoch", "scheduler._last_lr")
    step_key: str = "progress.step"  # finished optimizer steps
    position_key: str = "data.position"  # the data stream's global sample index
    divides: dict[str, int] = field(default_factory=dict)  # config key -> value the world size must divide
    model_dir: str = ""  # the model folder trained from (config.json; weights when `pretrained`)
    tokenizer_dir: str = ""
    pretrained: bool = False  # training started from model_dir's weights (export dtype auto follows them)

    def to_meta(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_meta(d: dict) -> "CheckpointSchema":
        d = dict(d)
        d["train_state_keys"] = tuple(d.get("train_state_keys", ()))
        return CheckpointSchema(**d)


def schema_of(path: str) -> CheckpointSchema:
    """The schema recorded in `path`'s meta.json, or one derived from its config.yaml for older checkpoints."""
    meta = read_meta(path, missing_ok=True)
    if "schema" in meta:
        return CheckpointSchema.from_meta(meta["schema"])
    try:
        with open(os.path.join(path, CONFIG_FILE)) as f:
            cfg = yaml.safe_load(f) or {}
    except (OSError, yaml.YAMLError):
        cfg = {}
    model = cfg.get("model") or {}
    batch = (cfg.get("data") or {}).get("global_batch_size")
    named = model.get("name_or_path") or model.get("config_path") or meta.get("model", "")
    return CheckpointSchema(divides={"data.global_batch_size": int(batch)} if isinstance(batch, int) else {},
                            model_dir=named, tokenizer_dir=model.get("tokenizer_path") or named,
                            pretrained=bool(model.get("name_or_path")))

"""Which config changes a resume refuses, warns about or applies: the checkpoint's config.yaml against this run's.

    python -m pytest tests/test_resume_config.py -q

The rules (docs/resume-rules.md): a change in RESUME_REFUSED makes the continuation meaningless (another model,
tokenizer, data set, data order or batch) and is refused unless ckpt.resume_config_check=warn; every other field
takes effect as the new config says, with what that means where it is more than that (_RESUME_EFFECT). A model
folder that moved but kept its content is no change (finetune/model_identity.py says whether it did, and what
changed when it did not); a Hub id that resolves to another commit than the checkpoint's is refused like a change of
its key (finetune/model_files.py).
"""

from __future__ import annotations

import os
import typing
from dataclasses import dataclass

import yaml

from finetune.config import Config, ConfigError, flatten, to_dict

# Changes that make a continuation meaningless: refused on resume unless ckpt.resume_config_check=warn.
# Every other field takes effect as the new config says (docs/resume-rules.md).
RESUME_REFUSED = {
    "model.name_or_path": "the weights trained on are another model's",
    "model.config_path": "the architecture trained is another one",
    "model.tokenizer_path": "token ids would mean other tokens",
    "model.lora.r": "the saved adapters have another rank",
    "model.lora.alpha": "the saved adapters would be scaled otherwise (alpha / r)",
    "model.lora.target_modules": "other modules would carry the adapters",
    "data.path": "the saved data position counts samples of another data set",
    "data.name": "the saved data position counts samples of another data set",
    "data.split": "the saved data position counts samples of another data set",
    "data.revision": "the saved data position counts samples of another data set",
    "data.mixture": "the saved data position counts samples of another data set",
    "data.format": "samples would be tokenized otherwise",
    "data.text_field": "samples would come from another column",
    "data.messages_field": "samples would come from another column",
    "data.pack": "the saved data position counts other samples",
    "data.seq_len": "the saved data position counts other samples",
    "data.global_batch_size": "steps, the schedule and the data position count other batches",
    "train.seed": "the saved data position is only meaningful in the order made with its seed",
}
_MOVABLE = ("model.name_or_path", "model.config_path", "model.tokenizer_path")  # compared by content if moved
_RESUME_EFFECT = {  # what applying a change means, where it is more than "takes effect"
    "train.lr": "the LR schedule follows the new config from the resumed step on",
    "train.min_lr_ratio": "the LR schedule follows the new config from the resumed step on",
    "train.warmup_steps": "the LR schedule follows the new config from the resumed step on",
    "train.lr_schedule": "the LR schedule follows the new config from the resumed step on",
    "train.decay_fraction": "the LR schedule follows the new config from the resumed step on",
    "train.max_steps": "the LR schedule follows the new config from the resumed step on",
    "train.weight_decay": "set in the restored optimizer",
    "train.beta1": "set in the restored optimizer",
    "train.beta2": "set in the restored optimizer",
    "train.seed": "the data order continues with the checkpoint's seed",
    "model.init_std": "no effect: the weights come from the checkpoint",
    "model.revision": "compared by the commit it resolves to: another commit is refused (the Hub id's line)",
    "plan.nodes": "no effect on a run: --plan reads it",
    "plan.gpus_per_node": "no effect on a run: --plan reads it",
    "plan.gpu_memory": "no effect on a run: --plan reads it",
    "plan.cpu": "no effect on a run: --plan reads it",
}
HUB_COMMIT_CHANGED = "the Hub id resolves to another commit than the checkpoint trained on (other files)"


@dataclass
class ConfigChange:
    key: str
    saved: object
    current: object
    verdict: str  # refused | warned (refused, but ckpt.resume_config_check=warn) | applied
    why: str  # why refused, or what applying it means

    def line(self) -> str:
        return f"{self.key}: {self.saved!r} -> {self.current!r} ({self.verdict}: {self.why})"


def _same(key: str, a, b) -> bool:
    """Equal values; paths are equal when they name the same files from here."""
    if a == b:
        return True
    if key in ("model.name_or_path", "model.config_path", "model.tokenizer_path", "data.path") and \
            isinstance(a, str) and isinstance(b, str):
        def norm(v):
            return [os.path.realpath(p.strip()) for p in v.split(",") if p.strip()]
        return norm(a) == norm(b)
    return False


def resume_changes(saved_yaml: str, cfg: Config,
                   content_change: typing.Callable[[str, str], str | None] | None = None,
                   moved_commits: typing.Iterable[tuple[str, str, str]] = ()) -> list[ConfigChange]:
    """Every field whose value differs between a checkpoint's config.yaml and `cfg`, with its rule.
    Fields that only one side knows (another version of this file) are not compared. A model folder key whose
    path changed but whose content is the same (`content_change(key, saved path)` is None,
    finetune/model_identity.py) is applied, not refused: the model moved, it did not change. Otherwise what
    content_change names (config.json fields, the weights' fingerprint) is added to the reason. `moved_commits`:
    (key, the checkpoint's id@commit, this run's) of a Hub id that resolves to another commit now
    (finetune/model_files.py hub_commit_changes), refused as a change of that key."""
    try:
        saved = flatten(yaml.safe_load(saved_yaml) or {})
    except (yaml.YAMLError, AttributeError) as e:
        raise ConfigError(f"the checkpoint's config.yaml cannot be read: {e}") from None
    changes = []
    for key, current in flatten(to_dict(cfg)).items():
        if key not in saved or _same(key, saved[key], current):
            continue
        differs = content_change(key, saved[key]) if key in _MOVABLE and content_change is not None else ""
        refusal = RESUME_REFUSED.get(key, "") + (f" ({differs})" if differs else "")
        if key not in RESUME_REFUSED:
            verdict, why = "applied", _RESUME_EFFECT.get(key, "takes effect")
        elif differs is None:
            verdict, why = "applied", "the same files at another path (their fingerprints match the checkpoint's)"
        elif cfg.ckpt.resume_config_check == "refuse":
            verdict, why = "refused", refusal
        else:
            verdict, why = "warned", f"{refusal}; {_RESUME_EFFECT.get(key, 'takes effect')}"
        changes.append(ConfigChange(key, saved[key], current, verdict, why))
    for key, saved_commit, commit in moved_commits:
        warned = cfg.ckpt.resume_config_check == "warn"
        changes.append(ConfigChange(key, saved_commit, commit, "warned" if warned else "refused",
                                    f"{HUB_COMMIT_CHANGED}; takes effect" if warned else HUB_COMMIT_CHANGED))
    return changes

"""Which config changes a resume refuses, warns about or applies: the checkpoint's config.yaml against this run's.

    python -m pytest tests/test_resume_config.py -q
    python -m finetune.resume_rules > /tmp/rules.md   # the per-field table of docs/resume-rules.md

Each key declares its rule beside its field (finetune/config.py, `resume=`): refused, when a change makes the
continuation meaningless (another model, tokenizer, data set, data order or batch), unless
ckpt.resume_config_check=warn lets it through (then "warned", and what then happens); or applied, with what
taking effect means where it is more than that. RESUME_REFUSED and the docs table are read from those
declarations. A model folder that moved but kept its content is no change (finetune/model_identity.py says
whether it did, and what changed when it did not).
"""

from __future__ import annotations

import argparse
import os
import typing
from dataclasses import dataclass

import yaml

from finetune.config import Config, ConfigError, declarations, flatten, identity_keys, to_dict
from finetune.config_keys import TAKES_EFFECT, Resume, refused

RULES: dict[str, Resume] = {k: d["resume"] for k, d in declarations().items() if d.get("resume")}
# A key whose declaration leaves its rule out (tests/test_config.py names it) is refused rather than applied.
_UNDECLARED = refused("its resume rule is not declared (finetune/config.py key(resume=...))")
RESUME_REFUSED = {k: rule.why for k, rule in RULES.items() if rule.verdict == "refused"}
_MOVABLE = identity_keys()  # model folders, compared by content when their path changed


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
    if key in (*_MOVABLE, "data.path") and \
            isinstance(a, str) and isinstance(b, str):
        def norm(v):
            return [os.path.realpath(p.strip()) for p in v.split(",") if p.strip()]
        return norm(a) == norm(b)
    return False


def resume_changes(saved_yaml: str, cfg: Config,
                   content_change: typing.Callable[[str, str], str | None] | None = None) -> list[ConfigChange]:
    """Every field whose value differs between a checkpoint's config.yaml and `cfg`, with its rule.
    Fields that only one side knows (another version of this file) are not compared. A model folder key whose
    path changed but whose content is the same (`content_change(key, saved path)` is None,
    finetune/model_identity.py) is applied, not refused: the model moved, it did not change. Otherwise what
    content_change names (config.json fields, the weights' fingerprint) is added to the reason."""
    try:
        saved = flatten(yaml.safe_load(saved_yaml) or {})
    except (yaml.YAMLError, AttributeError) as e:
        raise ConfigError(f"the checkpoint's config.yaml cannot be read: {e}") from None
    changes = []
    for key, current in flatten(to_dict(cfg)).items():
        if key not in saved or _same(key, saved[key], current):
            continue
        rule = RULES.get(key, _UNDECLARED)
        differs = content_change(key, saved[key]) if key in _MOVABLE and content_change is not None else ""
        refusal = rule.why + (f" ({differs})" if differs else "")
        if rule.verdict != "refused":
            verdict, why = "applied", rule.why
        elif differs is None:
            verdict, why = "applied", "the same files at another path (their fingerprints match the checkpoint's)"
        elif cfg.ckpt.resume_config_check == "refuse":
            verdict, why = "refused", refusal
        else:
            verdict, why = "warned", f"{refusal}; {rule.then}"
        changes.append(ConfigChange(key, saved[key], current, verdict, why))
    return changes


def rules_table() -> str:
    """docs/resume-rules.md's table of the rule per key, from the declarations: keys sharing a rule share a row.
    tests/test_resume_config.py checks that the doc holds it."""
    rows: dict[Resume, list[str]] = {}
    for k, rule in RULES.items():
        rows.setdefault(rule, []).append(f"`{k}`")
    lines = ["| key | on change | why | with ckpt.resume_config_check=warn |", "|---|---|---|---|"]
    for rule, keys in sorted(rows.items(), key=lambda row: (row[0].verdict != "refused", row[0] == TAKES_EFFECT)):
        warned = f"warned; {rule.then}" if rule.verdict == "refused" else "applied"
        lines.append(f"| {', '.join(keys)} | {rule.verdict} | {rule.why} | {warned} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(prog="python -m finetune.resume_rules",
                            description="Print the table of what a resume does with each changed config key "
                                        "(docs/resume-rules.md), from the declarations in finetune/config.py."
                            ).parse_args(argv)
    print(rules_table())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Which config changes a resume refuses, warns about or applies: the checkpoint's config.yaml against this run's.

    python -m pytest tests/test_resume_config.py -q
    python -m finetune.resume_rules --write docs/resume-rules.md   # its per-field table, from the declarations

Each key declares its rule beside its field (finetune/config.py, `resume=`): refused, when a change makes the
continuation meaningless (another model, tokenizer, data set, data order or batch), unless
ckpt.resume_config_check=warn lets it through (then "warned", and what then happens); or applied, with what
taking effect means where it is more than that. RESUME_REFUSED and the docs table are read from those
declarations. A model folder that moved but kept its content is no change (finetune/model_identity.py says
whether it did, and what changed when it did not); a Hub id that resolves to another commit than the
checkpoint's is refused like a change of its key (finetune/model_files.py). Another optimizer is refused even
with warn (check_same_optimizer: the checkpoint's schema names the optimizer its state belongs to).
"""

from __future__ import annotations

import argparse
import os
import typing
from dataclasses import dataclass

import yaml

from ckpt.schema import schema_of
from finetune.config import Config, ConfigError, declarations, flatten, identity_keys, to_dict
from finetune.config_keys import TAKES_EFFECT, Resume, refused

RULES: dict[str, Resume] = {k: d["resume"] for k, d in declarations().items() if d.get("resume")}
# A key whose declaration leaves its rule out (tests/test_config.py names it) is refused rather than applied.
_UNDECLARED = refused("its resume rule is not declared (finetune/config.py key(resume=...))")
RESUME_REFUSED = {k: rule.why for k, rule in RULES.items() if rule.verdict == "refused"}
_MOVABLE = identity_keys()  # model folders, compared by content when their path changed
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
    if key in (*_MOVABLE, "data.path") and \
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
    for key, saved_commit, commit in moved_commits:
        warned = cfg.ckpt.resume_config_check == "warn"
        changes.append(ConfigChange(key, saved_commit, commit, "warned" if warned else "refused",
                                    f"{HUB_COMMIT_CHANGED}; {RULES[key].then}" if warned else HUB_COMMIT_CHANGED))
    return changes


def check_same_optimizer(path: str, cfg: Config) -> None:
    """The optimizer state in `path` (its meta.json schema names the optimizer; AdamW's for a checkpoint older
    than train.optimizer) loads only into the optimizer that wrote it: another is refused in one line naming
    both, also with ckpt.resume_config_check=warn (the load could only fail on the missing state) and for a
    config.yaml that predates the key (then resume_changes does not compare it)."""
    saved = schema_of(path).optimizer
    if saved != cfg.train.optimizer:
        raise ConfigError(f"resuming {path} with train.optimizer={cfg.train.optimizer}: it holds {saved}'s optimizer "
                          f"state, which {cfg.train.optimizer} cannot continue from; resume with "
                          f"train.optimizer={saved}, or start a new run (another ckpt.dir, or ckpt.resume=none)")


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


GENERATED = "<!-- generated: python -m finetune.resume_rules -->"  # in docs/resume-rules.md, above the table


def write_table(doc_path: str) -> None:
    """Replace the table under GENERATED in `doc_path` (the lines up to the first that is not a table row)."""
    with open(doc_path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    start = lines.index(GENERATED) + 1
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    with open(doc_path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines[:start] + [rules_table()] + lines[end:]))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m finetune.resume_rules",
                                description="Print the table of what a resume does with each changed config key "
                                            "(docs/resume-rules.md), from the declarations in finetune/config.py.")
    p.add_argument("--write", metavar="DOC", help="write it into DOC (docs/resume-rules.md) instead, in place of "
                                                  "the table under its generated-by line")
    args = p.parse_args(argv)
    if args.write:
        write_table(args.write)
    else:
        print(rules_table())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

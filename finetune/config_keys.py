"""How a config key is declared: `key(default, doc, resume=..., choices=/range=, cache=, identity=)`, one call
beside the field's type in finetune/config.py, which everything about the key is derived from.

    python -m pytest tests/test_config.py -q -k "declar or range or cache"

What each part of a declaration feeds:
- doc, choices: `train_fsdp.py --help-config`; choices and range: the config's validation (an error naming the
  key and what it must be). Choices come from the registry that implements them (a tuple, or a dict whose keys
  are the names: `choices=SCHEDULES`), so a new schedule, format or mode is offered where it is written.
- resume: finetune/resume_rules.py (what a resume with another value does) and docs/resume-rules.md's table,
  which `python -m finetune.resume_rules` writes.
- cache (DataConfig fields): finetune/data/cache.py `cache_key`, which reads the field metadata without importing
  the config (finetune/data/ sits below it).
- identity: finetune/model_identity.py, which fingerprints those folders into each checkpoint's meta.json.
tests/test_config.py fails naming a key that has no resume effect, a data key without a cache decision, and a
number without a range.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Resume:
    """What resuming a checkpoint with another value of a key does (finetune/resume_rules.py)."""
    verdict: str  # refused: the continuation would be meaningless | applied: the new value takes effect
    why: str  # why refused, or what taking effect means
    then: str = "takes effect"  # refused only: what happens when ckpt.resume_config_check=warn lets it through


def refused(why: str, then: str = "takes effect") -> Resume:
    return Resume("refused", why, then)


def applies(what: str = "takes effect") -> Resume:
    return Resume("applied", what)


TAKES_EFFECT = applies()


def key(default, doc: str, *, resume: Resume | None = None, choices=(), range=None, cache=None,
        identity: bool = False):
    """A config field with its declaration. `choices`: the allowed values (a registry's tuple or dict: its keys);
    `range`: (check, words) from at_least/above/between/parsed_by; `resume`: refused(why) or applies(what);
    `cache` (data fields): True = tokenizing reads the value, so it enters the token-cache key; "files" = it
    names the data read, which enters the key by the files' names, sizes and times; False = the tokens do not
    depend on it; `identity`: a model folder recorded by content in each checkpoint (finetune/model_identity.py)."""
    return field(default=default, metadata={"doc": doc, "resume": resume, "choices": tuple(choices), "range": range,
                                            "cache": cache, "identity": identity})


def at_least(low):
    return lambda v: v >= low, f">= {low}"


def above(low):
    return lambda v: v > low, f"> {low}"


def between(low, high, high_open=False):
    return (lambda v: low <= v < high) if high_open else (lambda v: low <= v <= high), \
        f"in [{low}, {high}{')' if high_open else ']'}"


def parsed_by(parse, words: str):
    """A str field whose value `parse` accepts (it raises ValueError otherwise)."""
    def ok(value) -> bool:
        try:
            parse(value)
        except ValueError:
            return False
        return True
    return ok, words

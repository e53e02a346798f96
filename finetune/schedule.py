"""The learning-rate schedule: one function, which the optimizer's scheduler and a resume both call.

    python -m pytest tests/test_schedule.py -q

`lr_factor(step, t)` is the multiple of `train.lr` for the optimizer step that follows `step` finished steps.
The scheduler (finetune/optim.py build_optimizer) asks it at every step; a resume (follow_config_schedule) asks it
once for the resumed step, so a checkpoint continues on the current config's schedule at any world size. A new
schedule is a new branch here, its name in SCHEDULES (finetune/config.py offers them as train.lr_schedule) and its
knobs in TrainConfig; nothing else computes an LR.

- cosine: linear warmup to 1, then cosine down to `min_lr_ratio` at `max_steps`.
- wsd (warmup-stable-decay, as recent pre-training and fine-tuning recipes use): linear warmup to 1, constant,
  then a linear decay to `min_lr_ratio` over the last `decay_fraction` of `max_steps`. The stable phase can be
  resumed with a larger max_steps and decayed later: the LR up to the decay does not depend on max_steps.
"""

from __future__ import annotations

import math

SCHEDULES = ("cosine", "wsd")


def lr_factor(step: int, t) -> float:
    """The LR multiple after `step` finished steps under TrainConfig `t` (lr_schedule, warmup_steps, max_steps,
    min_lr_ratio, decay_fraction)."""
    if step < t.warmup_steps:
        return (step + 1) / t.warmup_steps
    if t.lr_schedule == "wsd":
        return _wsd_decay(step, t)
    progress = min(1.0, (step - t.warmup_steps) / max(1, t.max_steps - t.warmup_steps))
    return t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def _wsd_decay(step: int, t) -> float:
    """1 until the decay starts (never before the warmup ends), then linearly down to min_lr_ratio at max_steps."""
    start = max(t.warmup_steps, t.max_steps - round(t.decay_fraction * t.max_steps))
    if step < start:
        return 1.0
    progress = min(1.0, (step - start) / max(1, t.max_steps - start))
    return 1.0 - (1.0 - t.min_lr_ratio) * progress

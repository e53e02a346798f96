"""The LR schedule: one function (finetune/schedule.py) for the scheduler and the resume path, cosine and
warmup-stable-decay, each resumed at another world size with the LR the uninterrupted run has.

    python -m pytest tests/test_schedule.py -q
"""

import json
import math
import os

import pytest

from conftest import FAST, ROOT, run_train
from finetune.config import load_config
from finetune.schedule import lr_factor

TIMEOUT = 180


def train(overrides: list[str]):
    return load_config(None, overrides).train


def test_cosine_warms_up_then_falls_to_the_floor_at_max_steps():
    t = train(["train.warmup_steps=4", "train.max_steps=20", "train.min_lr_ratio=0.1"])
    assert [lr_factor(s, t) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_factor(4, t) == 1.0
    assert lr_factor(12, t) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr_factor(20, t) == pytest.approx(0.1) and lr_factor(30, t) == pytest.approx(0.1)
    falling = [lr_factor(s, t) for s in range(4, 21)]
    assert all(a > b for a, b in zip(falling, falling[1:]))


def test_wsd_holds_the_peak_then_decays_linearly_over_its_last_fraction():
    t = train(["train.lr_schedule=wsd", "train.warmup_steps=2", "train.max_steps=20", "train.decay_fraction=0.25",
               "train.min_lr_ratio=0.0"])
    assert [lr_factor(s, t) for s in range(2)] == [0.5, 1.0]
    assert [lr_factor(s, t) for s in range(2, 15)] == [1.0] * 13  # stable until step 15 = 20 - 0.25 * 20
    assert [lr_factor(s, t) for s in range(15, 21)] == pytest.approx([1.0, 0.8, 0.6, 0.4, 0.2, 0.0])


def test_wsd_stable_phase_does_not_depend_on_max_steps():
    """A WSD run can be extended while stable and decayed later: the LR before the decay is the same."""
    short = train(["train.lr_schedule=wsd", "train.max_steps=100"])
    long = train(["train.lr_schedule=wsd", "train.max_steps=1000"])
    assert [lr_factor(s, short) for s in range(80)] == [lr_factor(s, long) for s in range(80)]


def test_a_decay_longer_than_the_run_starts_after_the_warmup():
    t = train(["train.lr_schedule=wsd", "train.warmup_steps=5", "train.max_steps=10", "train.decay_fraction=1.0"])
    assert lr_factor(4, t) == 1.0 and lr_factor(5, t) == 1.0 and lr_factor(6, t) < 1.0


def test_an_unknown_schedule_is_a_config_error():
    from finetune.config import ConfigError
    with pytest.raises(ConfigError, match="train.lr_schedule"):
        load_config(None, ["train.lr_schedule=linear"])


def logged_lrs(run) -> dict[int, float]:
    with open(os.path.join(str(run), "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    return {r["step"]: r["lr"] for r in records if "event" not in r}


@pytest.mark.parametrize("schedule", ["cosine", "wsd"])
def test_resumed_at_another_world_size_with_the_uninterrupted_runs_lr(tmp_path, schedule):
    """2 ranks to step 4 of 8, then 1 rank to 8: every step's LR equals the uninterrupted 2-rank run's, bit for
    bit, and both equal lr * lr_factor."""
    common = ["ckpt.async_mode=off", "ckpt.interval=0", "train.max_steps=8", "train.warmup_steps=2",
              f"train.lr_schedule={schedule}", "train.decay_fraction=0.5"]
    whole, split = tmp_path / "whole", tmp_path / "split"
    run_train(whole, nproc=2, timeout=TIMEOUT, overrides=common)
    run_train(split, nproc=2, timeout=TIMEOUT, overrides=[*common, "train.max_steps=4"])
    run_train(split, nproc=0, timeout=TIMEOUT, overrides=common)
    t = load_config(os.path.join(ROOT, "configs", "tiny.yaml"), [*FAST, *common]).train  # run_train's config
    want = {s: t.lr * lr_factor(s - 1, t) for s in range(1, 9)}
    assert logged_lrs(whole) == want
    resumed = {s: lr for s, lr in logged_lrs(split).items() if s > 4}
    assert resumed == {s: want[s] for s in range(5, 9)}

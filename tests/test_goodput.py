"""The goodput account of a run folder over all its attempts (finetune/goodput.py, issue 40 point 3).

    python -m pytest tests/test_goodput.py -q
"""

from __future__ import annotations

import os

import pytest

from conftest import events, kill_after_commit, run_python, run_train
from finetune.goodput import account, read_records, run_account


def step(t: float, s: int, step_s: float = 1.0) -> dict:
    return {"step": s, "loss": 1.0, "time": t, "step_s": step_s}


def synthetic_records() -> list[dict]:
    """Two attempts with a known figure for every cause (seconds):
    attempt 1: process start 100, steps 1-4 end at 110..113 (1 s each; step 1 began at 109: startup 9),
      a save of step 2 blocking 0.5 (of which a 0.25 staging wait inside step 3), an eval of 2 s, a hang waited 3 s;
      last record 120. Attempt 2: process start 130 (downtime 10), resumes at step 2, steps 3-5 of 2 s each end
      at 140, 142, 144 (startup 140 - 2 - 130 = 8), run_end at 145. Steps 3 and 4 were trained again: 2 s lost."""
    return [
        {"event": "attempt_start", "time": 101.0, "process_start": 100.0},
        step(110.0, 1), step(111.0, 2),
        {"event": "checkpoint", "time": 111.5, "step": 2, "blocking_s": 0.5, "staging_wait_s": 0.25},
        step(112.0, 3), step(113.0, 4),
        {"event": "eval", "time": 115.0, "step": 4, "eval_loss": 1.0, "eval_s": 2.0},
        {"event": "hang", "time": 120.0, "step": 5, "phase": "step", "ranks": [1], "waited_s": 3.0},
        {"event": "attempt_start", "time": 131.0, "process_start": 130.0},
        {"event": "resume", "time": 135.0, "step": 2, "tier": "disk"},
        step(140.0, 3, 2.0), step(142.0, 4, 2.0), step(144.0, 5, 2.0),
        {"event": "run_end", "time": 145.0, "step": 5, "exit_code": 0},
    ]


def test_account_of_known_records_has_every_cause():
    g = account(synthetic_records())
    assert g.wall == pytest.approx(45.0)
    assert g.lost == pytest.approx({"startup": 17.0, "ckpt": 0.5, "eval": 2.0, "rollback": 2.0, "downtime": 10.0,
                                    "hang": 3.0})
    assert g.trained == pytest.approx(1 + 1 + 2 + 2 + 2 - 0.25)  # kept steps, the staging wait taken off
    assert g.goodput == pytest.approx((45 - 34.5) / 45)
    assert g.steps_redone == 2
    assert [a.completed for a in g.attempts] == [False, True]
    assert g.attempts[1].resumed_from == 2
    lines = g.lines()
    assert len(lines) == 8 and lines[-1].startswith("goodput 23.3% of 45.0s wall over 2 attempt(s) (1 failed)")


def test_records_without_attempt_start_are_one_attempt():
    """A metrics.jsonl from before attempt_start existed: one attempt from its first record, no start-up known."""
    g = account([step(10.0, 1), step(11.0, 2), {"event": "run_end", "time": 12.0}])
    assert len(g.attempts) == 1 and g.wall == pytest.approx(2.0) and g.lost["downtime"] == 0


def test_killed_and_rerun_has_two_attempts_and_counts_the_redone_steps(tmp_path):
    """A real run SIGKILLed after step 8 (step 6 committed) and rerun: the account has two attempts, the steps
    7 and 8 trained again are the rollback, the gap between attempts is downtime, and the run's last lines say
    its goodput; `python -m finetune.metrics goodput` prints the account and draws the timeline."""
    run = tmp_path / "run"
    over = ["train.max_steps=10", "ckpt.interval=3", "ckpt.async_mode=thread"]
    killed = run_train(run, nproc=2, overrides=over, env={"CKPT_FAULT": kill_after_commit(run, 6, 8)}, check=False)
    assert killed.returncode != 0 and "goodput" not in killed.stdout
    done = run_train(run, nproc=2, overrides=over)
    assert [e["step"] for e in events(run, "resume")] == [6]
    last = done.stdout.strip().splitlines()[-1]
    assert last.startswith("goodput ") and "over 2 attempt(s) (1 failed), 2 step(s) trained again" in last, last

    g = run_account(str(run))
    records = read_records(str(run / "metrics.jsonl"))
    second = [i for i, r in enumerate(records) if r.get("event") == "attempt_start"][1]
    redone = [r["step_s"] for r in records[:second] if r.get("step") in (7, 8) and "event" not in r]
    assert len(redone) == 2 and g.lost["rollback"] == pytest.approx(sum(redone))
    assert g.lost["downtime"] > 0 and g.lost["startup"] > 0 and g.lost["ckpt"] > 0
    assert g.attempts[0].start < g.attempts[0].steps[0][0] < g.attempts[1].start

    cli = run_python(["-m", "finetune.metrics", "goodput", str(run)])
    assert cli.returncode == 0, cli.stderr
    assert cli.stdout.count("lost ") == 6 and g.summary() in cli.stdout
    assert os.path.getsize(run / "goodput.png") > 10_000


def test_goodput_of_a_folder_without_metrics_is_one_error_line(tmp_path):
    cli = run_python(["-m", "finetune.metrics", "goodput", str(tmp_path)])
    assert cli.returncode == 2 and cli.stderr.startswith("error: cannot account") and "Traceback" not in cli.stderr

"""End to end: real 2-process gloo runs of train_fsdp.py on the tiny config.

    python -m pytest tests/test_train_e2e.py -q
"""

import json
import math

import pytest

from conftest import assert_loss_falls, events, losses, run_python, run_train

NO_CKPT = ["ckpt.interval=0", "ckpt.save_at_end=false"]


@pytest.fixture(scope="module")
def one_rank_run(tmp_path_factory):
    """W=1, 5 steps, no checkpoint: the reference of the W=2 and activation-checkpointing runs, and a plot's input."""
    run = tmp_path_factory.mktemp("e2e") / "w1"
    run_train(run, nproc=0, overrides=["train.max_steps=5", *NO_CKPT])
    return run


def test_two_ranks_learn_and_write_wellformed_metrics(tmp_path):
    run = tmp_path / "w2"
    proc = run_train(run, nproc=2, overrides=["train.max_steps=40", "ckpt.interval=20", "train.lr=3e-3",
                                              "train.sample_at_end=true"])
    recs = [json.loads(line) for line in open(run / "metrics.jsonl")]
    steps = [r for r in recs if "event" not in r]
    assert [r["step"] for r in steps] == list(range(1, 41))
    for r in steps:
        assert {"step", "loss", "lr", "tokens", "world_size", "grad_norm", "sample_ids"} <= set(r)
        assert r["world_size"] == 2 and math.isfinite(r["loss"])
        assert len(r["sample_ids"]) == 12
    assert [r["tokens"] for r in steps] == [12 * 32 * s for s in range(1, 41)]
    assert_loss_falls(run)
    assert {e["step"] for e in events(run, "checkpoint")} == {20, 40}
    assert "step     40/40 | loss" in proc.stdout and "sample: 'reverse: hello' ->" in proc.stdout
    assert (run / "config.yaml").exists()


def test_loss_same_for_one_and_two_ranks(tmp_path, one_rank_run):
    """Global-batch loss normalisation: W=1 (4 micro batches of 3) and W=2 (2 x 2 x 3) agree."""
    run_train(tmp_path / "w2", nproc=2, overrides=["train.max_steps=5", *NO_CKPT])
    a, b = losses(one_rank_run), losses(tmp_path / "w2")
    assert sorted(a) == sorted(b) == [1, 2, 3, 4, 5]
    for k in a:
        assert math.isclose(a[k], b[k], rel_tol=1e-5), f"step {k}: W=1 {a[k]} vs W=2 {b[k]}"


def test_plot_command_renders_png(one_rank_run):
    out = run_python(["-m", "finetune.metrics", str(one_rank_run / "metrics.jsonl")], timeout=120)
    assert out.returncode == 0, out.stderr
    png = one_rank_run / "loss.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000


def test_activation_checkpointing_keeps_the_losses(tmp_path, one_rank_run):
    """Recomputing blocks in backward changes memory, not math."""
    run_train(tmp_path / "ac", nproc=0, overrides=["train.max_steps=5", *NO_CKPT, "model.activation_checkpointing=true"])
    a, b = losses(one_rank_run), losses(tmp_path / "ac")
    assert sorted(a) == sorted(b) == [1, 2, 3, 4, 5]
    for k in a:
        assert math.isclose(a[k], b[k], rel_tol=1e-6), f"step {k}: {a[k]} vs {b[k]}"

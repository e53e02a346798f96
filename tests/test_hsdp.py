"""HSDP (model.replicas=2: a 2 x 2 mesh, replicate x shard) against FSDP over 4 ranks, and checkpoints that
move between the two meshes. Four gloo ranks on CPU, the tiny model, a few steps.

    python -m pytest tests/test_hsdp.py -q
"""

import math

from conftest import events, losses, run_train

COMMON = ["train.max_steps=4", "ckpt.interval=2", "ckpt.async_mode=off", "ckpt.keep_last=0"]


def _close(a: dict, b: dict, steps) -> None:
    for s in steps:  # reduction order differs between the meshes: equal to float rounding, not bit for bit
        assert math.isclose(a[s], b[s], rel_tol=1e-5), f"step {s}: {a[s]} vs {b[s]}"


def test_hsdp_trains_like_fsdp_and_checkpoints_resume_across_meshes(tmp_path):
    flat, hsdp = tmp_path / "flat", tmp_path / "hsdp"
    run_train(flat, nproc=4, overrides=COMMON)
    run_train(hsdp, nproc=4, overrides=[*COMMON, "model.replicas=2"])
    a, b = losses(flat), losses(hsdp)
    assert sorted(a) == sorted(b) == [1, 2, 3, 4]
    _close(a, b, [1, 2, 3, 4])
    assert a[4] != a[1]

    # 1-D checkpoint -> 2-D mesh, and 2-D checkpoint -> 1-D mesh: the steps after the resume match
    run_train(tmp_path / "to2d", nproc=4, overrides=[*COMMON, "model.replicas=2",
                                                     f"ckpt.resume={flat / 'checkpoints' / 'step-000002'}"])
    run_train(tmp_path / "to1d", nproc=4, overrides=[*COMMON, f"ckpt.resume={hsdp / 'checkpoints' / 'step-000002'}"])
    for run in ("to2d", "to1d"):
        assert [e["step"] for e in events(tmp_path / run, "resume")] == [2]
        got = losses(tmp_path / run)
        assert sorted(got) == [3, 4]
        _close(got, a, [3, 4])


def test_replicas_must_divide_the_world(tmp_path):
    proc = run_train(tmp_path / "bad", nproc=0, overrides=[*COMMON, "model.replicas=3"], check=False)
    assert proc.returncode == 2
    assert "error: model.replicas=3 must divide the world size 1" in proc.stderr

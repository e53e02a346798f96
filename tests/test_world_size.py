"""Changing the number of GPUs: a resume at another world size continues the exact sample stream and loss curve.

    python -m pytest tests/test_world_size.py -q

Run A trains at W=2 straight to step 16. Run B trains at W=2 and is killed after step 9 (step 8 committed),
like a job that is stopped; B's checkpoint then resumes at W=3 and W=1, and, resharded offline 2 -> 3 with
`python -m ckpt reshard`, at W=3 again. Gloo on CPU, a few seconds per run.
"""

import json
import os
import shutil
import subprocess

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from conftest import ckpt_cli, run_train
from ckpt import verify_checkpoint
from ckpt.describe import inspect_path
from ckpt.reading import read_items
from finetune.metrics import read_metrics

STEPS = ["train.max_steps=16", "ckpt.interval=8", "ckpt.keep_last=0"]
RESUMED = range(9, 17)


def step_records(run_dir) -> dict[int, dict]:
    return read_metrics(os.path.join(str(run_dir), "metrics.jsonl"))[0]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """A (W=2 to 16) and B (W=2, killed after step 9: the step-8 checkpoint is what survives)."""
    root = tmp_path_factory.mktemp("world_size")
    run_train(root / "a", 2, STEPS)
    killed = run_train(root / "b", 2, [*STEPS, "ckpt.async_mode=off"], env={"CKPT_FAULT": "kill@after_step:9"},
                       check=False)
    assert killed.returncode != 0, "the fault should have killed run B after step 9"
    verify_checkpoint(str(root / "b" / "checkpoints" / "step-000008"))
    return root


def read_items_keys(path: str) -> list[str]:
    return list(FileSystemReader(path).read_metadata().state_dict_metadata)


def b_step8(root) -> str:
    return str(root / "b" / "checkpoints" / "step-000008")


_resumed: dict[str, subprocess.CompletedProcess] = {}


def resume(root, name: str, nproc: int, ckpt_path: str):
    """Resume `ckpt_path` into run dir `name` (once per module); nproc=0 is plain python, a world of one."""
    if name not in _resumed:
        _resumed[name] = run_train(root / name, nproc, [*STEPS, f"ckpt.resume={ckpt_path}"])
    return root / name, _resumed[name]


def assert_continues_like_a(root, run_dir, world_size: int) -> None:
    a, r = step_records(root / "a"), step_records(run_dir)
    assert sorted(r) == list(RESUMED), "the resumed run should train exactly steps 9..16"
    for s in RESUMED:
        assert r[s]["world_size"] == world_size
        assert r[s]["sample_ids"] == a[s]["sample_ids"], f"step {s}: a different global batch than run A"
        assert r[s]["loss"] == pytest.approx(a[s]["loss"], rel=1e-4), f"step {s}: loss left run A's trajectory"


def test_killed_run_matched_a_until_it_stopped(root):
    a, b = step_records(root / "a"), step_records(root / "b")
    for s in range(1, 9):
        assert b[s]["loss"] == a[s]["loss"] and b[s]["sample_ids"] == a[s]["sample_ids"]


@pytest.mark.parametrize("world_size", [3, 1])
def test_resume_at_another_world_size_continues_exactly(root, world_size):
    run_dir, proc = resume(root, f"w{world_size}", 0 if world_size == 1 else world_size, b_step8(root))
    assert_continues_like_a(root, run_dir, world_size)
    ev = [e for e in read_metrics(os.path.join(str(run_dir), "metrics.jsonl"))[1] if e["event"] == "resume"]
    assert [(e["step"], e["saved_world_size"], e["world_size"]) for e in ev] == [(8, 2, world_size)]
    rng_lines = [ln for ln in proc.stdout.splitlines() if "RNG saved by 2 ranks" in ln]
    assert len(rng_lines) == 1 and "re-derived" in rng_lines[0], proc.stdout[-2000:]


def test_offline_reshard_then_resume_equals_resuming_the_original(root):
    src, out = b_step8(root), root / "resharded"
    proc = ckpt_cli("reshard", src, str(out), "--world-size", "3")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    dst = str(out / "step-000008")  # a plain folder as dst is taken as a ckpt.dir
    verify_checkpoint(dst)
    with open(os.path.join(dst, "meta.json")) as f:
        meta = json.load(f)
    assert (meta["world_size"], meta["rng_world_size"], meta["step"]) == (3, 2, 8)
    assert sorted(n for n in os.listdir(dst) if n.endswith(".distcp")) == [f"__{r}_0.distcp" for r in range(3)]

    # every item survives: model, AdamW moments and steps, param groups, scheduler, data, progress, RNG
    keys = read_items_keys(src)
    assert sorted(keys) == sorted(read_items_keys(dst))
    before, after = read_items(src, keys), read_items(dst, keys)
    for k in keys:
        same = torch.equal(before[k], after[k]) if isinstance(before[k], torch.Tensor) else before[k] == after[k]
        assert same, f"{k} changed in the reshard"

    resharded_dir, _ = resume(root, "resharded-w3", 3, dst)
    original_dir, _ = resume(root, "w3", 3, src)
    r, o = step_records(resharded_dir), step_records(original_dir)
    for s in RESUMED:  # bit for bit: the same shards, the same re-derived RNG, the same reduction order
        assert (r[s]["loss"], r[s]["sample_ids"]) == (o[s]["loss"], o[s]["sample_ids"]), f"step {s}"


def test_reshard_refuses_a_world_size_the_batch_does_not_divide(root, tmp_path):
    from ckpt.reshard import reshard
    assert reshard(b_step8(root), str(tmp_path / "x"), 5) == 1
    assert not os.path.exists(tmp_path / "x")


def test_inspect_dry_run_says_what_a_resume_would_do(root, capsys):
    assert inspect_path(b_step8(root), world_size=3) == 0
    out = capsys.readouterr().out
    assert "continues at global sample 96" in out and "go from 2 to 3 shards" in out
    assert "rank 2 reads" in out and "RNG: saved by 2 ranks, so re-derived" in out
    assert inspect_path(b_step8(root), world_size=2) == 0
    assert "RNG: restored per rank" in capsys.readouterr().out
    assert inspect_path(b_step8(root), world_size=5) == 1
    assert "world sizes that work: [1, 2, 3, 4, 6, 12]" in capsys.readouterr().out


def test_inspect_summarises_by_default_and_lists_keys_on_request(root, capsys):
    assert inspect_path(b_step8(root)) == 0
    out = capsys.readouterr().out
    assert "progress.step = 8" in out and "data.position = 96" in out
    assert "exp_avg " not in out.replace("*.exp_avg ", "")  # one line per group, not per tensor
    groups = {ln.split()[0]: ln.split()[1] for ln in out.splitlines() if ln.startswith("  app.")}
    assert groups["app.model.model.layers.*"] == "18" and groups["app.optim.state.*.exp_avg"] == "21"
    assert inspect_path(b_step8(root), tensors=True) == 0
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if "app.optim.state.lm_head.weight.exp_avg " in ln)
    assert "[101, 64]" in line and "float32" in line


def test_inspect_lists_committed_uncommitted_and_corrupt(root, tmp_path, capsys):
    ckpt_dir = tmp_path / "ckpts"
    good = ckpt_dir / "step-000008"
    shutil.copytree(b_step8(root), good)
    shutil.copytree(good, ckpt_dir / "step-000009")
    os.remove(ckpt_dir / "step-000009" / "commit.json")
    shutil.copytree(good, ckpt_dir / "step-000010")
    with open(ckpt_dir / "step-000010" / "__1_0.distcp", "r+b") as f:
        f.truncate(100)
    assert inspect_path(str(ckpt_dir)) == 0
    rows = {ln.split()[0]: ln for ln in capsys.readouterr().out.splitlines()[1:]}
    assert "committed, verified" in rows["8"] and rows["8"].split()[1] == "2"
    assert "uncommitted" in rows["9"]
    assert "CORRUPT" in rows["10"] and "__1_0.distcp" in rows["10"]
    # the dry run on a ckpt.dir picks what resume=auto would: the newest verified checkpoint
    assert inspect_path(str(ckpt_dir), world_size=4) == 0
    assert f"dry run: resume {good}" in capsys.readouterr().out

"""Checkpoint core: kill + resume is bit-identical for every async mode; skips, retention, last save, errors.

    python -m pytest tests/test_ckpt_resume.py -q
"""

import json
import os
import shutil
import time

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from ckpt import verify_checkpoint
from conftest import ROOT, ckpt_cli, events, kill_after_commit, losses, run_train, start_python, train_cmd

RESUME_RUN = ["train.max_steps=12", "ckpt.interval=6", "ckpt.keep_last=0"]


def load_flat(ckpt_path, tmp_path) -> dict:
    """A DCP checkpoint as one flat dict (offline, no process group)."""
    out = tmp_path / f"flat-{abs(hash(str(ckpt_path)))}.pt"
    dcp_to_torch_save(str(ckpt_path), str(out))
    return torch.load(out, weights_only=False)


def tensors(tree, prefix=""):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from tensors(v, f"{prefix}{k}.")
    elif isinstance(tree, torch.Tensor):
        yield prefix.rstrip("."), tree


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory):
    """W=2 straight to step 12, committed at 4, 8 and 12: the losses and final state every kill and resume must
    reproduce (checkpointing changes neither), and the checkpoints the skip test damages (in a copy)."""
    run = tmp_path_factory.mktemp("A") / "run"
    run_train(run, nproc=2, overrides=["train.max_steps=12", "ckpt.interval=4", "ckpt.keep_last=0",
                                       "ckpt.async_mode=off"])
    return run


@pytest.mark.parametrize("mode", ["off", "thread", "process"])
def test_kill_and_resume_is_bit_identical(tmp_path, straight_run, mode):
    run = tmp_path / "B"
    killed = run_train(run, nproc=2, overrides=[*RESUME_RUN, f"ckpt.async_mode={mode}"],
                       env={"CKPT_FAULT": kill_after_commit(run, 6, 8)}, check=False)
    assert killed.returncode != 0
    assert max(losses(run)) == 8, "the kill should land right after step 8"
    assert not (run / "checkpoints" / "step-000012").exists()
    run_train(run, nproc=2, overrides=[*RESUME_RUN, f"ckpt.async_mode={mode}"])
    resumed = events(run, "resume")
    assert [e["step"] for e in resumed] == [6], resumed

    a, b = losses(straight_run), losses(run)
    assert sorted(b) == list(range(1, 13))
    assert all(a[k] == b[k] for k in a), {k: (a[k], b[k]) for k in a if a[k] != b[k]}  # bit for bit

    final_a = load_flat(straight_run / "checkpoints" / "step-000012", tmp_path)
    final_b = load_flat(run / "checkpoints" / "step-000012", tmp_path)
    ta, tb = dict(tensors(final_a["app"])), dict(tensors(final_b["app"]))
    assert ta.keys() == tb.keys() and any(k.startswith("optim.state") for k in ta)
    for k in ta:
        assert torch.equal(ta[k], tb[k]), f"{k} differs after resume"
    assert final_a["progress"] == final_b["progress"] and final_a["data"] == final_b["data"]
    verify_checkpoint(str(run / "checkpoints" / "step-000012"))


def test_resume_skips_uncommitted_and_corrupt(tmp_path, straight_run):
    run = tmp_path / "r"
    shutil.copytree(straight_run, run)
    ck = run / "checkpoints"
    os.remove(ck / "step-000012" / "commit.json")                      # data files, no marker
    shard = sorted(p for p in os.listdir(ck / "step-000008") if p.endswith(".distcp"))[0]
    with open(ck / "step-000008" / shard, "r+b") as f:                    # one flipped byte
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 0xFF]))
    proc = run_train(run, nproc=2, overrides=["train.max_steps=14", "ckpt.interval=0", "ckpt.keep_last=0"])
    assert "skipping" in proc.stdout and "step-000012/commit.json: missing commit marker" in proc.stdout
    assert f"step-000008/{shard}: checksum mismatch" in proc.stdout
    assert events(run, "resume")[-1]["step"] == 4
    assert {e["step"] for e in events(run, "resume_skip")} == {8, 12}


def test_explicit_resume_path_must_be_valid(tmp_path):
    run = tmp_path / "r"
    run_train(run, nproc=0, overrides=["train.max_steps=4", "ckpt.interval=2", "ckpt.keep_last=0"])
    os.remove(run / "checkpoints" / "step-000004" / "commit.json")
    proc = run_train(run, nproc=0, check=False,
                     overrides=["train.max_steps=6", f"ckpt.resume={run}/checkpoints/step-000004"])
    assert proc.returncode == 2 and "cannot resume from" in proc.stderr and "missing commit marker" in proc.stderr
    ok = run_train(run, nproc=0, overrides=["train.max_steps=6", f"ckpt.resume={run}/checkpoints/step-000002"])
    assert events(run, "resume")[-1]["step"] == 2 and "done: step 6" in ok.stdout


def test_retention_keeps_last_k_committed(tmp_path):
    run = tmp_path / "r"
    run_train(run, nproc=2, overrides=["train.max_steps=10", "ckpt.interval=2", "ckpt.keep_last=2"])
    left = sorted(os.listdir(run / "checkpoints"))
    assert left == [".lock", "step-000008", "step-000010"], left
    assert [e["step"] for e in events(run, "checkpoint")] == [2, 4, 6, 8, 10]


def test_final_checkpoint_when_data_runs_out(tmp_path):
    data = tmp_path / "small.jsonl"
    rows = [{"messages": [{"role": "user", "content": f"reverse: {w}"}, {"role": "assistant", "content": w[::-1]}]}
            for w in ["abc", "hello", "zyx", "fsdp", "shard", "torch"] * 10]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))  # 60 rows = 5 global batches of 12
    run = tmp_path / "r"
    proc = run_train(run, nproc=2, overrides=[f"data.path={data}", "data.epochs=1", "train.max_steps=100",
                                              "ckpt.interval=0"])
    assert "data exhausted" in proc.stdout
    assert max(losses(run)) == 5
    marker = verify_checkpoint(str(run / "checkpoints" / "step-000005"))
    assert marker["step"] == 5


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_background_write_error_exits_nonzero(tmp_path, mode):
    run = tmp_path / "r"
    proc = run_train(run, nproc=2, check=False, env={"CKPT_FAULT": "oserror@write:4"},
                     overrides=["train.max_steps=12", "ckpt.interval=4", f"ckpt.async_mode={mode}"])
    assert proc.returncode != 0
    assert f"error: no space left on {run}/checkpoints while writing checkpoint {run}/checkpoints/step-000004" \
        in proc.stderr
    assert not os.path.exists(run / "checkpoints" / "step-000004" / "commit.json")
    assert max(losses(run)) < 12  # training stopped at the next poll after the failure


def test_second_job_on_same_ckpt_dir_is_refused(tmp_path):
    run = tmp_path / "r"
    # forked from tests/zygote.py (start_python): the job holding the lock only has to be running
    with start_python(train_cmd(0, ["run.dir=" + str(run), "train.max_steps=100000", "ckpt.interval=0",
                                    "run.log_interval=1000", "ckpt.save_at_end=false"])[1:], None, ROOT, True):
        for _ in range(300):
            if (run / "metrics.jsonl").exists() and (run / "metrics.jsonl").stat().st_size > 0:
                break
            time.sleep(0.2)
        proc = run_train(tmp_path / "other", nproc=0, check=False,
                         overrides=[f"ckpt.dir={run}/checkpoints", "train.max_steps=2"])
        assert proc.returncode == 2
        assert "is in use by another job" in proc.stderr
    # leaving the with block kills the first job (SIGKILL) and reaps it


def test_resume_with_other_model_shape_is_clear_error(tmp_path, two_step_run):
    run = two_step_run
    wide = tmp_path / "wide"
    shutil.copytree(os.path.join(ROOT, "assets", "tiny-llama"), wide)
    cfg = json.loads((wide / "config.json").read_text())
    cfg["intermediate_size"] = 256
    (wide / "config.json").write_text(json.dumps(cfg))
    proc = run_train(run, nproc=0, check=False, overrides=[f"model.config_path={wide}", "train.max_steps=4",
                                                           "ckpt.resume_config_check=warn"])  # past the config check
    assert proc.returncode == 2
    assert "does not match the model" in proc.stderr and "mlp" in proc.stderr


def test_verify_cli(two_step_run):
    path = two_step_run / "checkpoints" / "step-000002"
    ok = ckpt_cli("verify", str(path))
    assert ok.returncode == 0 and ok.stdout.startswith("OK")
    with open(path / "meta.json", "a") as f:
        f.write(" ")
    bad = ckpt_cli("verify", str(path))
    assert bad.returncode == 1 and "meta.json: size" in bad.stderr and not bad.stdout

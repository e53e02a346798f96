"""Save errors: a full disk ends the job with one line, a tolerated failure keeps training in every async
mode, and a damaged folder in the way of a save does not stop it.

    python -m pytest tests/test_save_errors.py -q
"""

import json
import os
import re

import pytest

from ckpt import verify_checkpoint
from ckpt.layout import is_marked_committed, list_step_dirs
from conftest import events, losses, run_train, small_filesystem

TIMEOUT = 240
TRACEBACK_RAISED = re.compile(r"^Traceback \(most recent call last\).*\n(?:[ \t].*\n)*(.*)", re.M)


def tracebacks_but_torchruns(stderr: str) -> list[str]:
    """The exception line of each traceback in `stderr` except torchrun's own, which ends in ChildFailedError."""
    return [raised for raised in TRACEBACK_RAISED.findall(stderr) if not raised.startswith(
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError")]


@pytest.fixture
def small_run_dir(tmp_path):
    """(run.dir, env, how): a 4 MiB tmpfs (room for two checkpoints of the tiny model at W=2, and metrics),
    or, where mounting is not allowed, a roomy folder whose checkpoint writes fail with ENOSPC from step 6 on."""
    with small_filesystem(tmp_path / "small-disk", 4300 * 1024, "run", range(6, 13)) as how:
        yield how


@pytest.mark.parametrize("async_mode", ["off", "thread", "process"])
def test_full_disk_one_error_line(tmp_path, small_run_dir, async_mode):
    """run.dir (metrics and checkpoints) on a full filesystem, W=2 under torchrun, in every async mode: one `error:
    no space left on <path> while writing <what>` line, no traceback but torchrun's own (README), non-zero exit,
    the committed checkpoints intact. Process mode printed more: DCP's uploader logged each failed save with
    every rank's traceback before handing it to the worker (uploader.reported_by_the_worker)."""
    run, env, how = small_run_dir
    ckpt_dir = run / "checkpoints"
    proc = run_train(run, nproc=2, check=False, env=env, timeout=TIMEOUT, forked=False, overrides=[  # as launched
        "train.max_steps=12", "ckpt.interval=2", "ckpt.keep_last=0", f"ckpt.async_mode={async_mode}"])
    ours = [line for line in (proc.stdout + proc.stderr).splitlines() if "error:" in line]
    assert proc.returncode != 0
    assert len(ours) == 1 and ours[0].startswith(f"error: no space left on {ckpt_dir} while writing checkpoint "
                                                 f"{ckpt_dir}/step-"), f"[{how}]\n{proc.stderr[-4000:]}"
    assert tracebacks_but_torchruns(proc.stderr) == [], f"[{how}]\n{proc.stderr[-6000:]}"
    failed = int(ours[0].rsplit("step-", 1)[1].split()[0])
    committed = [s for s, p in list_step_dirs(str(ckpt_dir)) if is_marked_committed(p)]
    assert committed and committed == list(range(2, failed, 2)), (failed, committed)
    for s in committed:
        verify_checkpoint(str(ckpt_dir / f"step-{s:06d}"))


def test_continue_on_save_error_sync_mode(tmp_path):
    """ckpt.continue_on_save_error=true with async_mode=off: a failed periodic save is logged and training
    goes on to the end, as in the async modes."""
    run = tmp_path / "run"
    proc = run_train(run, nproc=0, check=False, timeout=TIMEOUT, env={"CKPT_FAULT": "oserror@write:2"}, overrides=[
        "train.max_steps=4", "ckpt.interval=2", "ckpt.async_mode=off", "ckpt.continue_on_save_error=true"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "warning: checkpoint failed, training continues" in proc.stdout
    assert [e["step"] for e in events(run, "checkpoint_failed")] == [2]
    assert max(losses(run)) == 4
    verify_checkpoint(str(run / "checkpoints" / "step-000004"))


def test_damaged_folder_of_the_step_to_save_is_replaced(tmp_path):
    """The newest checkpoint's commit.json is a folder: resume skips it, and when the job reaches that step
    again its save replaces the damaged folder instead of dying on it."""
    run = tmp_path / "run"
    opts = ["ckpt.interval=2", "ckpt.async_mode=off", "ckpt.keep_last=0"]
    run_train(run, nproc=0, timeout=TIMEOUT, overrides=["train.max_steps=4", *opts])
    step4 = run / "checkpoints" / "step-000004"
    os.remove(step4 / "commit.json")
    (step4 / "commit.json").mkdir()
    (step4 / "commit.json" / "junk").write_text("x")
    proc = run_train(run, nproc=0, check=False, timeout=TIMEOUT, overrides=["train.max_steps=4", *opts])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert events(run, "resume_skip")[-1]["step"] == 4
    assert [e["step"] for e in events(run, "resume")] == [2]
    verify_checkpoint(str(step4))
    assert json.loads((step4 / "meta.json").read_text())["step"] == 4

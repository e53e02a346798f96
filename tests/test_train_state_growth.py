"""A train state that grows: a field added to TrainProgress (with its name in ADDED_LATER) resumes a checkpoint
written before it, at the same and at another world size, with one line naming it; a field removed or renamed is
refused by name (ckpt/state.py fit_to_checkpoint).

    python -m pytest tests/test_train_state_growth.py -q

The grown trainer is today's train_fsdp.py with a subclass of TrainProgress put in its place, as a fork would
add a field: the checkpoint it resumes is written by the code as it is.
"""

import os
import shutil

import pytest

from conftest import ROOT, events, losses, run_train

TIMEOUT = 240
STEPS = ["train.max_steps=4", "ckpt.interval=2", "ckpt.keep_last=0", "ckpt.async_mode=off"]
GROWN_TRAINER = f'''"""train_fsdp.py with one more field in TrainProgress, as a fork adds one."""
import dataclasses
import sys

sys.path.insert(0, {ROOT!r})
import finetune.checkpoint_contents as contents  # noqa: E402
import train_fsdp  # noqa: E402


@dataclasses.dataclass
class GrownProgress(contents.TrainProgress):
    loss_avg: float = 0.25
    ADDED_LATER = ("loss_avg",)


train_fsdp.TrainProgress = GrownProgress
if __name__ == "__main__":
    sys.exit(train_fsdp.main())
'''
FILLED = "has no progress.loss_avg (added to the train state since): it starts at 0.25"


@pytest.fixture(scope="module")
def written_before(tmp_path_factory):
    """A 2-rank run of today's code to step 4, with checkpoints at steps 2 and 4; and the grown trainer's file."""
    root = tmp_path_factory.mktemp("growth")
    run_train(root / "base", nproc=2, timeout=TIMEOUT, overrides=STEPS)
    (root / "grown_train.py").write_text(GROWN_TRAINER)
    return root


def resumed_from_step_2(root, name: str, nproc: int, script: str = "", check: bool = True):
    """A copy of the base run without its step 4, resumed (ckpt.resume=auto) to step 4 by `script`."""
    run = root / name
    shutil.copytree(root / "base", run)
    shutil.rmtree(run / "checkpoints" / "step-000004")
    return run, run_train(run, nproc=nproc, timeout=TIMEOUT, overrides=STEPS, script=script, check=check)


@pytest.mark.parametrize("nproc", [2, 0], ids=["same-world-size", "one-rank"])
def test_an_older_checkpoint_resumes_after_a_field_is_added(written_before, nproc):
    run, proc = resumed_from_step_2(written_before, f"grown-{nproc}", nproc, str(written_before / "grown_train.py"))
    assert [ln for ln in proc.stdout.splitlines() if "progress.loss_avg" in ln] == [
        f"resume: {run / 'checkpoints' / 'step-000002'} {FILLED}"]
    assert [(e["step"], e["world_size"]) for e in events(run, "resume")] == [(2, max(nproc, 1))]
    base, grown = losses(written_before / "base"), losses(run)
    if nproc == 2:
        assert grown == base  # otherwise unchanged: the same losses bit for bit
    else:
        assert grown == pytest.approx(base, rel=1e-4)  # another world size sums the loss in another order


def test_a_field_the_checkpoint_holds_but_the_state_lost_is_refused_by_name(written_before):
    """The grown trainer's step-4 checkpoint holds progress.loss_avg; today's code, which lacks it, refuses it."""
    run, _ = resumed_from_step_2(written_before, "grown-then-shrunk", 2, str(written_before / "grown_train.py"))
    proc = run_train(run, nproc=0, timeout=TIMEOUT, overrides=[*STEPS, "train.max_steps=6"], check=False)
    err = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2 and len(err) == 1, proc.stderr[-3000:]
    assert err[0].startswith("error: checkpoint ") and "step-000004 holds 'progress.loss_avg', which this train " \
        "state no longer has (a removed or renamed field)" in err[0], err[0]
    assert max(losses(run)) == 4  # nothing trained
    assert os.path.isdir(run / "checkpoints" / "step-000004")

"""A real SLURM: submit slurm/train.sbatch, preempt it with USR1 mid-training, watch it requeue and resume.

    python -m pytest tests/test_slurm.py -q          # as root, after `bash .ci/install-slurm.sh`

The cluster (tests/slurm_cluster.py) is munged + slurmctld + slurmd on this machine, state in a temp dir.
The job gets USR1 the way SLURM delivers `--signal=B:USR1@N` (to the batch shell), sent at once with
`scancel --signal=USR1 --batch` instead of waiting for a time limit. Skipped, with the reason, when not
root or the packages are missing; a cluster that is installed but does not start is a failure.
"""

from __future__ import annotations

import os
import sys
import time

import pytest

from ckpt import latest_committed_step, step_dir, verify_checkpoint
from conftest import FAST, ROOT, events, free_port, losses, run_train, token_cache
from slurm_cluster import SlurmCluster, running, unavailable_reason
from test_preemption import metrics_so_far

STEPS = ["train.max_steps=30", "ckpt.interval=10"]
SLOW_STEPS = "sleep@after_step,secs=0.1"  # ~0.2 s a step: the signal lands long before the last step
FINAL_STATES = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE")


@pytest.fixture(scope="module")
def slurm():
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    with running(SlurmCluster()) as cluster:
        yield cluster


def wait_for(what: str, cond, timeout: float, explain) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}\n{explain()}")
        time.sleep(0.2)


def test_preempted_job_requeues_and_matches_uninterrupted_run(slurm, tmp_path):
    reference = tmp_path / "reference"
    run_train(reference, 2, STEPS)  # same world size, no SLURM, no interruption

    run, out = tmp_path / "run", tmp_path / "job.out"
    env = {"NPROC_PER_NODE": "2", "RDZV_PORT": str(free_port()), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "CKPT_FAULT": SLOW_STEPS,
           "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]}  # torchrun of this python
    # the script's #SBATCH lines as they are (they ask for no GPUs: this partition has none), this machine's cores
    job = slurm.sbatch(f"--cpus-per-task={os.cpu_count()}", f"--chdir={ROOT}",
                       f"--output={out}", os.path.join(ROOT, "slurm", "train.sbatch"), "configs/tiny.yaml", *FAST,
                       f"run.dir={run}", f"data.cache_dir={token_cache()}", *STEPS, env=env)

    def explain() -> str:
        log = out.read_text()[-5000:] if out.exists() else "(no job output yet)"
        return f"job {slurm.job(job)}\n--- job output\n{log}\n{slurm.logs_tail()}"

    def steps_done() -> int:
        return max((r["step"] for r in metrics_so_far(run) if "loss" in r), default=0)

    def state() -> str:
        return slurm.job(job)["JobState"]

    wait_for("the job to train 4 steps", lambda: steps_done() >= 4 or state() not in ("PENDING", "RUNNING"), 240,
             explain)
    assert state() == "RUNNING", explain()
    slurm.run("scancel", "--signal=USR1", "--batch", str(job))

    def ended() -> bool:  # for good: after its requeue, or without the script having asked for one
        info = slurm.job(job)
        return info["JobState"] in FINAL_STATES and (info["Restarts"] != "0" or "requeueing" not in out.read_text())
    wait_for("the job to be requeued and to end", ended, 300, explain)
    info, log = slurm.job(job), out.read_text()
    assert (info["JobState"], info["Restarts"], info["ExitCode"]) == ("COMPLETED", "1", "0:0"), explain()
    for line in ("got SIGUSR1: forwarding SIGTERM", "preempted (srun exit", "requeueing",
                 "start (restart 1)", "training finished"):
        assert line in log, f"{line!r} not in the job output:\n{log[-5000:]}"

    # first run: stopped at step p with a synchronous emergency checkpoint; second run: resumed from it
    (preempted,) = events(run, "preempted")
    p = preempted["step"]
    assert 4 <= p < 30
    assert [e["mode"] for e in events(run, "checkpoint") if e["step"] == p] == ["sync"]
    assert [e["step"] for e in events(run, "resume")] == [p]
    # the same 30 steps with bit-identical losses, and a committed final checkpoint
    assert losses(run) == losses(reference)
    ckpt_dir = os.path.join(str(run), "checkpoints")
    assert latest_committed_step(ckpt_dir) == 30
    verify_checkpoint(step_dir(ckpt_dir, 30))

"""A real SLURM: submit slurm/train.sbatch, preempt it with USR1 mid-training or freeze a rank, watch it requeue
and resume.

    python -m pytest tests/test_slurm.py -q          # as root, after `bash .ci/install-slurm.sh`

The cluster (tests/slurm_cluster.py) is munged + slurmctld + slurmd on this machine, state in a temp dir.
The job gets USR1 the way SLURM delivers `--signal=B:USR1@N` (to the batch shell), sent at once with
`scancel --signal=USR1 --batch` instead of waiting for a time limit. A frozen rank is CKPT_FAULT's `stop` in the
job's first attempt (SLURM_RESTART_COUNT 0). Skipped, with the reason, when not root or the packages are missing;
a cluster that is installed but does not start is a failure.
"""

from __future__ import annotations

import os
import socket
import sys
import time

import pytest

from ckpt import latest_committed_step, step_dir, verify_checkpoint
from conftest import FAST, ROOT, events, free_port, losses, run_train, token_cache
from slurm_cluster import FINAL_STATES, SlurmCluster, running, unavailable_reason
from test_preemption import metrics_so_far

STEPS = ["train.max_steps=30", "ckpt.interval=10"]
SLOW_STEPS = "sleep@after_step,secs=0.1"  # ~0.2 s a step: the signal lands long before the last step


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


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The same 30 steps at the same world size, no SLURM, no interruption."""
    path = tmp_path_factory.mktemp("reference")
    run_train(path, 2, STEPS)
    return path


class Job:
    """slurm/train.sbatch submitted with the tiny preset, 2 workers, STEPS; its run folder and output."""

    def __init__(self, slurm, tmp_path, fault: str, overrides: list[str] = ()):
        self.slurm, self.run, self.out = slurm, tmp_path / "run", tmp_path / "job.out"
        env = {"NPROC_PER_NODE": "2", "RDZV_PORT": str(free_port()), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
               "CKPT_FAULT": fault, "HANG_DIR": str(tmp_path / "hangs"),
               "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]}  # torchrun of this python
        # the script's #SBATCH lines as they are (they ask for no GPUs: this partition has none), this machine's cores
        self.id = slurm.sbatch(f"--cpus-per-task={os.cpu_count()}", f"--chdir={ROOT}", f"--output={self.out}",
                               os.path.join(ROOT, "slurm", "train.sbatch"), "configs/tiny.yaml", *FAST,
                               f"run.dir={self.run}", f"data.cache_dir={token_cache()}", *STEPS, *overrides, env=env)

    def explain(self) -> str:
        log = self.out.read_text()[-5000:] if self.out.exists() else "(no job output yet)"
        return f"job {self.slurm.job(self.id)}\n--- job output\n{log}\n{self.slurm.logs_tail()}"

    def state(self) -> str:
        return self.slurm.job(self.id)["JobState"]

    def wait_until_requeued_and_ended(self, timeout: float) -> str:
        """Wait until the job is over for good (after its requeue, or without the script having asked for one);
        asserts it completed after one requeue; returns its output."""
        def ended() -> bool:
            info = self.slurm.job(self.id)
            return info["JobState"] in FINAL_STATES and (info["Restarts"] != "0" or  # not "not requeueing"
                                                        ": requeueing" not in self.out.read_text())
        wait_for("the job to be requeued and to end", ended, timeout, self.explain)
        info = self.slurm.job(self.id)
        assert (info["JobState"], info["Restarts"], info["ExitCode"]) == ("COMPLETED", "1", "0:0"), self.explain()
        return self.out.read_text()


def assert_in_log(log: str, *lines: str) -> None:
    for line in lines:
        assert line in log, f"{line!r} not in the job output:\n{log[-5000:]}"


def assert_same_as_reference(run, reference) -> None:
    """The same 30 steps with bit-identical losses, and a committed, verified final checkpoint."""
    assert losses(run) == losses(reference)
    ckpt_dir = os.path.join(str(run), "checkpoints")
    assert latest_committed_step(ckpt_dir) == 30
    verify_checkpoint(step_dir(ckpt_dir, 30))


def test_preempted_job_requeues_and_matches_uninterrupted_run(slurm, tmp_path, reference):
    job = Job(slurm, tmp_path, SLOW_STEPS)

    def steps_done() -> int:
        return max((r["step"] for r in metrics_so_far(job.run) if "loss" in r), default=0)

    wait_for("the job to train 4 steps", lambda: steps_done() >= 4 or job.state() not in ("PENDING", "RUNNING"), 240,
             job.explain)
    assert job.state() == "RUNNING", job.explain()
    slurm.run("scancel", "--signal=USR1", "--batch", str(job.id))
    log = job.wait_until_requeued_and_ended(300)
    assert_in_log(log, "got SIGUSR1: forwarding SIGTERM", "preempted (srun exit", "requeueing", "start (restart 1)",
                  "training finished")

    # first run: stopped at step p with a synchronous emergency checkpoint; second run: resumed from it
    (preempted,) = events(job.run, "preempted")
    p = preempted["step"]
    assert 4 <= p < 30
    assert [e["mode"] for e in events(job.run, "checkpoint") if e["step"] == p] == ["sync"]
    assert [e["step"] for e in events(job.run, "resume")] == [p]
    assert_same_as_reference(job.run, reference)


def test_a_hung_job_is_named_requeued_once_and_matches_uninterrupted_run(slurm, tmp_path, reference):
    """Rank 1 SIGSTOPped inside step 14 of the job's first attempt: the watchdog names it and ends the attempt
    (exit 76, which torchrun reports as 1), the script sees the hang file and requeues, the job resumes from
    step 10's checkpoint and ends like an uninterrupted run."""
    frozen = 14
    once = f"mid_step:{frozen},rank=1,attempt=0"  # a second into the step: its watchdog has published the step
    job = Job(slurm, tmp_path, f"{SLOW_STEPS};sleep@{once},secs=1;stop@{once}", ["train.hang_timeout=10"])
    log = job.wait_until_requeued_and_ended(360)
    assert_in_log(log, "hang number 1 of this job (srun exit 1): error: hang:",
                  f"stopped making progress: rank 1 on {socket.gethostname()}: step {frozen}, phase step",
                  "hung: requeueing", "start (restart 1)", "training finished",
                  # its one node is the partition's only one: excluding it would leave the job pending for ever
                  f"not excluding {socket.gethostname().split('.')[0]} (frozen ranks): 0 other node(s)")
    assert "preempted" not in log and "not requeueing" not in log
    (hang,) = events(job.run, "hang")
    assert (hang["ranks"], hang["step"], hang["exit_code"]) == ([1], frozen, 76)
    assert [e["step"] for e in events(job.run, "resume")] == [10]
    assert sorted(os.listdir(tmp_path / "hangs")) == [f"job-{job.id}-restart-0.txt"]
    assert_same_as_reference(job.run, reference)

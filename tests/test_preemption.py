"""SIGTERM to a torchrun job: an emergency checkpoint at the step reached, then a bit-identical resume.

    python -m pytest tests/test_preemption.py -q

Real torchrun, 2 ranks, gloo on CPU, the tiny config. torchrun turns any failed worker into its own exit
code 1; the workers' distinct 75 shows in its failure report, and a plain `python train_fsdp.py` exits
with it. The SLURM path (batch script, requeue) is tests/test_slurm.py.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time

import pytest

from ckpt import latest_committed_step, step_dir, verify_checkpoint
from conftest import FAST, ROOT, events, losses, run_train, token_cache, train_cmd

STEPS = ["train.max_steps=24", "ckpt.interval=8"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Losses of the same 24 steps without interruption."""
    run = tmp_path_factory.mktemp("preempt") / "reference"
    run_train(run, 2, STEPS)
    return losses(run)


def start_train(run_dir, env: dict | None = None, nproc: int = 2, overrides: list[str] = ()
                ) -> tuple[subprocess.Popen, str]:
    """Like conftest.run_train, but in the background: (torchrun agent or the process, path of its output)."""
    args = [*FAST, f"run.dir={run_dir}", f"data.cache_dir={token_cache()}", *STEPS,
            *overrides]
    out = os.path.join(str(run_dir) + ".out")
    with open(out, "w") as f:
        proc = subprocess.Popen(train_cmd(nproc, args), cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                                env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})},
                                start_new_session=True)  # so a stray signal to the test's group never hits it
    return proc, out


def metrics_so_far(run_dir) -> list[dict]:
    """Records of a metrics.jsonl still being written (a last line may be partial)."""
    try:
        with open(os.path.join(str(run_dir), "metrics.jsonl")) as f:
            lines = f.read().split("\n")[:-1]
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in lines]


def wait_for_step(run_dir, step: int, proc: subprocess.Popen, out: str, timeout: float = 180) -> None:
    end = time.monotonic() + timeout
    while max((r["step"] for r in metrics_so_far(run_dir) if "loss" in r), default=0) < step:
        if proc.poll() is not None or time.monotonic() > end:
            proc.kill()
            raise AssertionError(f"training ended or stalled before step {step}:\n{open(out).read()[-4000:]}")
        time.sleep(0.05)


def worker_pid(agent_pid: int, rank: int) -> int:
    """The pid of torchrun's worker process with RANK=rank (torchrun's children are the workers)."""
    with open(f"/proc/{agent_pid}/task/{agent_pid}/children") as f:
        for pid in map(int, f.read().split()):
            with open(f"/proc/{pid}/environ") as e:
                if f"RANK={rank}" in e.read().split("\0"):
                    return pid
    raise AssertionError(f"no worker with RANK={rank} under torchrun pid {agent_pid}")


def assert_emergency_checkpoint(run_dir, proc, out) -> int:
    """The job stopped early with a committed sync checkpoint at the last step it trained; returns that step."""
    assert proc.wait(120) != 0, "torchrun reports preempted workers as a failure (exit 1)"
    log = open(out).read()
    (preempted,) = events(run_dir, "preempted")
    step = preempted["step"]
    assert step == max(losses(run_dir)) < 24, log[-4000:]
    assert f"preemption signal: saving step {step} and exiting with 75" in log
    assert [e["mode"] for e in events(run_dir, "checkpoint") if e["step"] == step] == ["sync"]
    ckpt = step_dir(os.path.join(str(run_dir), "checkpoints"), step)
    assert verify_checkpoint(ckpt)["step"] == step  # commit marker written, sizes and checksums match
    assert latest_committed_step(os.path.join(str(run_dir), "checkpoints")) == step
    return step


def assert_resumes_bit_identical(run_dir, step: int, reference: dict) -> None:
    run_train(run_dir, 2, STEPS)  # ckpt.resume=auto is the default
    assert [e["step"] for e in events(run_dir, "resume")] == [step]
    assert losses(run_dir) == reference  # every step 1..24, floats compared exactly


def test_sigterm_to_torchrun_mid_training_saves_and_resumes_bit_identical(tmp_path, reference):
    run = tmp_path / "run"
    proc, out = start_train(run)
    wait_for_step(run, 4, proc, out)
    os.kill(proc.pid, signal.SIGTERM)  # to the agent only, like `kill <torchrun pid>`; it forwards to the workers
    step = assert_emergency_checkpoint(run, proc, out)
    assert_resumes_bit_identical(run, step, reference)


def test_sigterm_to_one_rank_during_async_save_finishes_that_save_first(tmp_path, reference):
    """Only rank 1 is signalled, while step 8's async save is still writing: all ranks stop at the same
    step (the all-reduce), step 8's save completes and commits, then the emergency save of the step reached."""
    run = tmp_path / "run"
    proc, out = start_train(run, env={"CKPT_FAULT": "sleep@write:8,secs=4"})  # step 8's upload takes 4 s
    wait_for_step(run, 9, proc, out)
    in_flight = not [r for r in metrics_so_far(run) if r.get("event") == "checkpoint"]
    assert in_flight, "step 8's save had finished before the signal: the sleep window is too short"
    os.kill(worker_pid(proc.pid, rank=1), signal.SIGTERM)
    step = assert_emergency_checkpoint(run, proc, out)
    log = open(out).read()
    assert re.search(r"exitcode\s*:\s*75", log), "rank 1 exits with the documented preemption code"
    order = [(e["event"], e["step"]) for e in events(run) if e["event"] in ("preempted", "checkpoint")]
    assert order == [("preempted", step), ("checkpoint", 8), ("checkpoint", step)], order
    verify_checkpoint(step_dir(os.path.join(str(run), "checkpoints"), 8))
    assert_resumes_bit_identical(run, step, reference)


def test_sigusr1_without_torchrun_exits_75_with_a_checkpoint_even_without_save_at_end(tmp_path):
    """The exit code itself (no torchrun in between), and ckpt.save_at_end=false does not skip the emergency save."""
    run = tmp_path / "run"
    proc, out = start_train(run, nproc=0, overrides=["ckpt.save_at_end=false"])
    wait_for_step(run, 3, proc, out)
    os.kill(proc.pid, signal.SIGUSR1)
    assert proc.wait(120) == 75, open(out).read()[-4000:]
    (preempted,) = events(run, "preempted")
    ckpt_dir = os.path.join(str(run), "checkpoints")
    assert latest_committed_step(ckpt_dir) == preempted["step"] == max(losses(run))
    verify_checkpoint(step_dir(ckpt_dir, preempted["step"]))


def test_sigterm_to_whole_process_group_in_process_mode_keeps_the_uploader_alive(tmp_path, reference):
    """SLURM signals every process of the job, the process-mode uploader included. The uploader has the
    preemption signals blocked, so the in-flight save of step 8 still commits, then the emergency save."""
    run = tmp_path / "run"
    proc, out = start_train(run, env={"CKPT_FAULT": "sleep@write:8,secs=4"}, overrides=["ckpt.async_mode=process"])
    wait_for_step(run, 9, proc, out)
    assert not [r for r in metrics_so_far(run) if r.get("event") == "checkpoint" and r["step"] == 8]
    os.killpg(proc.pid, signal.SIGTERM)  # agent, workers, uploaders: everything, like scancel --signal=TERM
    step = assert_emergency_checkpoint(run, proc, out)
    order = [(e["event"], e["step"]) for e in events(run) if e["event"] in ("preempted", "checkpoint")]
    assert ("checkpoint", 8) in order and order[-1] == ("checkpoint", step), order
    verify_checkpoint(step_dir(os.path.join(str(run), "checkpoints"), 8))
    assert "background save" not in open(out).read()
    assert_resumes_bit_identical(run, step, reference)


def test_sigterm_with_the_memory_tier_on_still_saves_the_step_to_disk(tmp_path, reference):
    """The memory tier does not replace the disk tier's emergency save: the step reached is committed to ckpt.dir,
    the memory steps outlive the failed exit, and the resume of the newest step of either tier is bit-identical;
    the run that ends with 0 removes the memory folder."""
    run, mem = tmp_path / "run", f"{tmp_path / 'run'}-mem"
    tier = ["ckpt.memory_interval=1", f"ckpt.memory_dir={mem}", "ckpt.keep_last=1"]
    proc, out = start_train(run, overrides=tier)
    wait_for_step(run, 5, proc, out)
    os.kill(proc.pid, signal.SIGTERM)
    step = assert_emergency_checkpoint(run, proc, out)
    marked = [d for d in os.listdir(mem) if os.path.exists(os.path.join(mem, d, "commit.json"))]
    assert marked and all(int(d.split("-")[1]) <= step for d in marked), marked
    run_train(run, 2, [*STEPS, *tier])
    assert [e["step"] for e in events(run, "resume")] == [step]
    assert losses(run) == reference and not os.path.exists(mem)

"""Process lifetime: uploader processes start on a port nothing can take first, workers (and their uploaders) die
with their torchrun agent, and a frozen rank ends the job after a set time.

    python -m pytest tests/test_process_lifetime.py -q

Both run train_fsdp.py under torchrun at W=2 on CPU (gloo). In the frozen-rank tests the test SIGKILLs the frozen
rank once rank 0 has ended: torchrun would too, after the 30 s its SIGTERM waits (a frozen rank sleeps through it),
so waiting for that would time torch's grace period, not this repository's timeout.
"""

import ctypes
import fcntl
import os
import signal
import subprocess
import time
from types import SimpleNamespace

import pytest

import train_fsdp
from ckpt import latest_committed_step
from common.procfs import running as alive
from conftest import ROOT, children, kill_workers, run_train, token_cache, train_cmd, FAST
from test_preemption import worker_pid


PORT_TAKEN_TRAINER = """\
import socket, sys
sys.path.insert(0, {root!r})
from torch.distributed.checkpoint import _async_process_executor
taken = socket.socket()
taken.bind(("", 0))
# the port DCP would hand its uploaders is bound by someone else before they bind it (in CI: the local end of a
# storage client's connection)
_async_process_executor.get_free_port = lambda: taken.getsockname()[1]
import train_fsdp
if __name__ == "__main__":
    sys.exit(train_fsdp.main())
"""


def test_process_mode_uploaders_meet_on_a_port_bound_before_they_start(tmp_path):
    script = tmp_path / "train_port_taken.py"
    script.write_text(PORT_TAKEN_TRAINER.format(root=ROOT))
    run = tmp_path / "run"
    run_train(run, 2, ["train.max_steps=4", "ckpt.interval=2", "ckpt.async_mode=process"], script=str(script))
    assert latest_committed_step(str(run / "checkpoints")) == 4


def newest_step(run) -> int:
    try:
        with open(run / "metrics.jsonl") as f:
            return max([0] + [int(line.split('"step": ')[1].split(",")[0]) for line in f if '"loss"' in line])
    except OSError:
        return 0


def worker_pids(agent_pid: int) -> tuple[int, int] | None:
    """(rank 0, rank 1) under a torchrun agent, or None while they are not both started."""
    try:
        return worker_pid(agent_pid, 0), worker_pid(agent_pid, 1)
    except (AssertionError, OSError):  # no such worker yet, or one between fork and exec
        return None


def run_with_rank1_frozen(run_dir, fault: str, overrides: list[str]) -> subprocess.CompletedProcess:
    """torchrun at W=2 with rank 1 frozen by the CKPT_FAULT `fault`: waits (at most 240 s) until rank 0 has ended,
    then SIGKILLs rank 1 (see the module docstring) and returns torchrun's result."""
    args = [*FAST, f"run.dir={run_dir}", f"data.cache_dir={token_cache()}", *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "CKPT_FAULT": fault}
    with open(f"{run_dir}.out", "w+") as out, open(f"{run_dir}.err", "w+") as err:
        agent = subprocess.Popen(train_cmd(2, args), cwd=ROOT, env=env, stdout=out, stderr=err)
        try:
            deadline = time.time() + 240
            while (ranks := worker_pids(agent.pid)) is None and agent.poll() is None and time.time() < deadline:
                time.sleep(0.2)
            assert ranks, f"torchrun started no workers:\n{open(err.name).read()[-3000:]}"
            rank0, rank1 = ranks
            while alive(rank0) and time.time() < deadline:
                time.sleep(0.2)
            assert not alive(rank0), "rank 0 did not end the job within 240 s"
            if alive(rank1):
                os.kill(rank1, signal.SIGKILL)
            agent.wait(120)
        finally:
            kill_workers(agent.pid)
            if agent.poll() is None:
                agent.kill()
                agent.wait()
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(agent.args, agent.returncode, out.read(), err.read())


def test_workers_and_their_uploaders_die_with_their_agent(tmp_path):
    """kill -9 of torchrun's agent alone: its workers must stop at once and free the ckpt.dir lock, and their
    process-mode uploaders too, even one stuck in the middle of writing a save (held there by a fault point)."""
    run = tmp_path / "run"
    args = [*FAST, f"run.dir={run}", f"data.cache_dir={token_cache()}", "train.max_steps=100000",
            "data.epochs=100000", "ckpt.interval=2", "ckpt.async_mode=process", "ckpt.save_at_end=false"]
    stuck = tmp_path / "uploader-stuck"  # created by each uploader as it starts to sleep in the write
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CKPT_FAULT": f"sleep@write:2,secs=600,file={stuck}"}
    agent = subprocess.Popen(train_cmd(2, args), cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    workers, below = [], []
    try:
        deadline = time.time() + 180
        while time.time() < deadline and agent.poll() is None:
            workers = children(agent.pid)
            below = [c for w in workers for c in children(w)]  # each: its uploader and resource tracker
            if stuck.exists() and len(workers) == 2 and len(below) == 4:
                break
            time.sleep(0.5)
        assert stuck.exists() and newest_step(run) >= 2, "the job did not start training and saving"
        assert len(workers) == 2 and len(below) == 4, (workers, below)
        agent.send_signal(signal.SIGKILL)
        agent.wait()
        deadline = time.time() + 20
        while any(alive(p) for p in workers + below) and time.time() < deadline:
            time.sleep(0.2)
        steps_after = newest_step(run)
        assert not any(alive(w) for w in workers), f"workers {workers} outlived their agent"
        assert not any(alive(p) for p in below), f"uploaders / trackers {below} outlived their workers"
        time.sleep(1)
        assert newest_step(run) == steps_after
        with open(run / "checkpoints" / ".lock", "a+") as f:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)  # raises BlockingIOError while a worker holds it
    finally:
        kill_workers(agent.pid)
        for p in workers + below:  # orphans, if the test failed: their parent is no longer the agent
            if alive(p):
                os.kill(p, signal.SIGKILL)
        if agent.poll() is None:
            agent.kill()


@pytest.mark.quick
def test_a_worker_whose_agent_died_before_its_prctl_exits_at_once(monkeypatch, capsys, exits_raise):
    """PR_SET_PDEATHSIG covers the agent's death from the prctl on; a worker already orphaned then (reparented to
    init) would never get the signal, so it exits at once. A refused prctl is a warning; plain python asks nothing."""
    results = []
    monkeypatch.setattr(ctypes, "CDLL", lambda *_a, **_kw: SimpleNamespace(prctl=lambda *_a: results.pop(0)))
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    train_fsdp.die_with_torchrun_agent()  # no prctl asked: results is empty, a call would raise IndexError
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    results.append(-1)
    train_fsdp.die_with_torchrun_agent()
    assert "warning: prctl(PR_SET_PDEATHSIG) failed" in capsys.readouterr().err
    monkeypatch.setattr(os, "getppid", lambda: 1)
    results.append(0)
    with pytest.raises(SystemExit) as ended:
        train_fsdp.die_with_torchrun_agent()
    assert ended.value.code == train_fsdp.EXIT_ERROR


def test_frozen_rank_ends_job_with_collective_timeout(tmp_path):
    """Rank 1 stops answering after step 2: rank 0 must end the job after train.collective_timeout_minutes
    (6 s here) with a line naming the cause, not wait torch's default 30 minutes."""
    t0 = time.time()
    proc = run_with_rank1_frozen(tmp_path / "run", "sleep@after_step:2,rank=1,secs=600",
                                 ["train.max_steps=6", "ckpt.interval=0", "train.collective_timeout_minutes=0.1"])
    assert proc.returncode != 0
    lines = [x for x in proc.stderr.splitlines() if x.startswith("error: ")]
    assert lines == ["error: rank 0: a training collective waited more than 0.1 min (train.collective_timeout_minutes) "
                     "for another rank, which is stuck or dead"], proc.stderr[-3000:]
    assert 'train_fsdp.py", line' not in proc.stderr, proc.stderr[-3000:]
    assert time.time() - t0 < 200


def test_frozen_rank_during_a_save_ends_job_with_checkpoint_timeout(tmp_path):
    """Rank 1 freezes while writing its shards of a sync save: rank 0 gives up after ckpt.timeout_minutes
    (6 s here), says so in one line, and tries no emergency save (it would need the frozen rank)."""
    run = tmp_path / "run"
    proc = run_with_rank1_frozen(run, "sleep@write:2,rank=1,secs=600",
                                 ["train.max_steps=4", "ckpt.interval=2", "ckpt.async_mode=off", "ckpt.timeout_minutes=0.1"])
    lines = [x for x in proc.stderr.splitlines() if x.startswith("error: ")]
    assert proc.returncode != 0
    assert lines == [f"error: writing checkpoint {run}/checkpoints/step-000002: a checkpoint collective timed out "
                     "waiting for another rank, which is stuck or dead"], proc.stderr[-3000:]
    assert "no emergency checkpoint without all ranks" in proc.stdout

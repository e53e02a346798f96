"""Hang detection and stragglers (finetune/hang.py, finetune/stragglers.py): a frozen rank ends the job with exit 76
naming it, torchrun restarts it, the memory tier resumes it bit for bit; a slow save or a long eval is no hang; a
rank that raises is named with its error, exit 1, no hang; a SIGTERM with a peer frozen stops at once; a rank
slowed on purpose is named as a straggler.

    python -m pytest tests/test_hang.py -q

Run A trains 10 steps at W=2 with a memory step every step. Run B is A with rank 1 frozen by SIGSTOP (CKPT_FAULT
`stop`) inside step 6, after a second in it, under `torchrun --max-restarts 1` and train.hang_timeout=10.
"""

import os
import signal
import subprocess
import time

import pytest
import torch.distributed as dist

from conftest import FAST, ROOT, events, kill_workers, losses, run_train, token_cache, train_cmd
from finetune.hang import AUTO_FLOOR_S, CAP_SHARE, HangWatchdog, parse_hang_timeout

RUN = ["train.max_steps=10", "ckpt.interval=0", "ckpt.memory_interval=1", "train.hang_timeout=10"]
FROZEN_STEP = 6


def with_memory(run_dir) -> list[str]:
    return [*RUN, f"ckpt.memory_dir={run_dir}-mem"]


def test_a_frozen_rank_is_named_and_the_restarted_job_ends_bit_for_bit(tmp_path):
    run_train(tmp_path / "a", 2, with_memory(tmp_path / "a"))
    b, frozen_at = tmp_path / "b", tmp_path / "frozen"
    fault = (f"sleep@mid_step:{FROZEN_STEP},rank=1,attempt=0,secs=1,file={frozen_at};"  # frozen a second into the step
             f"stop@mid_step:{FROZEN_STEP},rank=1,attempt=0")
    proc = run_train(b, 2, with_memory(b), env={"CKPT_FAULT": fault}, restarts=1)
    ended = time.time()
    assert ended - os.path.getmtime(frozen_at) < 120, "the job took too long to get over the frozen rank"
    said = [ln for ln in proc.stderr.splitlines() if ln.startswith("error: hang:")]
    assert len(said) == 1 and f"rank 1: step {FROZEN_STEP}, phase step" in said[0], proc.stderr[-3000:]
    [hang] = events(b, "hang")
    assert (hang["ranks"], hang["step"], hang["phase"], hang["exit_code"]) == ([1], FROZEN_STEP, "step", 76)
    assert 10 <= hang["waited_s"] < 60
    with open(b / "hang" / "rank0-attempt0.txt") as f:
        assert "train_step" in f.read(), "rank 0's stacks show where its main thread waited"
    assert [e["tier"] for e in events(b, "resume")] == ["memory"]
    assert losses(b) == losses(tmp_path / "a") and sorted(losses(b)) == list(range(1, 11))


def test_a_failing_rank_is_named_with_its_error_not_called_a_hang(tmp_path):
    """Issue 49's command: rank 1 raises inside step 5 (an OSError standing for a CUDA OOM); rank 0 waits for it in
    the step's collective. The job ends naming rank 1's error, exit 1, no hang file (slurm/train.sbatch requeues on
    one), no stacks, well before the hang timeout would have called it a hang."""
    run, hang_file = tmp_path / "run", tmp_path / "hang.txt"
    proc = run_train(run, 2, ["train.max_steps=20", "ckpt.interval=4", "train.hang_timeout=5"], check=False,
                     env={"CKPT_FAULT": "oserror@mid_step:5,rank=1", "FINETUNE_HANG_FILE": str(hang_file)})
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert proc.returncode == 1 and not hang_file.exists() and not (run / "hang").exists(), proc.stderr[-3000:]
    assert "error: rank 1: OSError: [Errno 28]" in proc.stderr, "the failing rank's own line, though not rank 0"
    assert any(ln.startswith("error: rank 1 failed: OSError: [Errno 28]") and "(step 5, phase step)" in ln
               for ln in errors), proc.stderr[-3000:]
    assert not any("hang" in ln for ln in errors) and "exitcode  : 76" not in proc.stderr, proc.stderr[-3000:]
    [failed] = events(run, "failed")
    assert (failed["rank"], failed["step"], failed["exit_code"]) == (1, 5, 1) and events(run, "hang") == []


def test_a_sigterm_while_a_peer_is_frozen_stops_the_job_at_once(tmp_path):
    """torchrun's SIGTERM reaches rank 0 blocked in a collective on rank 1, which is frozen (SIGSTOP): rank 0 must
    not wait for a step boundary that never comes (torchrun would SIGKILL it after its 60 s here)."""
    frozen = tmp_path / "frozen"
    args = [*FAST, f"run.dir={tmp_path / 'run'}", f"data.cache_dir={token_cache()}", "train.max_steps=20",
            "ckpt.interval=0", "train.hang_timeout=300"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "60",
           "CKPT_FAULT": f"stop@mid_step:4,rank=1,file={frozen}"}
    agent = subprocess.Popen(train_cmd(2, args), cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 240
        while not frozen.exists() and agent.poll() is None and time.time() < deadline:
            time.sleep(0.2)
        assert frozen.exists(), "rank 1 was never frozen"
        time.sleep(1)
        t0 = time.monotonic()
        agent.send_signal(signal.SIGTERM)
        agent.wait(120)
        stopped_s = time.monotonic() - t0
    finally:
        kill_workers(agent.pid)
        if agent.poll() is None:
            agent.kill()
    assert stopped_s < 30, f"the job took {stopped_s:.0f}s to stop after SIGTERM"


def test_auto_hang_timeout_stays_below_the_collective_timeout():
    dog = HangWatchdog(None, 0, 1, "unused", None, None, cap=600)
    dog.step_times.extend([90.0] * 5)
    assert dog.timeout() == CAP_SHARE * 600, "10 x 90 s would outlast NCCL's 10 min: NCCL would abort first"
    assert HangWatchdog(None, 0, 1, "unused", None, None, cap=30)._capped(AUTO_FLOOR_S) == CAP_SHARE * 30


def test_the_first_failure_is_the_one_published():
    store = dist.HashStore()
    dogs = [HangWatchdog(5, r, 3, "unused", None, store) for r in range(3)]
    assert dogs[0]._failure() is None
    dogs[0].state = ("step", 7, time.monotonic())
    dogs[2].state = ("checkpoint", 6, time.monotonic())
    dogs[2].failed(OSError("CUDA out of memory\nmore lines"))
    dogs[0].failed(RuntimeError("connection closed by peer"))  # a consequence, not the cause
    assert dogs[1]._failure() == {"rank": 2, "step": 6, "phase": "checkpoint", "error": "OSError: CUDA out of memory"}
    assert dogs[2]._failure() is None, "a rank does not exit on its own failure"
    assert [d.state[0] for d in dogs] == ["failed", "startup", "failed"]


def test_a_slow_save_and_a_long_eval_are_not_hangs(tmp_path):
    saved, evaluated = tmp_path / "slow-save", tmp_path / "long-eval"
    fault = f"sleep@write:3,rank=1,secs=15,file={saved};sleep@eval:4,rank=1,secs=15,file={evaluated}"
    run = tmp_path / "run"
    proc = run_train(run, 2, ["train.max_steps=5", "ckpt.interval=3", "ckpt.async_mode=off", "train.eval_interval=4",
                              "train.hang_timeout=5"], env={"CKPT_FAULT": fault})
    assert saved.exists() and evaluated.exists(), "the save and the eval should have been slowed"
    assert events(run, "hang") == [] and "hang" not in proc.stderr
    assert sorted(losses(run)) == [1, 2, 3, 4, 5]


def test_a_slowed_rank_is_named_a_straggler(tmp_path):
    run = tmp_path / "run"
    proc = run_train(run, 2, ["train.max_steps=8", "train.straggler_margin=0.2"],
                     env={"CKPT_FAULT": "sleep@mid_step,rank=1,secs=0.5"})
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("straggler:")]
    assert lines and lines[0].startswith("straggler: rank 1 "), proc.stdout[-3000:]
    ev = events(run, "straggler")
    assert ev and ev[0]["rank"] == 1 and ev[0]["margin"] > 0.2 and ev[0]["compute_s"] > ev[0]["mean_compute_s"]


def test_a_rank_slowed_inside_the_forward_is_named_a_straggler(tmp_path):
    """The slowdown of a slow GPU: inside a block's forward, after FSDP's all-gather (CKPT_FAULT `forward`). The
    healthy rank waits for it in the next block's all-gather, inside the step: that wait is not its compute."""
    run = tmp_path / "run"
    proc = run_train(run, 2, ["train.max_steps=8", "train.straggler_margin=0.2", "ckpt.interval=0"],
                     env={"CKPT_FAULT": "sleep@forward,rank=1,secs=0.3"})
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("straggler:")]
    assert lines and lines[0].startswith("straggler: rank 1 "), proc.stdout[-3000:]


def test_hang_timeout_values():
    assert parse_hang_timeout("auto") is None and parse_hang_timeout("0") == 0 and parse_hang_timeout("12.5") == 12.5
    for bad in ("-1", "soon", "inf"):
        with pytest.raises(ValueError):
            parse_hang_timeout(bad)
    dog = HangWatchdog(None, 0, 1, "unused", None, None)
    assert dog.timeout() is None, "auto waits for a few timed steps"
    dog.step_times.extend([0.5, 0.5, 30.0])
    assert dog.timeout() == AUTO_FLOOR_S, "short steps: the floor"
    dog.step_times.extend([30.0, 30.0])
    assert dog.timeout() == 300.0, "10 x the median step"

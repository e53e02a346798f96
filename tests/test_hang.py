"""Hang detection and stragglers (finetune/hang.py, finetune/stragglers.py): a frozen rank ends the job with exit 76
naming it, torchrun restarts it, the memory tier resumes it bit for bit; a slow save or a long eval is no hang; a
rank that raises is named with its error, exit 77, no hang; a SIGTERM with a peer frozen stops at once; a rank
slowed on purpose is named as a straggler.

    python -m pytest tests/test_hang.py -q

Run A trains 10 steps at W=2 with a memory step every step. Run B is A with rank 1 frozen by SIGSTOP (CKPT_FAULT
`stop`) inside step 6, after a second in it, under `torchrun --max-restarts 1` and train.hang_timeout=10.
Which of the watchdog's branches such a run takes depends on its timing, so each verdict is also taken in-process,
on a store the test writes (quick tier): a save overrun beside a frozen peer, a step overrun because a peer raised,
whom an overrun names, the kill of a frozen rank on this host, a store that is gone.
"""

import concurrent.futures
import gc
import json
import os
import pickle
import signal
import socket
import subprocess
import threading
import time
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

import ckpt.checksum
import finetune.flight_record
import finetune.hang
import finetune.hang_records
from ckpt import collector, saver
from conftest import FAST, ROOT, events, kill_workers, losses, run_train, token_cache, train_cmd
from finetune.flight_record import FLIGHT_ENV, keep_nccl_flight_record
from finetune.hang import AUTO_FLOOR_S, CAP_SHARE, EXIT_FAILED, EXIT_HANG, HANG_FILE_ENV, HangWatchdog, parse_hang_timeout
from finetune.stragglers import StragglerMonitor

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
    assert len(said) == 1 and f"rank 1 on {socket.gethostname()}: step {FROZEN_STEP}, phase step" in said[0], \
        proc.stderr[-3000:]  # the host: a launcher may keep the next attempt off it
    [hang] = events(b, "hang")
    assert (hang["ranks"], hang["step"], hang["phase"], hang["exit_code"]) == ([1], FROZEN_STEP, "step", 76)
    assert 10 <= hang["waited_s"] < 60
    with open(b / "hang" / "rank0-attempt0.txt") as f:
        assert "train_step" in f.read(), "rank 0's stacks show where its main thread waited"
    with open(b / "hang" / "flight-attempt0" / "gloo_rank_0", "rb") as f:  # the collective rank 0 waits in
        record = pickle.load(f)
    assert any(g["last_enqueued_collective"] > g["last_completed_collective"] for g in record["pg_status"].values()), \
        record["pg_status"]  # a collective rank 0 entered and never left
    assert [e["tier"] for e in events(b, "resume")] == ["memory"]
    assert losses(b) == losses(tmp_path / "a") and sorted(losses(b)) == list(range(1, 11))


def test_both_readers_frozen_during_a_save_end_the_job_with_76_naming_them(tmp_path):
    """Issue 56: at W=4 the readers are ranks 0 and 2; both stop (SIGSTOP) as they start writing step 3's save
    (ckpt.async_mode=off: in the checkpoint phase), ranks 1 and 3 wait for them in DCP's finish. The backup, rank 3,
    sees the readers' heartbeats stopped, reads every record and names them: the job ends 76 within the timeout
    plus a minute. Before, nobody read: ranks 1 and 3 waited for the checkpoint collective's timeout."""
    run, frozen = tmp_path / "run", [tmp_path / "frozen0", tmp_path / "frozen2"]
    fault = ";".join(f"stop@write:3,rank={r},file={f}" for r, f in zip((0, 2), frozen))
    proc = run_train(run, 4, ["train.max_steps=6", "ckpt.interval=3", "ckpt.async_mode=off",
                              "train.hang_timeout=10"], env={"CKPT_FAULT": fault}, check=False, timeout=240)
    ended = time.time()
    assert all(f.exists() for f in frozen), proc.stderr[-3000:]
    assert ended - min(map(os.path.getmtime, frozen)) < 10 + 60, "the verdict took longer than the timeout + 1 min"
    said = [ln for ln in proc.stderr.splitlines() if ln.startswith("error: hang:")]
    host = socket.gethostname()
    assert len(said) == 1 and (f"rank 0 on {host}: step 3, phase checkpoint; rank 2 on {host}: step 3, phase "
                               "checkpoint;") in said[0], proc.stderr[-3000:]
    [hang] = events(run, "hang")
    assert (hang["ranks"], hang["phase"], hang["exit_code"], hang["detected_by"]) == ([0, 2], "checkpoint", 76, 1)
    # torchrun's summary names the first worker it saw end: a frozen rank the verdict SIGKILLed, or a 76


def test_a_failing_rank_is_named_with_its_error_not_called_a_hang(tmp_path):
    """Issue 49's command: rank 1 raises inside step 5 (an OSError standing for a CUDA OOM); rank 0 waits for it in
    the step's collective. The job ends naming rank 1's error, exit 77 (torchrun's 1; its summary names the 77), no
    hang file (slurm/train.sbatch requeues on one), no stacks, well before the hang timeout would have called it a
    hang."""
    run, hang_file = tmp_path / "run", tmp_path / "hang.txt"
    proc = run_train(run, 2, ["train.max_steps=20", "ckpt.interval=4", "train.hang_timeout=5"], check=False,
                     env={"CKPT_FAULT": "oserror@mid_step:5,rank=1", "FINETUNE_HANG_FILE": str(hang_file)})
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert proc.returncode == 1 and not hang_file.exists(), proc.stderr[-3000:]
    assert os.listdir(run / "hang") == ["rank1-attempt0-traceback.txt"], "rank 1's traceback, and no stacks"
    assert "error: rank 1: OSError: [Errno 28]" in proc.stderr, "the failing rank's own line, though not rank 0"
    assert any(ln.startswith("error: rank 1 failed: OSError: [Errno 28]") and "(step 5, phase step)" in ln
               for ln in errors), proc.stderr[-3000:]
    assert not any(ln.startswith("error: hang") for ln in errors) and "exitcode  : 76" not in proc.stderr, \
        proc.stderr[-3000:]  # rank 1's line names its traceback's file, in <run.dir>/hang/
    [failed] = events(run, "failed")
    assert (failed["rank"], failed["step"], failed["exit_code"]) == (1, 5, EXIT_FAILED) and events(run, "hang") == []
    assert EXIT_FAILED == 77 and f"exitcode  : {EXIT_FAILED}" in proc.stderr, proc.stderr[-3000:]  # torchrun's summary


def test_a_failing_rank_ended_during_its_emergency_save_has_left_its_traceback(tmp_path):
    """Issue 58 point 5: rank 1 raises in step 3 while its step-2 save is still being written (slowed 60 s), so its
    emergency save waits; rank 0 exits 3 s after the failure and torchrun ends rank 1 there, before it could
    re-raise. Its full traceback was written when the error was caught: on stderr and in <run.dir>/hang/."""
    run = tmp_path / "run"
    proc = run_train(run, 2, ["train.max_steps=8", "ckpt.interval=2", "train.hang_timeout=30"], check=False,
                     env={"CKPT_FAULT": "sleep@write:2,rank=1,secs=60;oserror@mid_step:3,rank=1"})
    assert proc.returncode == 1, proc.stderr[-3000:]
    kept = (run / "hang" / "rank1-attempt0-traceback.txt").read_text()
    assert kept.startswith("Traceback (most recent call last)") and "train_fsdp.py" in kept, kept
    assert "OSError: [Errno 28] No space left on device (injected by CKPT_FAULT at mid_step, step 3)" in kept
    assert kept in proc.stderr, proc.stderr[-3000:]


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


def test_the_first_failure_is_the_one_published(tmp_path):
    store = dist.HashStore()
    dogs = [HangWatchdog(5, r, 3, str(tmp_path), None, store) for r in range(3)]
    assert dogs[0]._failure() is None
    dogs[0].state = ("step", 7, time.monotonic())
    dogs[2].state = ("checkpoint", 6, time.monotonic())
    dogs[2].failed(OSError("CUDA out of memory\nmore lines"))
    dogs[0].failed(RuntimeError("connection closed by peer"))  # a consequence, not the cause
    assert dogs[1]._failure() == {"rank": 2, "step": 6, "phase": "checkpoint", "error": "OSError: CUDA out of memory"}
    assert dogs[2]._failure() is None, "a rank does not exit on its own failure"
    assert [d.state[0] for d in dogs] == ["failed", "startup", "failed"]
    assert sorted(os.listdir(tmp_path / "hang")) == ["rank0-attempt0-traceback.txt", "rank2-attempt0-traceback.txt"]


@pytest.mark.quick
def test_a_failing_rank_keeps_its_full_traceback_when_it_is_caught(tmp_path, capsys):
    """Issue 58 point 5: the traceback goes to stderr and to <run.dir>/hang/ as the error leaves the loop, before
    the emergency save: torchrun may end the rank during that save, and the re-raised error is never printed."""
    dog = HangWatchdog(5, 1, 2, str(tmp_path), None, dist.HashStore())

    def deep_in_the_model():
        raise OSError(28, "No space left on device")
    with pytest.raises(OSError), dog.failures_told():
        deep_in_the_model()
    kept = (tmp_path / "hang" / "rank1-attempt0-traceback.txt").read_text()
    assert kept.startswith("Traceback (most recent call last)") and "in deep_in_the_model" in kept
    assert kept.rstrip().endswith("OSError: [Errno 28] No space left on device")
    err = capsys.readouterr().err
    assert err.startswith("error: rank 1: OSError: [Errno 28] No space left on device (traceback in ")
    assert kept in err


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


class _NoTimeEvent:
    """torch.cuda.Event on CPU: the device's part is 0 s, so what the monitor counts is the host's."""

    def __init__(self, enable_timing=False):
        pass

    def record(self):
        pass

    def elapsed_time(self, _end):
        return 0.0


@pytest.mark.quick
def test_on_cuda_the_hosts_own_time_before_the_first_block_is_compute(monkeypatch):
    """Issue 58 point 7: on CUDA compute was the device's time in the blocks only, so a rank whose host was slow
    before them (the batch, H2D copies, a GC pause: CKPT_FAULT sleep@mid_step) looked like every other. Now the host's
    time from the step's start to its first block counts, less the step's collectives meanwhile (the other ranks
    wait for the slow one there); host time after the first block's start (overlapping the device) does not."""
    monkeypatch.setattr(torch.cuda, "Event", _NoTimeEvent)
    block = torch.nn.Linear(2, 2)
    monitor = StragglerMonitor(0.2, 100, 0, 2, torch.device("cpu"), None)
    monitor.on_device = True  # the CUDA path, on CPU
    monitor.watch_blocks([block])
    with monitor.timed(1):
        time.sleep(0.3)  # the host's own work
        with monitor.waiting():
            time.sleep(0.5)  # the loss-token count's all_reduce, waiting for a peer
        for _ in range(2):
            block(torch.zeros(1, 2))
        time.sleep(0.2)  # after the first block: overlaps the device, not counted
    assert 0.3 <= monitor.compute_s < 0.5, monitor.compute_s


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


# ---- the watchdog's verdicts in-process: each rule on a store the test writes, the 1 s check period shortened and
# os._exit raising SystemExit instead. End to end, which branch a run takes depends on its timing; here each is taken.
with open("/proc/sys/kernel/pid_max") as _f:
    NO_SUCH_PID = int(_f.read()) + 1  # a record's pid that a wrong kill could not reach


@pytest.fixture
def quick_watchdog(monkeypatch, exits_raise):
    """HangWatchdog(rank 0 of 2) on a fresh store, its check period 10 ms, its exits SystemExit, its events kept."""
    monkeypatch.setattr(finetune.hang, "CHECK_S", 0.01)
    kept = []
    log = SimpleNamespace(event_from_any_rank=lambda name, **kw: kept.append((name, kw)))
    return lambda run_dir, timeout=1.0: (HangWatchdog(timeout, 0, 2, str(run_dir), log, dist.HashStore()), kept)


@pytest.mark.quick
def test_a_save_that_overran_with_a_peer_frozen_is_a_hang_naming_that_peer(quick_watchdog, tmp_path, monkeypatch,
                                                                          capsys):
    """Outside `step` (a save, an eval) the timeout is checked once per period, and it is a hang only if a peer's
    heartbeat stopped: the line names that peer where its record says it is, the stacks are written, the launcher's
    file gets the line, the exit is EXIT_HANG; a frozen peer on another host is not killed from here."""
    monkeypatch.setenv(HANG_FILE_ENV, str(tmp_path / "told" / "hang.txt"))
    dog, kept = quick_watchdog(tmp_path)
    record = {"step": 3, "phase": "checkpoint", "heartbeat": 5, "host": "another", "pid": NO_SUCH_PID}
    dog.store.set(dog._key(1), json.dumps(record))
    dog.state = ("checkpoint", 3, time.monotonic() - 5)
    with pytest.raises(SystemExit) as ended:
        dog._run()
    assert ended.value.code == EXIT_HANG
    line = capsys.readouterr().err.strip()
    assert line.startswith("error: hang: no progress for") and "at step 3, phase checkpoint" in line
    assert "stopped making progress: rank 1 on another: step 3, phase checkpoint;" in line
    assert "Python stacks and flight records in" in line
    assert (tmp_path / "told" / "hang.txt").read_text() == f"{line}\nfrozen hosts: another\n"
    assert sorted(os.listdir(tmp_path / "hang")) == ["flight-attempt0", "rank0-attempt0.txt"]
    with open(tmp_path / "hang" / "flight-attempt0" / "gloo_rank_0", "rb") as f:  # torch's CPU flight recorder
        assert {"version", "pg_status", "entries"} <= set(pickle.load(f))
    assert kept == [("hang", {"step": 3, "phase": "checkpoint", "ranks": [1], "waited_s": kept[0][1]["waited_s"],
                              "exit_code": EXIT_HANG, "detected_by": 0})]


@pytest.mark.quick
def test_a_torch_without_a_flight_recorder_is_said_in_one_line(quick_watchdog, tmp_path, monkeypatch, capsys):
    """Issue 58 point 4: where the build has no flight recorder, the hang says so in one line, and exits 76."""
    monkeypatch.setattr(finetune.flight_record, "FLIGHT_RECORDERS", (("nccl_rank_", "_no_such_dump"),))
    dog, _ = quick_watchdog(tmp_path)
    dog.store.set(dog._key(1), json.dumps({"step": 3, "phase": "step", "heartbeat": 5, "host": "another",
                                           "pid": NO_SUCH_PID}))
    with pytest.raises(SystemExit) as ended:
        dog._hang("step", 3, time.monotonic() - 5, 1.0)
    assert ended.value.code == EXIT_HANG
    warning, line = capsys.readouterr().err.strip().splitlines()
    assert warning.startswith(f"warning: no flight record of the collectives in {tmp_path / 'hang'}: torch ")
    assert line.startswith("error: hang:") and "Python stacks in" in line
    assert os.listdir(tmp_path / "hang") == ["rank0-attempt0.txt"]


@pytest.mark.quick
def test_nccl_dumps_its_own_flight_record_into_run_dir_unless_the_launcher_chose(tmp_path, monkeypatch):
    """NCCL's dump at its own timeout goes to <prefix><rank>, /tmp/nccl_trace_rank_<r> by default: node-local."""
    for name in FLIGHT_ENV:
        monkeypatch.delenv(name, raising=False)
    keep_nccl_flight_record(str(tmp_path))
    assert os.environ["TORCH_FR_DUMP_TEMP_FILE"] == str(tmp_path / "hang" / "flight-attempt0" / "nccl_rank_")
    monkeypatch.delenv("TORCH_FR_DUMP_TEMP_FILE")
    monkeypatch.setenv("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "/shared/fr/rank_")  # the older name, which 2.13 reads too
    keep_nccl_flight_record(str(tmp_path))
    assert "TORCH_FR_DUMP_TEMP_FILE" not in os.environ


def run_sbatch_after_a_hang(tmp_path, nodes_in_partition: int, job_nodes: int = 2) -> tuple[str, list[str]]:
    """slurm/train.sbatch with stand-ins for srun (a hang whose frozen rank was on node7), scontrol and sinfo on
    PATH: its output and the scontrol calls it made."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls"
    bin_dir.mkdir()
    fakes = {"srun": 'mkdir -p "$(dirname "$FINETUNE_HANG_FILE")"; printf "error: hang: ...\\nfrozen hosts: node7.cluster.example\\n" > "$FINETUNE_HANG_FILE"; exit 1',
             "scontrol": f'echo "$*" >> {calls}; [ "$1" = show ] && echo node1; exit 0',
             "sinfo": f"for i in $(seq {nodes_in_partition}); do echo node$i; done"}
    for name, body in fakes.items():
        (bin_dir / name).write_text(f"#!/bin/bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "node[1-2]",
           "SLURM_JOB_NUM_NODES": str(job_nodes), "SLURM_SUBMIT_DIR": str(tmp_path), "HOME": str(tmp_path)}
    proc = subprocess.run(["bash", os.path.join(ROOT, "slurm", "train.sbatch"), "configs/tiny.yaml"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr  # requeued
    return proc.stdout + proc.stderr, calls.read_text().splitlines()


@pytest.mark.quick
def test_sbatch_requeues_a_hang_without_the_node_whose_rank_froze(tmp_path):
    """Issue 58 point 10: the hang file's `frozen hosts:` line (finetune/hang.py) is excluded from the requeued job,
    short names, after the requeue (SLURM changes the excluded nodes of a pending job only)."""
    out, calls = run_sbatch_after_a_hang(tmp_path, nodes_in_partition=4)
    assert calls[1:] == ["requeue 42", "update JobId=42 ExcNodeList=node7"], (calls, out)
    assert "the requeued job excludes node7" in out


@pytest.mark.quick
def test_sbatch_excludes_no_node_the_job_cannot_do_without(tmp_path):
    """A partition of 2 nodes for a job of 2: excluding one would leave the job pending for ever."""
    out, calls = run_sbatch_after_a_hang(tmp_path, nodes_in_partition=2)
    assert calls[1:] == ["requeue 42"], (calls, out)
    assert "not excluding node7 (frozen ranks): 1 other node(s) in the partition, the job needs 2" in out


@pytest.mark.quick
def test_a_step_that_overran_because_a_peer_raised_is_that_error_not_a_hang(quick_watchdog, tmp_path, capsys):
    """The peer that stopped had published its failure before this rank's verdict: its error is the one line, exit
    77 (EXIT_FAILED), no stacks written, no hang event."""
    dog, kept = quick_watchdog(tmp_path, timeout=5.0)
    peer = HangWatchdog(5.0, 1, 2, str(tmp_path), None, dog.store)
    peer.state = ("step", 4, time.monotonic())
    peer.failed(OSError("No space left on device"))
    capsys.readouterr()
    with pytest.raises(SystemExit) as ended:
        dog._hang("step", 4, time.monotonic() - 6, 5.0)
    assert ended.value.code == EXIT_FAILED
    assert capsys.readouterr().err.strip() == ("error: rank 1 failed: OSError: No space left on device (step 4, phase "
                                               f"step); rank 0 exiting with {EXIT_FAILED}")
    assert [name for name, _ in kept] == ["failed"] and os.listdir(tmp_path / "hang") == ["rank1-attempt0-traceback.txt"]


@pytest.mark.quick
def test_an_overrun_step_names_the_frozen_else_the_ranks_elsewhere_else_every_rank():
    """Whom a `step` that overran names: frozen ranks (heartbeat still) first; with none frozen, the ranks not in
    this step's collectives (another step or phase); with every rank in this step, every rank (a deadlock)."""
    dog = HangWatchdog(5.0, 0, 3, "unused", None, dist.HashStore())
    assert dog._stuck_ranks([2], my_step=7) == [2]
    dog._last_records = {r: {"step": 7, "phase": "step"} for r in range(3)}
    assert dog._stuck_ranks([], my_step=7) == [0, 1, 2]
    dog._last_records[1] = {"step": 7, "phase": "checkpoint"}
    assert dog._stuck_ranks([], my_step=7) == [1]


@pytest.mark.quick
def test_a_frozen_rank_on_this_host_is_sigkilled_one_on_another_host_is_not():
    """A SIGSTOPped rank never handles torchrun's SIGTERM (torchrun waits 30 s, then SIGKILLs): the rank that
    names it kills it if it shares the host; a pid that no longer exists is passed over."""
    here, there = subprocess.Popen(["sleep", "60"]), subprocess.Popen(["sleep", "60"])
    host = socket.gethostname()
    records = {1: {"host": host, "pid": here.pid}, 2: {"host": "another", "pid": there.pid},
               3: {"host": host, "pid": NO_SUCH_PID}}
    try:
        HangWatchdog(5.0, 0, 4, "unused", None, None)._kill_frozen_here([1, 2, 3], records)
        assert here.wait(timeout=10) == -signal.SIGKILL
        assert there.poll() is None
    finally:
        for p in (here, there):
            p.kill()
            p.wait()


@pytest.mark.quick
def test_a_store_that_is_gone_is_no_failure_and_no_frozen_rank(monkeypatch):
    """The agent stopping takes the store with it: the watchdog thread reads no failure, no peer record (read once
    more, then no verdict: an unread record is no frozen rank), and its own publishing does not raise (torchrun
    ends the rank)."""
    monkeypatch.setattr(finetune.hang, "CHECK_S", 0.01)
    monkeypatch.setattr(finetune.hang_records, "RETRY_S", 0.01)
    def gone(*_):
        raise RuntimeError("Connection reset by peer")
    dog = HangWatchdog(5.0, 0, 2, "unused", None, SimpleNamespace(check=gone, get=gone, set=gone, multi_get=gone))
    assert dog._failure() is None and dog._records() is None and dog._frozen_ranks() == []
    dog._beat()
    assert dog.heartbeat == 1


# ---- the cost of a check: W watchdogs in one process (threads), each with its beat thread, on one store that
# counts the record keys read (a multi_get or check of k keys reads k). Only the readers (rank 0 and rank W/2)
# read the records; the others learn a verdict from FAILED_KEY, which every rank looks at once per CHECK_S anyway.
class CountingStore:
    """A store that counts the progress records read, and can hold every request behind one lock for `slow_s` per
    record read (a store's single thread, busy: a beat's `set` waits behind a slow read)."""

    def __init__(self, slow_s: float = 0.0):
        self.store, self.slow_s, self.lock, self.records_read = dist.HashStore(), slow_s, threading.Lock(), 0

    def _served(self, keys, call):
        with self.lock:
            n = sum(k.startswith("finetune/progress/") for k in keys)
            self.records_read += n
            out = call()  # read first, answered late: the value is as old as the request
            time.sleep(self.slow_s * n)
            return out

    def get(self, key):
        return self._served([key], lambda: self.store.get(key))

    def multi_get(self, keys):
        return self._served(keys, lambda: self.store.multi_get(keys))

    def check(self, keys):
        return self._served(keys, lambda: self.store.check(keys))

    def set(self, key, value):
        return self._served([], lambda: self.store.set(key, value))

    def add(self, key, value):
        return self._served([], lambda: self.store.add(key, value))


def watchdogs(store, world_size: int, run_dir, frozen=(), timeout: float = 0.5, overran: float = 0.6,
              phase: str = "checkpoint"):
    """W watchdogs in `phase` that began `overran` seconds ago, their beat and watchdog threads running (no signal
    pipe: one process); the ranks in `frozen` have a record but never beat again."""
    log = SimpleNamespace(event_from_any_rank=lambda name, **kw: None)
    dogs = [HangWatchdog(timeout, r, world_size, str(run_dir), log, store) for r in range(world_size)]
    for dog in dogs:
        dog.where["pid"] = NO_SUCH_PID
        dog.state = (phase, 3, time.monotonic() - overran)
        dog._publish()
    for dog in dogs:
        if dog.rank not in frozen:
            dog._beater.start()
            dog._thread.start()
    return dogs


def stop(dogs) -> None:
    for dog in dogs:
        dog._stop = True
        dog._changed.set()
        dog._wake.set()
    for dog in dogs:
        for t in (dog._beater, dog._thread):
            if t.ident is not None:
                t.join(10)


def verdict_of(store) -> dict | None:
    return json.loads(store.store.get(finetune.hang.FAILED_KEY)) if store.store.check([finetune.hang.FAILED_KEY]) \
        else None


@pytest.mark.quick
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # a false verdict: SystemExit
def test_a_slow_phase_check_reads_at_most_8w_record_keys_in_all(monkeypatch, exits_raise, tmp_path):
    """A save overrunning the timeout on all W ranks at once: one check reads <= 8W records in all (it read 4W^2:
    every rank read every record, check + get, twice) and, with every rank beating, names no one."""
    monkeypatch.setattr(finetune.hang, "CHECK_S", 0.05)
    store, w = CountingStore(), 16
    dogs = watchdogs(store, w, tmp_path, timeout=2.0, overran=2.1)  # one period due now, the next in 2 s
    time.sleep(1.2)  # a check takes 3 x CHECK_S plus its reads
    stop(dogs)
    assert 0 < store.records_read <= 8 * w, f"{store.records_read} record keys read in one check at W={w}"
    assert verdict_of(store) is None, "every rank beat: no verdict"


@pytest.mark.quick
def test_a_slow_reading_pass_gives_no_false_verdict(monkeypatch, exits_raise, tmp_path):
    """Every store request waits behind a reader's pass, which takes longer than the 3 x CHECK_S window (a busy
    store at W=2048): beats land late, and the window, stretched by the pass time measured, still sees them."""
    monkeypatch.setattr(finetune.hang, "CHECK_S", 0.05)
    store = CountingStore(slow_s=0.1)  # 3 records read: a 0.3 s pass, twice the base window of 0.15 s
    dogs = watchdogs(store, 4, tmp_path, timeout=3.0, overran=3.1)
    time.sleep(2.5)
    stop(dogs)
    assert store.records_read >= 6, "the readers read"
    assert verdict_of(store) is None and not (tmp_path / "hang").exists()


@pytest.mark.quick
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the threads' SystemExit(76)
def test_a_frozen_rank_is_still_named_through_a_slow_store(monkeypatch, exits_raise, tmp_path):
    """The same slow store, rank 3 frozen (its record stays, its heartbeat stops): the readers' verdict names it,
    and every other rank acts on that verdict (its stacks written, exit 76) without reading a record."""
    monkeypatch.setattr(finetune.hang, "CHECK_S", 0.05)
    store = CountingStore(slow_s=0.1)
    dogs = watchdogs(store, 4, tmp_path, frozen=(3,), timeout=3.0, overran=3.1)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and any(d._thread.is_alive() for d in dogs if d.rank != 3):
        time.sleep(0.1)
    stop(dogs)
    news = verdict_of(store)
    assert news and news["verdict"]["frozen"] == [3] and news["verdict"]["by"] in (0, 2), news
    assert sorted(os.listdir(tmp_path / "hang")) == ["flight-attempt0", *(f"rank{r}-attempt0.txt" for r in range(3))], \
        "the live ranks wrote their stacks and flight records"
    assert store.records_read <= 8 * 4


@pytest.mark.quick
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # a false verdict: SystemExit
def test_a_beat_held_up_in_a_slow_phase_is_not_a_hang(monkeypatch, exits_raise, tmp_path):
    """Rank 0, the DCP coordinator, beats again 10 x CHECK_S after its readers began looking, as after a C call that
    held its GIL (its finish's pickle memo: seconds at 70B and W=2048) during a save that overran: no verdict. Without
    the HOLD_CHECKS confirmation, reader 2 named rank 0 after its 3 x CHECK_S window: a false hang, exit 76."""
    monkeypatch.setattr(finetune.hang, "CHECK_S", 0.05)
    store = CountingStore()
    dogs = watchdogs(store, 4, tmp_path, frozen=(0,), timeout=3.0, overran=3.1)
    time.sleep(10 * 0.05)
    dogs[0]._beater.start()
    dogs[0]._thread.start()
    time.sleep(2.0)
    alive = [d._thread.is_alive() for d in dogs]
    stop(dogs)
    assert verdict_of(store) is None and all(alive), verdict_of(store)
    assert store.records_read <= 8 * 4


def until_every_live_watchdog_ended(dogs, frozen, seconds: float = 20) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(d._thread.is_alive() for d in dogs if d.rank not in frozen):
        time.sleep(0.1)
    stop(dogs)


@pytest.mark.quick
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the threads' SystemExit(76)
def test_both_readers_frozen_in_a_slow_phase_are_named_by_the_backup(monkeypatch, exits_raise, tmp_path):
    """Issue 56: ranks 0 and 2, the readers at W=4, stop during a save that overran: the backup (rank 3) sees both
    readers' heartbeats still (4 keys a check), reads every record and names them; every live rank exits 76. Before,
    nobody read: no verdict, only the collective's timeout."""
    monkeypatch.setattr(finetune.hang, "CHECK_S", 0.05)
    store = CountingStore()
    dogs = watchdogs(store, 4, tmp_path, frozen=(0, 2), timeout=3.0, overran=3.1)
    until_every_live_watchdog_ended(dogs, (0, 2))
    news = verdict_of(store)
    assert news and news["verdict"]["frozen"] == [0, 2] and news["verdict"]["by"] == 3, news
    assert sorted(os.listdir(tmp_path / "hang")) == ["flight-attempt0", "rank1-attempt0.txt", "rank3-attempt0.txt"]
    assert store.records_read <= 8 * 4


@pytest.mark.quick
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the threads' SystemExit(76)
def test_a_step_overrun_with_both_readers_frozen_is_judged_by_the_backup_alone(monkeypatch, exits_raise, tmp_path):
    """A `step` overrun at W=6 with the readers (0, 3) frozen: the backup (rank 4) judges a timeout later, reading
    the records once (3(W-1) keys: the first `check` and two passes); ranks 1, 2 and 5 read none (each of them read
    every record, W^2 in all, before)."""
    monkeypatch.setattr(finetune.hang, "CHECK_S", 0.05)
    store, w = CountingStore(), 6
    dogs = watchdogs(store, w, tmp_path, frozen=(0, 3), timeout=1.0, overran=1.1, phase="step")
    until_every_live_watchdog_ended(dogs, (0, 3))
    news = verdict_of(store)
    assert news and news["verdict"]["frozen"] == [0, 3] and news["verdict"]["by"] == 4, news
    assert store.records_read == 3 * (w - 1), store.records_read


@pytest.mark.quick
def test_a_closed_watchdog_says_done_after_its_last_beat(monkeypatch):
    """close() from the main thread while the beat thread publishes the phase before: `done` is the record that
    stays (a stale `checkpoint` with a heartbeat that never moves again would be a frozen rank to the readers)."""
    monkeypatch.setattr(finetune.hang, "CHECK_S", 0.01)
    store = CountingStore(slow_s=0.0)
    slow_set = store.set
    def set_(key, value):  # the beat thread's `set` is slow to land: the main thread's is not
        time.sleep(0.1 if threading.current_thread().name == "hang-beat" else 0)
        slow_set(key, value)
    store.set = set_
    dog = HangWatchdog(5.0, 1, 2, "unused", None, store)
    dog.state = ("checkpoint", 3, time.monotonic())
    dog._beater.start()
    time.sleep(0.25)
    dog.close()
    time.sleep(0.3)
    assert json.loads(store.store.get(dog._key(1)))["phase"] == "done"


@pytest.mark.quick
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # a save in one process, no group
def test_the_coordinators_save_runs_without_the_collector_and_freezes_what_it_leaves(tmp_path, monkeypatch):
    """Issue 56 (b): a full collection over DCP's plans and Metadata held the GIL 2.9 CPU-seconds at the 70B shape and
    W=64 (bench/scale_beat.py), long enough for a reader to call the coordinator frozen. Its save now runs with the
    collector paused (its finish is the coordinator's last step), and what it leaves alive is frozen; the collector
    is enabled again after, and also after a save that failed to start."""
    seen = []
    finish = ckpt.checksum.ChecksummingWriter.finish
    def watched(self, metadata, results):
        seen.append(gc.isenabled())
        return finish(self, metadata, results)
    monkeypatch.setattr(ckpt.checksum.ChecksummingWriter, "finish", watched)
    frozen = gc.get_freeze_count()
    try:
        saver.write_sync({"w": torch.zeros(4)}, str(tmp_path / "step-1"), 1, None, str(tmp_path))
        assert seen == [False] and gc.isenabled() and gc.get_freeze_count() > frozen
        upload = concurrent.futures.Future()
        collector.paused_until(True)(upload)  # thread mode: until the upload is done
        assert not gc.isenabled()
        upload.set_result(None)
        assert gc.isenabled()
        collector.paused_until(True)(None)  # the save did not start
        assert gc.isenabled()
    finally:
        gc.unfreeze()
        gc.enable()

"""Fault injection: no crash, torn write, corruption or full disk loses a committed checkpoint.

    python -m pytest tests/test_faults.py -q                # CI: a handful of kill trials, corruption, full disk
    FAULTS_LONG=1 python -m pytest tests/test_faults.py -q  # + 24 randomized kill trials (FAULTS_TRIALS=N for more)

A kill trial runs the tiny config at W=2 with async saves and SIGKILLs ranks (or one uploader process)
at a moment of a save (ckpt/faults.py lists them), notes the newest checkpoint with a valid commit
marker, resumes, and checks that the resume loaded exactly that one and that every logged loss equals an
uninterrupted run's bit for bit. Random trials draw (async mode, moment, step, rank) from a seeded RNG;
the seed is in the test id, so a failure replays with `-k seed7-`.
"""

import os
import random
import re
import subprocess

import pytest

from ckpt import verify_checkpoint
from ckpt.__main__ import main as ckpt_cli
from ckpt.layout import is_marked_committed, list_step_dirs
from conftest import events, losses, run_train, small_filesystem

RUN = ["train.max_steps=12", "ckpt.interval=3", "ckpt.keep_last=2"]  # async saves at 3, 6, 9; final (sync) at 12
SAVES = (3, 6, 9, 12)
KILL_MOMENTS = {  # fault point -> steps at which it can fire
    "mid_step": range(1, 13), "after_step": range(1, 13), "staged": SAVES[:-1], "write": SAVES,
    "partial_write": SAVES, "before_commit": SAVES, "after_commit": SAVES, "sweep": SAVES}


def committed_first(saved_step: int, after_step: int) -> str:
    """CKPT_FAULT prefix: after `after_step`, wait (at most 120 s) for step `saved_step`'s commit marker, so the
    fault that follows must leave at least that checkpoint to resume from, however loaded the machine is
    (process mode's uploader starts slowly). `{ckpt}` becomes the run's checkpoint dir in kill_and_resume."""
    return f"wait_for@after_step:{after_step},secs=120,file={{ckpt}}/step-{saved_step:06d}/commit.json;"


CI_TRIALS = [  # (async mode, CKPT_FAULT): the moments of a save, then the bugs this suite found
    ("thread", committed_first(3, 5) + "kill@staged:6"),              # state staged, upload not started
    ("thread", committed_first(3, 5) + "kill@partial_write:6,rank=1"),  # one rank's shard torn mid-upload
    ("process", committed_first(3, 5) + "kill@write:6,rank=1"),       # an uploader process dies: fail loudly
    ("thread", committed_first(6, 8) + "kill@before_commit:9"),       # all data durable, no marker yet
    ("thread", committed_first(3, 5) + "kill@after_commit:6"),        # marker written, retention not run
    ("thread", committed_first(3, 4) + "oserror@mid_step:5"),         # an error mid-step is not checkpointed
    ("thread", committed_first(3, 5) + "oserror@before_commit:6,rank=0"),  # one rank's failed save stops all
]
TIMEOUT = 240  # a hang fails the trial (and its ranks are killed) instead of stalling CI


def draw_trial(seed: int) -> tuple[str, str]:
    """(async mode, CKPT_FAULT) of one random kill trial."""
    rng = random.Random(seed)
    point = rng.choice(sorted(KILL_MOMENTS))
    step = rng.choice(list(KILL_MOMENTS[point]))
    rank = None if point == "after_commit" else rng.choice([None, 0, 1])  # after_commit runs on rank 0 only
    spec = f"kill@{point}:{step}" + ("" if rank is None else f",rank={rank}")
    if step > 4 and rng.random() < 0.5:  # half the late trials let an earlier save commit first, the rest race it
        spec = committed_first(max(s for s in SAVES if s < step - 1), step - 1) + spec
    return rng.choice(["thread", "process"]), spec


def long_trials() -> list:
    if not os.environ.get("FAULTS_LONG"):
        return [pytest.param("thread", "", marks=pytest.mark.skip(reason="long mode: set FAULTS_LONG=1"))]
    n = int(os.environ.get("FAULTS_TRIALS", "24"))
    return [pytest.param(*draw_trial(s), id=f"seed{s}-{'-'.join(draw_trial(s))}") for s in range(n)]


def newest_committed(ckpt_dir) -> int | None:
    """Newest step whose folder has a commit marker. Every marked folder must verify: a marker never
    stands for a partial checkpoint (VerifyError names the file if one does)."""
    newest = None
    for step, path in list_step_dirs(str(ckpt_dir)):
        if is_marked_committed(path):
            verify_checkpoint(path)
            newest = step
    return newest


def checkpoint_bytes(path) -> int:
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("straight") / "run"
    run_train(run, overrides=[*RUN, "ckpt.async_mode=thread"], timeout=TIMEOUT)
    return run


def kill_and_resume(run, straight_run, mode: str, fault: str, extra: tuple = (),
                    after_kill=lambda ckpt_dir: None) -> subprocess.CompletedProcess:
    """Run with the fault, check the disk (and `after_kill(ckpt_dir)`), resume without it; the resume must load
    the newest committed checkpoint and the run must match the uninterrupted one bit for bit; where the fault
    waited for a save's marker first (committed_first), that save or a later one must be the one resumed.
    Returns the faulted run."""
    overrides = [*RUN, f"ckpt.async_mode={mode}", *extra]
    waited = re.search(r"step-(\d+)/commit\.json", fault)
    fault = fault.replace("{ckpt}", str(run / "checkpoints"))
    hit = run_train(run, overrides=overrides, env={"CKPT_FAULT": fault}, check=False, timeout=TIMEOUT)
    assert hit.returncode != 0, f"the fault {fault!r} never fired:\n{hit.stdout[-2000:]}"
    expected = newest_committed(run / "checkpoints")
    if waited:  # a late fault that leaves nothing to resume would pass the checks below by training from scratch
        assert expected is not None and expected >= int(waited.group(1)), (expected, hit.stdout[-3000:])
    print(f"{mode} {fault}: exit {hit.returncode}, newest committed checkpoint {expected}")  # the long run's record
    after_kill(run / "checkpoints")
    run_train(run, overrides=overrides, timeout=TIMEOUT)
    assert [e["step"] for e in events(run, "resume")] == ([expected] if expected else []), hit.stdout[-3000:]
    a, b = losses(straight_run), losses(run)
    assert sorted(b) == list(range(1, 13))
    assert all(a[k] == b[k] for k in a), {k: (a[k], b[k]) for k in a if a[k] != b[k]}
    verify_checkpoint(str(run / "checkpoints" / "step-000012"))
    return hit


@pytest.mark.parametrize("mode,fault", CI_TRIALS, ids=[f"{m}-{f}" for m, f in CI_TRIALS])
def test_kill_at_each_moment_of_a_save(tmp_path, straight_run, mode, fault):
    kill_and_resume(tmp_path / "run", straight_run, mode, fault)


@pytest.mark.parametrize("mode,fault", long_trials())
def test_kill_at_random_moments_long(tmp_path, straight_run, mode, fault):
    kill_and_resume(tmp_path / "run", straight_run, mode, fault)


def test_failed_save_with_continue_is_never_resumed(tmp_path, straight_run):
    """ckpt.continue_on_save_error: the step-6 save fails on rank 0 only; every rank logs it and trains on;
    a kill at step 8 then shows the failed folder (all data, no marker) is passed over for step 3."""
    run = tmp_path / "run"
    # step 7 waits until the failed save has written .metadata (then rank 0 fails at once), so that its poll, or
    # step 6's, reports the failure before the kill however loaded the machine is
    step6 = run / "checkpoints" / "step-000006" / ".metadata"
    hit = kill_and_resume(run, straight_run, "thread", f"oserror@before_commit:6,rank=0;wait_for@after_step:7,"
                          f"file={step6},secs=60;sleep@after_step:7,secs=1;kill@after_step:8",
                          extra=("ckpt.continue_on_save_error=true",))
    assert "warning: checkpoint failed, training continues" in hit.stdout
    assert [e["step"] for e in events(run, "checkpoint_failed")] in ([6], [7], [8]), events(run, "checkpoint_failed")
    assert events(run, "resume")[0]["step"] == 3


def test_kill_during_the_sweep_leaves_trash_for_the_next_one(tmp_path, straight_run):
    """Killed after retention moved step 3 into .trash, before any rank deleted a file of it: nothing there looks
    committed or is resumed from, and the restarted job's first sweep deletes it with the step it retires."""
    def step3_in_trash(ckpt_dir):
        moved = os.listdir(ckpt_dir / ".trash")
        assert [n.split(".")[0] for n in moved] == ["step-000003"], moved
        assert not is_marked_committed(str(ckpt_dir / ".trash" / moved[0]))
        assert [s for s, _ in list_step_dirs(str(ckpt_dir))] == [6, 9]
    run = tmp_path / "run"
    kill_and_resume(run, straight_run, "thread", "kill@sweep:9", after_kill=step3_in_trash)
    assert [s for s, _ in list_step_dirs(str(run / "checkpoints"))] == [9, 12]
    assert not os.path.lexists(run / "checkpoints" / ".trash")


# ---------------------------------------------------------------- corruption

CORRUPTIONS = {  # step -> (what a disk or a person does to it, the file `verify` must name)
    14: ("truncate a shard", "__0_0.distcp"),
    12: ("flip one byte of a shard", "__0_0.distcp"),
    10: ("delete a shard", "__0_0.distcp"),
    8: ("delete the commit marker", "commit.json"),
    6: ("corrupt the commit marker", "commit.json"),
    4: ("corrupt meta.json", "meta.json"),
}


def corrupt(path, how: str) -> None:
    shard = os.path.join(path, "__0_0.distcp")
    if how == "truncate a shard":
        os.truncate(shard, os.path.getsize(shard) // 2)
    elif how == "flip one byte of a shard":
        with open(shard, "r+b") as f:
            f.seek(200)
            b = f.read(1)
            f.seek(200)
            f.write(bytes([b[0] ^ 0x01]))
    elif how == "delete a shard":
        os.remove(shard)
    elif how == "delete the commit marker":
        os.remove(os.path.join(path, "commit.json"))
    elif how == "corrupt the commit marker":
        with open(os.path.join(path, "commit.json"), "w") as f:
            f.write('{"step": 6, "files": ')
    elif how == "corrupt meta.json":
        with open(os.path.join(path, "meta.json"), "w") as f:
            f.write("{not json")


def test_each_corruption_is_detected_and_resume_falls_back(tmp_path, capsys):
    """Six checkpoints, each damaged a different way: `python -m ckpt verify` rejects each naming the file,
    and resume walks back past all six, one log line each, to step 2 and continues bit for bit."""
    run = tmp_path / "run"
    overrides = ["train.max_steps=14", "ckpt.interval=2", "ckpt.keep_last=0"]
    run_train(run, nproc=0, overrides=overrides)
    original = losses(run)
    ck = run / "checkpoints"
    for step, (how, name) in CORRUPTIONS.items():
        path = ck / f"step-{step:06d}"
        corrupt(path, how)
        capsys.readouterr()
        assert ckpt_cli(["verify", str(path)]) == 1, how
        err = capsys.readouterr().err
        assert err.startswith("INVALID") and f"{path}/{name}" in err, (how, err)
    assert ckpt_cli(["verify", str(ck / "step-000002")]) == 0

    proc = run_train(run, nproc=0, overrides=overrides)
    for step, (how, name) in CORRUPTIONS.items():
        assert f"resume: skipping {ck}/step-{step:06d}: {ck}/step-{step:06d}/{name}" in proc.stdout, how
    assert [e["step"] for e in events(run, "resume")] == [2]
    assert losses(run) == original
    assert newest_committed(ck) == 14


# ---------------------------------------------------------------- disk full

@pytest.fixture
def small_disk(tmp_path, straight_run):
    """(ckpt.dir, env, how): a tmpfs with room for two checkpoints, or, where mounting is not allowed,
    the storage writer failing with ENOSPC from step 9 on."""
    room = 2.5 * checkpoint_bytes(straight_run / "checkpoints" / "step-000012")
    with small_filesystem(tmp_path / "small-disk", int(room), "checkpoints", range(9, 13)) as how:
        yield how


@pytest.mark.parametrize("keep_going", [False, True], ids=["stop", "continue_on_save_error"])
def test_disk_full_keeps_previous_checkpoint(tmp_path, straight_run, small_disk, keep_going):
    """Step 9's background save fails: its failure is found where its upload ends, at step 10 or 11 (after_step's
    poll) or, on a loaded machine (seen in CI), only in the final save's wait at 12; [stop] takes whichever the
    machine gives. [continue_on_save_error] holds step 9's write until step 12 is done, so it is always the final
    save's wait that finds it (an "in-flight checkpoint failed" line; the final save is still tried, and its own
    failure ends the run). The warning of a failure found during training: test_save_errors.py, test_ckpt_loop.py."""
    ckpt_dir, env, how = small_disk
    print(f"disk full via {how}")
    run = tmp_path / "run"
    if keep_going:
        flag = tmp_path / "step-12-done"
        held = [f"sleep@after_step:12,secs=0,file={flag}", f"wait_for@write:9,secs=120,file={flag}"]
        env = {**env, "CKPT_FAULT": ";".join([*held, env.get("CKPT_FAULT", "")])}  # the wait before any ENOSPC
    proc = run_train(run, check=False, env=env, timeout=TIMEOUT,
                     overrides=[*RUN, f"ckpt.dir={ckpt_dir}", f"ckpt.continue_on_save_error={keep_going}"])
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, f"[{how}] a save that cannot be written must fail the run"
    (error,) = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert error.startswith(f"error: no space left on {ckpt_dir} while writing checkpoint"), f"[{how}] {out[-3000:]}"
    assert newest_committed(ckpt_dir) == 6, f"[{how}] {sorted(os.listdir(ckpt_dir))}"
    assert not is_marked_committed(str(ckpt_dir / "step-000009"))
    assert "step-000009 (in the background)" in out, f"[{how}] step 9's failure is reported\n{out[-3000:]}"
    if keep_going:  # the periodic failure was tolerated, the final one was not
        assert "error: in-flight checkpoint failed: " in proc.stdout and "step-000012" in error, out[-3000:]
        assert max(losses(run)) == 12
        return
    assert "training continues" not in proc.stdout, out[-3000:]  # never tolerated
    # the surviving checkpoint loads (into a fresh run on a roomy disk) and continues bit for bit
    again = tmp_path / "again"
    run_train(again, timeout=TIMEOUT, overrides=[*RUN, f"ckpt.resume={ckpt_dir}/step-000006"])
    assert [e["step"] for e in events(again, "resume")] == [6]
    assert all(losses(again)[k] == losses(straight_run)[k] for k in range(7, 13))


# ---------------------------------------------------------------- a restarted job and its newest checkpoint

def test_restart_never_risks_the_checkpoint_it_resumed_from(tmp_path):
    """keep_last=1 keeps one checkpoint; a restart must not put it at risk: (1) a job restarted after it
    finished does not rewrite it (a kill during that rewrite lost it); (2) if it is corrupt, the restarted
    job's new checkpoints are not deleted by retention in favour of the corrupt, higher-numbered folder."""
    run = tmp_path / "run"
    one = ["ckpt.interval=2", "ckpt.keep_last=1", "ckpt.async_mode=off"]
    run_train(run, nproc=0, overrides=["train.max_steps=4", *one])
    last = run / "checkpoints" / "step-000004"
    again = run_train(run, nproc=0, overrides=["train.max_steps=4", *one], env={"CKPT_FAULT": "kill@write:4"},
                      check=False)
    assert again.returncode == 0 and "done: step 4" in again.stdout, again.stdout[-2000:]
    verify_checkpoint(str(last))

    corrupt(last, "flip one byte of a shard")
    run_train(run, nproc=0, overrides=["train.max_steps=6", *one], env={"CKPT_FAULT": "kill@after_step:3"},
              check=False)
    assert events(run, "resume_skip")[-1]["step"] == 4
    verify_checkpoint(str(run / "checkpoints" / "step-000002"))  # the restarted job's own checkpoint survived


# ---------------------------------------------------------------- the long mode's draws

def test_random_trials_replay_and_cover_every_moment():
    draws = [draw_trial(s) for s in range(200)]
    assert draws == [draw_trial(s) for s in range(200)]
    assert {spec.split(";")[-1].split("@")[1].split(":")[0] for _, spec in draws} == set(KILL_MOMENTS)
    assert {mode for mode, _ in draws} == {"thread", "process"}


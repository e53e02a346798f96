"""Checkpoint logic without a process group: commit marker, verify, retention, lock, resume choice.

    python -m pytest tests/test_ckpt_unit.py -q
"""

import errno
import fcntl
import hashlib
import json
import os
import socket
import sys
import threading
import time
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

import ckpt.storage.lock as lock_module
from ckpt.checksum import ChecksummingWriter
from ckpt.commit_protocol import VerifyError, check_files, commit_checkpoint, shares, verify_checkpoint
from ckpt.layout import COMMIT_FILE, list_step_dirs, step_dir
from ckpt.manager import CheckpointError, CheckpointManager
from ckpt.memory_tier.peers import NodeLayout
from ckpt.memory_tier.replicate import NodeCommitter
from forked_run import start_ranks

DATA = "__0_0.distcp"


def fake_checkpoint(root, step, commit=True):
    """A real one-process DCP checkpoint written and committed the way CheckpointManager does it."""
    path = step_dir(str(root), step)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no process group: saving in a single process" is the intent
        metadata = dcp.save({"w": torch.arange(1000.0), "b": torch.ones(10) * step}, no_dist=True,
                            storage_writer=ChecksummingWriter(path))
    with open(os.path.join(path, "meta.json"), "w") as f:
        json.dump({"step": step, "world_size": 1}, f)
    if commit:
        commit_checkpoint(path, 1, metadata.file_digests, metadata, ["meta.json"])
    return path


def rewrite_marker(path, edit):
    with open(os.path.join(path, COMMIT_FILE)) as f:
        marker = json.load(f)
    edit(marker)
    with open(os.path.join(path, COMMIT_FILE), "w") as f:
        json.dump(marker, f)


def test_marker_lists_every_file_and_verifies(tmp_path):
    path = fake_checkpoint(tmp_path, 5)
    marker = verify_checkpoint(path)
    # .metadata.index: no bucket file, as no tensor is saved in several chunks (ckpt/metadata_index.py)
    assert marker["step"] == 5 and set(marker["files"]) == {".metadata", ".metadata.index", DATA, "meta.json"}
    assert marker["algorithm"] == "xxh3_128"
    assert marker["files"][DATA]["size"] == os.path.getsize(os.path.join(path, DATA))  # hashed as written
    assert not [n for n in os.listdir(path) if ".tmp" in n]  # the tmp marker was renamed away


def flip_byte(p, name=DATA, at=-7):
    with open(os.path.join(p, name), "r+b") as f:
        f.seek(at, 2)
        b = f.read(1)
        f.seek(at, 2)
        f.write(bytes([b[0] ^ 1]))


DAMAGE = [
    (lambda p: os.remove(os.path.join(p, COMMIT_FILE)), "missing commit marker"),
    (lambda p: open(os.path.join(p, COMMIT_FILE), "w").write("{not json"), "corrupt commit marker"),
    (lambda p: os.truncate(os.path.join(p, DATA), 100), f"{DATA}: size 100 != "),
    (lambda p: os.remove(os.path.join(p, DATA)), f"{DATA}: missing"),
    (flip_byte, f"{DATA}: checksum mismatch"),
    (lambda p: flip_byte(p, "meta.json", -2), "meta.json: checksum mismatch"),
    (lambda p: open(os.path.join(p, "__9_0.distcp"), "wb").write(b"z"), "__9_0.distcp: data file not in manifest"),
    (lambda p: rewrite_marker(p, lambda m: m["files"].pop(DATA)), f"{DATA}: referenced by .metadata but not in"),
    # checked against the manifest before it is unpickled, as resume checks the index files it reads
    (lambda p: os.truncate(os.path.join(p, ".metadata"), 10), ".metadata: size 10 != "),
]


@pytest.mark.parametrize("damage,needle", DAMAGE)
@pytest.mark.parametrize("jobs", [1, 3])
def test_verify_names_the_damage(tmp_path, damage, needle, jobs):
    path = fake_checkpoint(tmp_path, 5)
    damage(path)
    with pytest.raises(VerifyError, match=needle.replace(".", r"\.")):
        verify_checkpoint(path, jobs=jobs)


def test_old_sha256_manifest_still_verifies(tmp_path):
    """commit.json as written before the `algorithm` field: per-file "sha256", no top-level algorithm."""
    path = fake_checkpoint(tmp_path, 5)

    def to_old_format(marker):
        del marker["algorithm"]
        for name, info in marker["files"].items():
            with open(os.path.join(path, name), "rb") as f:
                marker["files"][name] = {"size": info["size"], "sha256": hashlib.sha256(f.read()).hexdigest()}
    rewrite_marker(path, to_old_format)
    assert verify_checkpoint(path)["algorithm"] == "sha256"
    assert CheckpointManager(str(tmp_path), "off").choose_checkpoint("auto") == path
    flip_byte(path)
    with pytest.raises(VerifyError, match="checksum mismatch \\(sha256\\)"):
        verify_checkpoint(path)


def test_shares_split_bytes_evenly_and_cover_every_file():
    files = {f"f{i}": {"size": s} for i, s in enumerate([100, 90, 50, 40, 30, 5, 1])}
    parts = shares(files, 3)
    assert sorted(n for p in parts for n in p) == sorted(files)
    loads = [sum(files[n]["size"] for n in p) for p in parts]
    assert max(loads) - min(loads) <= 40
    assert shares(files, 1) == [sorted(files, key=lambda n: -files[n]["size"])]


def test_check_files_checks_only_the_share(tmp_path):
    path = fake_checkpoint(tmp_path, 5)
    flip_byte(path)
    marker = json.load(open(os.path.join(path, COMMIT_FILE)))
    assert check_files(path, marker, [".metadata", "meta.json"]) is None
    assert "checksum mismatch" in check_files(path, marker, [DATA])


def test_retention_never_touches_newest_or_inflight(tmp_path):
    for s in (2, 4, 6):
        fake_checkpoint(tmp_path, s)
    fake_checkpoint(tmp_path, 1, commit=False)   # dead partial from an older crash
    fake_checkpoint(tmp_path, 8, commit=False)   # in flight: newer than every commit
    mgr = CheckpointManager(str(tmp_path), "off", keep_last=2)
    mgr.committer.apply_retention(newest=6)
    assert [s for s, _ in list_step_dirs(str(tmp_path))] == [4, 6, 8]
    mgr.committer.keep_last = 1
    mgr.committer.apply_retention(newest=6)
    assert [s for s, _ in list_step_dirs(str(tmp_path))] == [6, 8]


def test_keep_last_zero_keeps_all_committed(tmp_path):
    for s in (2, 4, 6):
        fake_checkpoint(tmp_path, s)
    CheckpointManager(str(tmp_path), "off", keep_last=0).committer.apply_retention(newest=6)
    assert [s for s, _ in list_step_dirs(str(tmp_path))] == [2, 4, 6]


def test_find_resume_walks_back_and_logs(tmp_path):
    fake_checkpoint(tmp_path, 2)
    bad = fake_checkpoint(tmp_path, 4)
    os.truncate(os.path.join(bad, DATA), 1)
    fake_checkpoint(tmp_path, 6, commit=False)
    logs = []
    mgr = CheckpointManager(str(tmp_path), "off", on_log=logs.append)
    assert mgr.choose_checkpoint("auto") == step_dir(str(tmp_path), 2)
    skips = [line for line in logs if "skipping" in line]  # the others: each verification's start and end
    assert len(skips) == 2 and "step-000006" in skips[0] and "step-000004" in skips[1]
    assert f"resume: verifying {step_dir(str(tmp_path), 2)}: done in" in logs[-1]
    assert mgr.choose_checkpoint("none") is None
    with pytest.raises(CheckpointError, match="cannot resume from"):
        mgr.choose_checkpoint(step_dir(str(tmp_path), 4))


def test_lock_refuses_second_holder(tmp_path):
    a = CheckpointManager(str(tmp_path), "off")
    a.acquire_lock()
    with pytest.raises(CheckpointError, match="in use by another job"):
        CheckpointManager(str(tmp_path), "off").acquire_lock()
    a.close()
    CheckpointManager(str(tmp_path), "off").acquire_lock()  # released with its holder


def test_unwritable_dir_is_clear(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(CheckpointError, match="not writable"):
        CheckpointManager(str(blocker / "ckpts"), "off").acquire_lock()


def no_flock(monkeypatch, err=errno.ENOLCK):
    def flock(*_a):
        raise OSError(err, os.strerror(err))
    monkeypatch.setattr(lock_module.fcntl, "flock", flock)


def write_record(tmp_path, **record):
    (tmp_path / ".lock").write_text(json.dumps(record) + "\n")


def test_lock_file_names_holder_with_heartbeat(tmp_path):
    a = CheckpointManager(str(tmp_path), "off")
    a.acquire_lock()
    record = json.loads((tmp_path / ".lock").read_text())
    assert record["pid"] == os.getpid() and record["host"] == socket.gethostname()
    assert abs(record["heartbeat"] - time.time()) < 60
    with pytest.raises(CheckpointError, match=f"pid {os.getpid()} on {socket.gethostname()}.*heartbeat"):
        CheckpointManager(str(tmp_path), "off").acquire_lock()
    a.close()


@pytest.mark.parametrize("err", [errno.ENOSYS, errno.ENOLCK, errno.EOPNOTSUPP])
def test_unsupported_flock_warns_once_and_continues(tmp_path, monkeypatch, capsys, err):
    no_flock(monkeypatch, err)
    mgr = CheckpointManager(str(tmp_path), "off")
    mgr.acquire_lock()
    logs = capsys.readouterr().err.splitlines()
    assert len(logs) == 1 and logs[0].startswith("warning: flock is not supported")
    # the heartbeat now guards the directory: a second job is refused while this one lives
    with pytest.raises(CheckpointError, match="in use by another job"):
        CheckpointManager(str(tmp_path), "off").acquire_lock()
    mgr.close()


def test_dead_jobs_lock_without_flock_is_taken_over(tmp_path, monkeypatch, capsys):
    no_flock(monkeypatch)
    old = time.time() - lock_module.STALE_S - 60
    write_record(tmp_path, host="node-17", pid=4242, started="2026-01-01T00:00:00", heartbeat=old)
    mgr = CheckpointManager(str(tmp_path), "off")
    mgr.acquire_lock()
    logs = capsys.readouterr().err.splitlines()
    assert "taking over" in logs[-1] and "pid 4242 on node-17" in logs[-1]
    assert json.loads((tmp_path / ".lock").read_text())["pid"] == os.getpid()
    mgr.close()


def test_live_lock_on_another_host_without_flock_is_refused(tmp_path, monkeypatch):
    no_flock(monkeypatch)
    write_record(tmp_path, host="node-17", pid=4242, started="2026-01-01T00:00:00", heartbeat=time.time() - 30)
    with pytest.raises(CheckpointError, match="pid 4242 on node-17.*heartbeat 3\\ds ago.*delete .*\\.lock"):
        CheckpointManager(str(tmp_path), "off").acquire_lock()


def test_held_flock_with_stopped_heartbeat_says_what_to_do(tmp_path):
    """A lock the file server keeps for a dead host: flock still held, heartbeat long stopped."""
    holder = open(tmp_path / ".lock", "a+")
    fcntl.flock(holder, fcntl.LOCK_EX | fcntl.LOCK_NB)
    write_record(tmp_path, host="node-17", pid=4242, started="2026-01-01T00:00:00",
                 heartbeat=time.time() - lock_module.STALE_S - 60)
    with pytest.raises(CheckpointError, match="probably dead.*ps -p 4242. on node-17.*delete .*\\.lock"):
        CheckpointManager(str(tmp_path), "off").acquire_lock()
    holder.close()


@pytest.mark.parametrize("age", [5, 90, lock_module.STALE_S + 60])
def test_held_flock_of_another_host_says_how_to_tell_it_is_dead(tmp_path, age):
    """Right after a host dies its heartbeat is still young and a file server may keep its flock: at every age
    the one-line refusal names host, pid and heartbeat age, how to tell the job is dead, and what to do then."""
    holder = open(tmp_path / ".lock", "a+")
    fcntl.flock(holder, fcntl.LOCK_EX | fcntl.LOCK_NB)
    write_record(tmp_path, host="node-17", pid=4242, started="2026-01-01T00:00:00", heartbeat=time.time() - age)
    with pytest.raises(CheckpointError) as refused:
        CheckpointManager(str(tmp_path), "off").acquire_lock()
    line = str(refused.value)
    assert "\n" not in line
    assert f"pid 4242 on node-17, started 2026-01-01T00:00:00, last heartbeat {age:.0f}s ago" in line
    assert (f"if node-17 is down or `ps -p 4242` on node-17 shows nothing, that job is dead: delete "
            f"{tmp_path / '.lock'} and start again; else stop it or point ckpt.dir elsewhere") in line
    assert ("probably dead" in line) == (age > lock_module.STALE_S)
    holder.close()


def test_held_flock_of_this_host_says_stop_it(tmp_path):
    """On its own host a held flock is a live process (flock dies with it): no advice to delete the lock."""
    holder = open(tmp_path / ".lock", "a+")
    fcntl.flock(holder, fcntl.LOCK_EX | fcntl.LOCK_NB)
    write_record(tmp_path, host=socket.gethostname(), pid=4242, started="2026-01-01T00:00:00", heartbeat=time.time())
    with pytest.raises(CheckpointError, match="stop it or point ckpt.dir elsewhere$") as refused:
        CheckpointManager(str(tmp_path), "off").acquire_lock()
    assert "delete" not in str(refused.value)
    holder.close()


def test_model_check_refuses_saved_tensors_the_model_lacks(tmp_path):
    """A deeper model's checkpoint must not load into a shallower one by leaving its extra layers behind."""
    import torch
    import torch.distributed.checkpoint as dcp

    from ckpt.resume import check_model_matches
    t = torch.zeros(2, 3)
    saved = {f"model.layers.{i}.w": t for i in range(3)}
    dcp.save({f"app.model.{k}": v for k, v in saved.items()}, checkpoint_id=str(tmp_path), no_dist=True)
    check_model_matches(str(tmp_path), saved, "app.model.")
    with pytest.raises(CheckpointError, match=r"the model has no 'model\.layers\.2\.w' \(1 saved tensors"):
        check_model_matches(str(tmp_path), {k: v for k, v in saved.items() if "layers.2" not in k}, "app.model.")
    with pytest.raises(CheckpointError, match=r"it has no 'model\.layers\.3\.w'"):
        check_model_matches(str(tmp_path), {**saved, "model.layers.3.w": t}, "app.model.")


def test_resume_unpickles_metadata_once(tmp_path, monkeypatch):
    """verify (its reference check), the model check and dcp.load never unpickle the global .metadata: at 70B on 512
    ranks that file would be ~155 MB and tens of seconds to unpickle (extrapolated from W=64 by
    bench/ckpt_scale.py, not measured), which rank 0 used to do three times, then once (ckpt/resume.py); they
    read the metadata index instead (ckpt/metadata_index.py). A load without verify reads .metadata once."""
    from torch.distributed.checkpoint import FileSystemReader

    mgr = CheckpointManager(str(tmp_path), "off", keep_last=2)
    mgr.save(1, {"w": torch.arange(10.0)}, {"meta.json": "{}"}, blocking=True)
    calls, real = [], FileSystemReader.read_metadata

    def counted(self, *args, **kwargs):
        calls.append(str(self.path))
        return real(self, *args, **kwargs)
    monkeypatch.setattr(FileSystemReader, "read_metadata", counted)
    path = mgr.choose_checkpoint("auto")
    state = {"w": torch.zeros(10)}
    mgr.load(path, state, model_state={"w": torch.zeros(10)})
    assert calls == [] and torch.equal(state["w"], torch.arange(10.0))
    mgr.load(path, state)  # not verified again: read, not reused from the earlier resume
    assert calls == [path]
    mgr.close()


def _w2_save(rank: int, port: int, ckpt_dir: str) -> None:
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        mgr = CheckpointManager(ckpt_dir, "off", keep_last=1)
        mgr.save(1, {"w": torch.arange(8.0), "v": torch.ones(3)}, {"meta.json": "{}"}, blocking=True)
        mgr.close()
    finally:
        dist.destroy_process_group()


def _w1_save_then_w2_forked(_index: int, root: str) -> None:
    """A W=1 save, then a W=2 save by two processes forked from this one. Run in a fresh process (the fork server's,
    conftest.start_on_free_port): a fork of the pytest worker itself can deadlock (in CI, one hung for 25 minutes) on
    a lock held at the fork by a thread an earlier test left there (the object-store clients' pools)."""
    from conftest import start_on_free_port

    mgr = CheckpointManager(os.path.join(root, "w1"), "off", keep_last=1)
    mgr.save(1, {"w": torch.arange(6.0)}, {"meta.json": "{}"}, blocking=True)  # another state: a changed plan
    mgr.close()
    start_on_free_port(_w2_save, lambda port: (port, os.path.join(root, "w2")), nprocs=2, start_method="fork")


def test_save_plan_cache_is_per_checkpoint_dir_and_world_size(tmp_path):
    """DCP caches save plans process-wide under the planner's class name, and forked processes inherit the
    cache: a W=2 save forked after a W=1 save in this process got the W=1 plan (gloo scatter: 'Incorrect input
    list size 1') until the key named the checkpoint dir and the world size (ckpt/uploader.py save_planner)."""
    start_ranks(_w1_save_then_w2_forked, (str(tmp_path),), nprocs=1)
    assert verify_checkpoint(step_dir(str(tmp_path / "w2"), 1))["world_size"] == 2


class _NicenessProbe:
    """A checkpoint value that records the niceness of the thread that serializes it: the upload's."""

    seen: list = []

    def __deepcopy__(self, memo):  # staging copies it on the training thread: keep the object, record nothing
        return self

    def __reduce__(self):
        _NicenessProbe.seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        return (int, (0,))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread niceness is Linux's")
def test_async_upload_runs_at_upload_nice_and_the_training_thread_keeps_its_priority(tmp_path):
    """ckpt.upload_nice: the uploader thread writes (and checksums) at the asked niceness, so the training threads
    get the cores first; the training thread itself, which also runs the final (sync) save, is never lowered."""
    me = threading.get_native_id()
    before = os.getpriority(os.PRIO_PROCESS, me)
    for mode, nice in (("thread", 7), ("off", 7)):
        _NicenessProbe.seen = []
        mgr = CheckpointManager(str(tmp_path / mode), mode, keep_last=0, upload_nice=nice)
        try:
            mgr.save(1, {"w": torch.arange(10.0), "probe": _NicenessProbe()}, {"meta.json": "{}"})
            mgr.wait()
        finally:
            mgr.close()
        assert _NicenessProbe.seen == [max(nice, before) if mode == "thread" else before], mode
        assert os.getpriority(os.PRIO_PROCESS, me) == before


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread niceness is Linux's")
def test_memory_tier_copies_run_at_upload_nice(tmp_path):
    """The memory tier's committer thread (copies to peers, their checksums, the marker) takes ckpt.upload_nice
    like the uploads, so replication takes the cores training leaves."""
    before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    committer = NodeCommitter(str(tmp_path), None, 1, NodeLayout(0, 1, 1), 0, lambda *a, **k: None, print, nice=7)
    try:
        seen = committer._thread.submit(lambda: os.getpriority(os.PRIO_PROCESS, threading.get_native_id())).result()
    finally:
        committer.close()
    assert seen == max(7, before)
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == before


# ---------------------------------------------------------------- the process-mode uploader's guard (issue 58, point 10)

def test_the_uploaders_guard_closes_the_descriptors_that_are_open_not_every_number(monkeypatch):
    """The guard (ckpt/uploader.py _guard) holds none of the uploader's descriptors. It closes what /proc/self/fd
    lists: os.closerange(3, SC_OPEN_MAX) makes one close() per number on a Python without close_range, minutes at
    a nofile limit of ~1e9. Here a limit of 1e9 is reported and every close is counted, none made."""
    from ckpt import uploader
    closed, ranged = [], []
    monkeypatch.setattr(os, "sysconf", lambda name: 10**9 if name == "SC_OPEN_MAX" else os.sysconf(name))
    monkeypatch.setattr(os, "close", closed.append)
    monkeypatch.setattr(os, "closerange", lambda lo, hi: ranged.append(hi - lo))
    uploader.close_inherited_fds()
    assert ranged == [] and 0 < len(closed) < 1000 and min(closed) == 3, (ranged, len(closed))


def test_the_uploaders_guard_closes_a_high_descriptor():
    """In a forked child: a pipe's end moved to a high number is closed, stdin/stdout/stderr are kept."""
    import resource

    from ckpt import uploader
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    high = soft - 1
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.dup2(w, high)
            uploader.close_inherited_fds()
            try:
                os.fstat(high)
            except OSError:
                code = 0 if all(os.fstat(fd) for fd in (0, 1, 2)) else 2
        finally:
            os._exit(code)
    os.close(w)
    assert os.read(r, 1) == b"", "every write end was closed in the child, the high one too"
    os.close(r)
    assert os.waitpid(pid, 0)[1] == 0


def test_the_uploaders_exit_hook_is_registered_once(monkeypatch):
    """ckpt/uploader.py preemption_signals_blocked runs at every async save: its atexit hook, once per process."""
    import atexit

    from ckpt import uploader
    registered = []
    monkeypatch.setattr(atexit, "register", registered.append)
    uploader._stop_uploader_at_exit.cache_clear()
    try:
        for _ in range(3):
            with uploader.preemption_signals_blocked():
                pass
    finally:
        uploader._stop_uploader_at_exit.cache_clear()  # a later save in this process registers the real one
    assert registered == [uploader.stop_uploader_process]

"""Retention through <ckpt.dir>/.trash: each rank deletes its share, a sync save returns at its marker, a
leftover in the way of a save is swept before the save writes, nothing in .trash looks like a checkpoint.

    python -m pytest tests/test_retention.py -q

One test runs 2 gloo processes (torch.multiprocessing, spawn); the others run in this process, no process group.
"""

import json
import os
import sys
from types import SimpleNamespace

import torch
import torch.distributed.checkpoint as dcp

from ckpt import CheckpointManager, verify_checkpoint
from ckpt.__main__ import main as ckpt_cli
from ckpt.layout import COMMIT_FILE, is_marked_committed, list_step_dirs, step_dir, trash_dir
from ckpt.retention import apply_retention, clear_stale
from conftest import ROOT, start_on_free_port
from test_ckpt_unit import fake_checkpoint

sys.path.insert(0, ROOT)
SHARDS = 5  # data files per fake checkpoint, as if written by 5 ranks


def folder_checkpoint(root, step: int, files: int = SHARDS) -> str:
    """A committed-looking step folder: `files` shards, meta.json and a marker (the sweep never reads them)."""
    path = step_dir(str(root), step)
    os.makedirs(path)
    for name in [f"__{r}_0.distcp" for r in range(files)] + ["meta.json", COMMIT_FILE]:
        with open(os.path.join(path, name), "w") as f:
            f.write(json.dumps({"step": step}))
    return path


def _sweep_worker(rank, world_size, port, ckpt_dir, out):
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    removed, real_remove = [], os.remove

    def remove(path, *args, **kwargs):  # what this rank deletes in .trash (rank 0's last pass uses rmtree)
        if f"{os.sep}.trash{os.sep}" in str(path):
            removed.append(os.path.relpath(path, trash_dir(ckpt_dir)))
        return real_remove(path, *args, **kwargs)

    os.remove = remove
    try:
        events = []
        mgr = CheckpointManager(ckpt_dir, "off", keep_last=1, on_event=lambda n, **kw: events.append((n, kw)))
        mgr.committer.apply_retention(6)
        with open(f"{out}.{rank}", "w") as f:
            json.dump({"removed": removed, "events": events}, f)
        mgr.close()
    finally:
        os.remove = real_remove
        dist.destroy_process_group()


def test_each_rank_deletes_its_share_and_trash_ends_empty(tmp_path):
    ck = tmp_path / "ck"
    for s in (2, 4, 6):
        folder_checkpoint(ck, s)
    left = trash_dir(str(ck)) + "/step-000001.99-1"  # what a sweep killed halfway leaves: deleted by the next
    os.makedirs(left)
    open(os.path.join(left, "__0_0.distcp"), "w").close()
    in_trash = {f"step-00000{s}/__{r}_0.distcp" for s in (2, 4) for r in range(SHARDS)} | {
        f"step-00000{s}/meta.json" for s in (2, 4)} | {"step-000001/__0_0.distcp"}  # markers went first

    out = str(tmp_path / "removed")
    start_on_free_port(_sweep_worker, lambda port: (2, port, str(ck), out), nprocs=2)
    ranks = [json.load(open(f"{out}.{r}")) for r in range(2)]

    def logical(rel):  # step-000002.<pid>-<ns>/x -> step-000002/x
        top, rest = rel.split(os.sep, 1)
        return f"{top.split('.')[0]}/{rest}"
    per_rank = [{logical(p) for p in r["removed"]} for r in ranks]
    assert per_rank[0] | per_rank[1] == in_trash  # every file deleted by one of the ranks ...
    assert not per_rank[0] & per_rank[1]  # ... once
    assert abs(len(per_rank[0]) - len(per_rank[1])) <= 1  # each about half
    assert [s for s, _ in list_step_dirs(str(ck))] == [6] and not os.path.lexists(trash_dir(str(ck)))
    assert ranks[1]["events"] == []  # rank 0 reports
    (name, ev), = ranks[0]["events"]
    assert name == "retention" and ev["deleted"] == [step_dir(str(ck), 2), step_dir(str(ck), 4)]
    assert ev["files"] == len(in_trash) and ev["seconds"] >= 0


def test_sync_save_returns_at_its_marker_and_retention_follows(tmp_path, monkeypatch):
    """The sweep after save 2 waits for a file the test creates: save(blocking=True) must return before it."""
    ck, release = tmp_path / "ck", tmp_path / "release"
    monkeypatch.setenv("CKPT_FAULT", f"wait_for@sweep:2,file={release},secs=30")
    events, state = [], {"w": torch.arange(1000.0)}
    mgr = CheckpointManager(str(ck), "off", keep_last=1, on_event=lambda n, **kw: events.append((n, kw)))
    mgr.save(1, state, {"meta.json": "{}"}, blocking=True)
    mgr.wait()
    mgr.save(2, state, {"meta.json": "{}"}, blocking=True)
    assert is_marked_committed(step_dir(str(ck), 2))
    # step 1's files still exist (in place, or in .trash once moved, in that order: a rename is atomic), so the
    # sweep, which waits for `release`, is not part of the save's blocking time
    old, trash = step_dir(str(ck), 1), trash_dir(str(ck))
    assert os.path.isdir(old) or any(n.startswith("step-000001.") for n in os.listdir(trash)), "swept already"
    release.touch()
    mgr.wait()
    assert [s for s, _ in list_step_dirs(str(ck))] == [2] and not os.path.lexists(trash_dir(str(ck)))
    assert [n for n, _ in events] == ["checkpoint", "checkpoint", "retention"]
    assert events[1][1]["committed_s"] == events[1][1]["blocking_s"] and "retention_s" not in events[1][1]
    assert events[2][1]["step"] == 2 and events[2][1]["deleted"] == [step_dir(str(ck), 1)]
    mgr.close()


def test_failed_retention_is_a_warning_and_the_committed_step_is_not_saved_again(tmp_path, monkeypatch):
    """The sweep after step 2's commit fails (ENOSPC): wait() warns instead of raising, since a raise makes the
    loop's final save write step 2 again, which first moves the committed folder into .trash. The next sweep
    deletes what the failed one left."""
    from ckpt.loop import TrainingCheckpoints

    ck = tmp_path / "ck"
    monkeypatch.setenv("CKPT_FAULT", "oserror@sweep:2")
    events, logs, state = [], [], {"w": torch.arange(1000.0)}
    mgr = CheckpointManager(str(ck), "thread", keep_last=1, on_event=lambda n, **kw: events.append((n, kw)),
                            on_log=logs.append)
    mgr.save(1, state, {"meta.json": "{}"})
    mgr.save(2, state, {"meta.json": "{}"})  # waits for save 1; its own sweep fails in the background
    options = type("Options", (), dict(interval=0, interval_minutes=0, mtbf_hours=0, save_at_end=True,
                                       continue_on_save_error=False))()
    loop = TrainingCheckpoints(mgr, options, 2, SimpleNamespace(info=logs.append,
                                                                event=lambda n, **kw: events.append((n, kw))))
    loop.track(state, lambda step: {"meta.json": "{}"})
    loop.finish(2)  # drains save 2 (retention fails: a warning), does not save step 2 again
    assert [n for n, _ in events].count("checkpoint") == 2, events
    assert ("retention_failed", {"step": 2, "error": events[-1][1]["error"]}) == events[-1]
    assert "No space left" in events[-1][1]["error"] or "ENOSPC" in events[-1][1]["error"], events[-1]
    assert any(line.startswith("warning: checkpoint step 2 is committed, but deleting old checkpoints after it "
                               "failed: ") for line in logs), logs
    assert verify_checkpoint(step_dir(str(ck), 2))["step"] == 2
    assert [s for s, _ in list_step_dirs(str(ck))] == [2] and os.listdir(trash_dir(str(ck)))  # step 1 waits there
    monkeypatch.delenv("CKPT_FAULT")
    mgr = CheckpointManager(str(ck), "off", keep_last=1)
    mgr.save(3, state, {"meta.json": "{}"}, blocking=True)
    mgr.close()
    assert [s for s, _ in list_step_dirs(str(ck))] == [3] and not os.path.lexists(trash_dir(str(ck)))


def test_leftover_in_the_way_is_swept_before_the_save_writes(tmp_path, monkeypatch):
    ck = tmp_path / "ck"
    folder_checkpoint(ck, 2)  # e.g. skipped as corrupt on resume; this job reached step 2 again
    seen, real_save = [], dcp.save

    def save(*args, **kwargs):
        seen.append(sorted(os.listdir(ck)))
        return real_save(*args, **kwargs)
    monkeypatch.setattr(dcp, "save", save)
    logs = []
    mgr = CheckpointManager(str(ck), "off", on_log=logs.append)
    mgr.save(2, {"w": torch.ones(10)}, {"meta.json": "{}"}, blocking=True)
    mgr.close()
    assert seen == [["step-000002"]]  # the leftover went through .trash, and .trash was gone before the write
    assert any("into .trash" in line and "step-000002" in line for line in logs), logs
    verify_checkpoint(step_dir(str(ck), 2))
    assert not os.path.lexists(trash_dir(str(ck)))


def test_leftover_that_cannot_be_renamed_is_moved_aside(tmp_path, monkeypatch):
    ck = tmp_path / "ck"
    path = folder_checkpoint(ck, 2)
    real_rename = os.rename

    def rename(src, dst):
        if f"{os.sep}.trash{os.sep}" in dst:
            raise PermissionError(13, "Permission denied")
        return real_rename(src, dst)
    monkeypatch.setattr(os, "rename", rename)
    logs = []
    assert clear_stale(path, logs.append) is False
    aside = [n for n in os.listdir(ck) if n.startswith("step-000002.damaged-")]
    assert len(aside) == 1 and not os.path.lexists(path) and "moved damaged" in logs[0]
    assert not is_marked_committed(os.path.join(ck, aside[0]))  # the marker went first


def test_nothing_in_trash_looks_committed_or_is_listed(tmp_path, capsys):
    """A sweep killed before it deleted anything: the old checkpoints are in .trash, unmarked, and neither
    resume nor `python -m ckpt inspect` sees them."""
    ck = tmp_path / "ck"
    for s in (2, 4):
        fake_checkpoint(ck, s)
    assert apply_retention(str(ck), 4, 1, 0, print) == [step_dir(str(ck), 2)]  # moved, not yet swept
    moved = os.listdir(trash_dir(str(ck)))
    assert len(moved) == 1 and not is_marked_committed(os.path.join(trash_dir(str(ck)), moved[0]))
    assert [s for s, _ in list_step_dirs(str(ck))] == [4]
    capsys.readouterr()
    assert ckpt_cli(["inspect", str(ck)]) == 0
    rows = capsys.readouterr().out.splitlines()[1:]
    assert len(rows) == 1 and rows[0].split()[0] == "4", rows
    assert CheckpointManager(str(ck), "off").choose_checkpoint("auto") == step_dir(str(ck), 4)


def test_retention_without_a_rename_deletes_in_place_but_never_a_marked_folder(tmp_path, monkeypatch):
    ck = tmp_path / "ck"
    for s in (2, 4, 6):
        folder_checkpoint(ck, s)
    real_rename, real_remove = os.rename, os.remove

    def rename(src, dst):  # e.g. a step folder that is a mount point of its own
        if f"{os.sep}.trash{os.sep}" in dst:
            raise OSError(18, "Invalid cross-device link")
        return real_rename(src, dst)

    def remove(path, *args, **kwargs):  # step 2's marker cannot be removed
        if str(path).endswith(f"step-000002{os.sep}{COMMIT_FILE}"):
            raise PermissionError(13, "Permission denied")
        return real_remove(path, *args, **kwargs)
    monkeypatch.setattr(os, "rename", rename)
    monkeypatch.setattr(os, "remove", remove)
    logs = []
    assert apply_retention(str(ck), 6, 1, 0, logs.append) == [step_dir(str(ck), 4)]
    assert [s for s, _ in list_step_dirs(str(ck))] == [2, 6]
    assert len(os.listdir(step_dir(str(ck), 2))) == SHARDS + 2  # kept whole, marker and all
    assert "cannot remove the commit marker" in logs[0] and "deleting it in place" in logs[1], logs

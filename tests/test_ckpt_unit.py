"""Checkpoint logic without a process group: commit marker, verify, retention, lock, resume choice.

    python -m pytest tests/test_ckpt_unit.py -q
"""

import json
import os

import pytest

from ckpt.commit import VerifyError, commit_checkpoint, verify_checkpoint
from ckpt.layout import COMMIT_FILE, list_step_dirs, step_dir
from ckpt.manager import CheckpointError, CheckpointManager


def fake_checkpoint(root, step, commit=True):
    path = step_dir(str(root), step)
    os.makedirs(path)
    for name, data in ((".metadata", b"meta"), ("__0_0.distcp", os.urandom(4096)), ("__1_0.distcp", b"x" * 100)):
        with open(os.path.join(path, name), "wb") as f:
            f.write(data)
    with open(os.path.join(path, "meta.json"), "w") as f:
        json.dump({"step": step, "world_size": 2}, f)
    if commit:
        commit_checkpoint(path, world_size=2)
    return path


def test_marker_lists_every_file_and_verifies(tmp_path):
    path = fake_checkpoint(tmp_path, 5)
    marker = verify_checkpoint(path)
    assert marker["step"] == 5 and set(marker["files"]) == {".metadata", "__0_0.distcp", "__1_0.distcp", "meta.json"}
    assert not [n for n in os.listdir(path) if ".tmp" in n]  # the tmp marker was renamed away


@pytest.mark.parametrize("damage,needle", [
    (lambda p: os.remove(os.path.join(p, COMMIT_FILE)), "missing commit marker"),
    (lambda p: open(os.path.join(p, COMMIT_FILE), "w").write("{not json"), "corrupt commit marker"),
    (lambda p: os.truncate(os.path.join(p, "__0_0.distcp"), 100), "__0_0.distcp: size 100 != 4096"),
    (lambda p: os.remove(os.path.join(p, "__1_0.distcp")), "__1_0.distcp: missing"),
    (lambda p: open(os.path.join(p, "__1_0.distcp"), "r+b").write(b"y"), "__1_0.distcp: checksum mismatch"),
    (lambda p: open(os.path.join(p, "__9_0.distcp"), "wb").write(b"z"), "__9_0.distcp: data file not in manifest"),
])
def test_verify_names_the_damage(tmp_path, damage, needle):
    path = fake_checkpoint(tmp_path, 5)
    damage(path)
    with pytest.raises(VerifyError, match=needle.replace(".", r"\.")):
        verify_checkpoint(path)


def test_retention_never_touches_newest_or_inflight(tmp_path):
    for s in (2, 4, 6):
        fake_checkpoint(tmp_path, s)
    fake_checkpoint(tmp_path, 1, commit=False)   # dead partial from an older crash
    fake_checkpoint(tmp_path, 8, commit=False)   # in flight: newer than every commit
    mgr = CheckpointManager(str(tmp_path), "off", keep_last=2)
    mgr._apply_retention(newest=6)
    assert [s for s, _ in list_step_dirs(str(tmp_path))] == [4, 6, 8]
    mgr.keep_last = 1
    mgr._apply_retention(newest=6)
    assert [s for s, _ in list_step_dirs(str(tmp_path))] == [6, 8]


def test_keep_last_zero_keeps_all_committed(tmp_path):
    for s in (2, 4, 6):
        fake_checkpoint(tmp_path, s)
    CheckpointManager(str(tmp_path), "off", keep_last=0)._apply_retention(newest=6)
    assert [s for s, _ in list_step_dirs(str(tmp_path))] == [2, 4, 6]


def test_find_resume_walks_back_and_logs(tmp_path):
    fake_checkpoint(tmp_path, 2)
    bad = fake_checkpoint(tmp_path, 4)
    os.truncate(os.path.join(bad, "__1_0.distcp"), 1)
    fake_checkpoint(tmp_path, 6, commit=False)
    logs = []
    mgr = CheckpointManager(str(tmp_path), "off", on_log=logs.append)
    assert mgr.find_resume("auto") == step_dir(str(tmp_path), 2)
    assert len(logs) == 2 and "step-000006" in logs[0] and "step-000004" in logs[1]
    assert mgr.find_resume("none") is None
    with pytest.raises(CheckpointError, match="cannot resume from"):
        mgr.find_resume(step_dir(str(tmp_path), 4))


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

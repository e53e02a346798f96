"""The memory tier (ckpt.memory_interval): a rank killed under torchrun --max-restarts resumes from RAM, bit for bit;
a memory step resumes at another world size; a damaged one is skipped; a short folder turns the tier off.

    python -m pytest tests/test_memory_tier.py -q

Run A trains at W=2 to step 12 with a memory step every step and a disk step every 10. Run B is A with rank 1
SIGKILLed after step K+1 (once memory step K is marked) under `torchrun --max-restarts 1`: torchrun restarts both
ranks, which resume from memory step K. Run C is killed the same way without restarts; its memory folder then
resumes at W=1 (a new job), and, with its newest step damaged, at the older one. A kill while a memory save is
still being copied loses 2N steps (memory_interval=N), the bound docs/memory-tier.md states, and no more.
"""

import os
import pickle
import shutil

import numpy
import pytest
import torch

from ckpt import verify_checkpoint
from ckpt.memory_tier.tier import default_memory_dir, memory_shortfall
from ckpt.reading import read_items
from ckpt.memory_tier.replicate import make_step_dir
import train_fsdp
from conftest import ROOT, events, losses, run_train
from finetune.metrics import read_metrics
from torch.distributed.checkpoint import FileSystemReader

K = 7  # not a multiple of the disk interval
RUN = ["train.max_steps=12", "ckpt.interval=10", "ckpt.memory_interval=1", "ckpt.keep_last=0"]


def with_memory(run_dir, keep: int = 1) -> list[str]:
    return [*RUN, f"ckpt.memory_dir={run_dir}-mem", f"ckpt.memory_keep={keep}"]


def kill_after_memory_step(run_dir, step: int, **only) -> str:
    """CKPT_FAULT: after step `step` + 1, wait for memory step `step`'s marker, then SIGKILL (`only`: rank=, attempt=)."""
    opts = "".join(f",{k}={v}" for k, v in only.items())
    marker = f"{run_dir}-mem/step-{step:06d}/commit.json"
    return f"wait_for@after_step:{step + 1},secs=120,file={marker}{opts};kill@after_step:{step + 1}{opts}"


def damage_step(path: str, damage: str) -> None:
    """Damage rank 1's shard of checkpoint folder `path` (a flipped byte, or the file missing), or its marker."""
    if damage == "flipped_byte":
        with open(os.path.join(path, "__1_0.distcp"), "r+b") as f:
            f.seek(100)
            byte = f.read(1)
            f.seek(100)
            f.write(bytes([byte[0] ^ 0xFF]))
    else:
        os.remove(os.path.join(path, "__1_0.distcp" if damage == "missing_file" else "commit.json"))


def step_records(run_dir) -> dict[int, dict]:
    return read_metrics(os.path.join(str(run_dir), "metrics.jsonl"))[0]


def same_item(a, b) -> bool:
    """Tensors, plain values, and RNG blobs by their unpickled states (the pickled bytes may differ)."""
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, bytes):
        a, b = pickle.loads(a), pickle.loads(b)
        return (a["python"] == b["python"] and torch.equal(a["torch"], b["torch"])
                and all(numpy.array_equal(x, y) for x, y in zip(a["numpy"], b["numpy"])))
    return a == b


def final_items(run_dir) -> dict:
    path = str(run_dir / "checkpoints" / "step-000012")
    verify_checkpoint(path)
    return read_items(path, list(FileSystemReader(path).read_metadata().state_dict_metadata))


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("memory_tier")
    run_train(root / "a", 2, with_memory(root / "a"))
    c = run_train(root / "c", 2, with_memory(root / "c", keep=2), env={"CKPT_FAULT": kill_after_memory_step(root / "c", K)},
                  check=False)
    assert c.returncode != 0, "the fault should have killed run C"
    return root


def test_a_killed_rank_restarts_and_resumes_from_memory_bit_for_bit(root):
    b = root / "b"
    proc = run_train(b, 2, with_memory(b), env={"CKPT_FAULT": kill_after_memory_step(b, K, rank=1, attempt=0)},
                     restarts=1)
    resumed = events(b, "resume")
    assert [(e["step"], e["tier"]) for e in resumed] == [(K, "memory")], proc.stdout[-3000:]
    assert sum(f"resume: memory tier, step {K}" in ln for ln in proc.stdout.splitlines()) == 1, proc.stdout[-3000:]
    assert losses(b) == losses(root / "a") and sorted(losses(b)) == list(range(1, 13))
    before, after = final_items(root / "a"), final_items(b)
    assert sorted(before) == sorted(after) and any(".optim.state." in k for k in before)
    for k in before:
        assert same_item(before[k], after[k]), f"{k} differs from the uninterrupted run's final state"
    assert not os.path.exists(f"{b}-mem") and not os.path.exists(f"{root / 'a'}-mem"), "exit 0 removes the folder"


def test_memory_steps_resume_at_another_world_size(root, tmp_path):
    assert sorted(os.listdir(f"{root / 'c'}-mem"))[-2:] == [f"step-{K - 1:06d}", f"step-{K:06d}"]
    shutil.copytree(f"{root / 'c'}-mem", f"{tmp_path / 'w1'}-mem")  # a new job (W=1) on the node's memory folder
    proc = run_train(tmp_path / "w1", 0, with_memory(tmp_path / "w1"))
    assert [(e["step"], e["tier"], e["saved_world_size"]) for e in events(tmp_path / "w1", "resume")] == [(K, "memory", 2)]
    a, r = step_records(root / "a"), step_records(tmp_path / "w1")
    assert sorted(r) == list(range(K + 1, 13)), proc.stdout[-2000:]
    for s in r:
        assert r[s]["sample_ids"] == a[s]["sample_ids"], f"step {s}: a different global batch than run A"
        assert r[s]["loss"] == pytest.approx(a[s]["loss"], rel=1e-4), f"step {s}: loss left run A's trajectory"


@pytest.mark.parametrize("damage", ["flipped_byte", "missing_file", "missing_marker"])
def test_a_damaged_memory_step_is_skipped(root, tmp_path, damage):
    mem = f"{tmp_path / 'd'}-mem"
    shutil.copytree(f"{root / 'c'}-mem", mem)
    newest = os.path.join(mem, f"step-{K:06d}")
    damage_step(newest, damage)
    proc = run_train(tmp_path / "d", 2, [*with_memory(tmp_path / "d"), "train.max_steps=8"])
    assert [(e["step"], e["tier"]) for e in events(tmp_path / "d", "resume")] == [(K - 1, "memory")]
    line = next(ln for ln in proc.stdout.splitlines() if "resume: memory tier" in ln)
    assert f"step {K - 1}" in line and f"skipped newer memory steps: step {K}" in line, line
    assert sum("skipping" in ln and newest in ln for ln in proc.stdout.splitlines()) == 1, proc.stdout[-3000:]


@pytest.mark.parametrize("moment", ["partial_write", "before_commit"])
def test_a_kill_during_a_memory_save_leaves_no_marked_partial_step(root, tmp_path, moment):
    """SIGKILL while memory step 5 is written (a torn shard) or before its marker: step 4 is the newest marked one,
    every marked step verifies, and the next job resumes there and continues like run A."""
    run = tmp_path / "k"
    marker = f"{run}-mem/step-000004/commit.json"
    fault = f"wait_for@after_step:5,secs=120,file={marker};kill@{moment}:5,rank={1 if moment == 'partial_write' else 0}"
    assert run_train(run, 2, with_memory(run, keep=2), env={"CKPT_FAULT": fault}, check=False).returncode != 0
    marked = [d for d in sorted(os.listdir(f"{run}-mem")) if os.path.exists(f"{run}-mem/{d}/commit.json")]
    assert marked[-1] == "step-000004", marked
    for d in marked:
        verify_checkpoint(f"{run}-mem/{d}")
    run_train(run, 2, with_memory(run, keep=2))
    assert [(e["step"], e["tier"]) for e in events(run, "resume")] == [(4, "memory")]
    assert losses(run) == losses(root / "a")


@pytest.mark.parametrize("n", [1, 2])
def test_a_kill_loses_at_most_two_memory_intervals(tmp_path, n):
    """docs/memory-tier.md's bound, at its worst: with memory_interval=N, memory step 6 is still being copied and
    marked (held before its replication) when every rank is SIGKILLed right after step 6 + N, before that step's
    save begins. The restart resumes from memory step 6 - N, the newest marked (step 6's save began only once it
    was): 2N steps lost, never more, and more than the N that the memory interval alone suggests."""
    run, held, killed = tmp_path / "n", 6, 6 + n
    fault = f"sleep@replicate:{held},secs=300,attempt=0;kill@after_step:{killed},attempt=0"
    proc = run_train(run, 2, [*with_memory(run), f"ckpt.memory_interval={n}"], env={"CKPT_FAULT": fault}, restarts=1)
    resumed = [(e["step"], e["tier"]) for e in events(run, "resume")]
    assert resumed == [(killed - 2 * n, "memory")], proc.stdout[-3000:]
    assert sorted(losses(run)) == list(range(1, 13))


def test_a_disk_step_newer_than_memory_wins(root, tmp_path):
    """Memory step K, disk step 10: a resume takes the disk one, and says why."""
    shutil.copytree(root / "a" / "checkpoints" / "step-000010", tmp_path / "e" / "checkpoints" / "step-000010")
    shutil.copytree(f"{root / 'c'}-mem", f"{tmp_path / 'e'}-mem")
    proc = run_train(tmp_path / "e", 2, with_memory(tmp_path / "e"))
    assert [(e["step"], e["tier"]) for e in events(tmp_path / "e", "resume")] == [(10, "disk")]
    assert f"resume: disk tier, step 10 (newest recoverable memory step: step {K})" in proc.stdout
    assert losses(tmp_path / "e") == {s: v for s, v in losses(root / "a").items() if s > 10}


def test_memory_shortfall_names_what_is_short():
    gib = 2**30
    assert memory_shortfall(gib, 2, 1, "/dev/shm/x", 5 * gib, 0, 8 * gib) is None  # 2 ranks x 2 steps x 1 GiB
    why = memory_shortfall(gib, 2, 1, "/dev/shm/x", 3 * gib, 0, 8 * gib)
    assert why == "2 ranks x 2 steps x 1.00 GiB need 4.00 GiB in /dev/shm/x, 3.00 GiB free"
    assert memory_shortfall(gib, 2, 1, "/dev/shm/x", 3 * gib, 1 * gib, 8 * gib) is None  # old steps get freed
    assert "of RAM" in memory_shortfall(gib, 2, 2, "/dev/shm/x", 9 * gib, 0, 5 * gib)
    assert memory_shortfall(gib, 2, 2, "/nvme/x", 9 * gib, 0, None) is None  # not in RAM: the disk's room only
    why = memory_shortfall(gib, 2, 1, "/dev/shm/x", 5 * gib, 0, 8 * gib, replicas=1)  # a peer's copy doubles it
    assert why == "2 ranks x 2 steps x (1 + 1 replica) x 1.00 GiB need 8.00 GiB in /dev/shm/x, 5.00 GiB free"
    # async staging, not allocated yet, beside the steps: 4 GiB of RAM, 2 of them files in the same tmpfs
    assert memory_shortfall(gib, 2, 1, "/dev/shm/x", 6 * gib, 0, 8 * gib, staging=(4 * gib, 2 * gib)) is None
    why = memory_shortfall(gib, 2, 1, "/dev/shm/x", 5 * gib, 0, 9 * gib, staging=(4 * gib, 2 * gib))
    assert why == "2 ranks x 2 steps x 1.00 GiB need 4.00 GiB (+ 2.00 GiB to stage async saves) in /dev/shm/x, 5.00 GiB free"
    why = memory_shortfall(gib, 2, 1, "/dev/shm/x", 9 * gib, 0, 7 * gib, staging=(4 * gib, 0))
    assert why == ("2 ranks x 2 steps x 1.00 GiB need 4.00 GiB (+ 4.00 GiB to stage async saves) of RAM (/dev/shm/x "
                   "is in memory), 7.00 GiB available (MemAvailable or, if smaller, the memory cgroup limit less its "
                   "use)")
    assert memory_shortfall(gib, 2, 2, "/nvme/x", 6 * gib, 0, None, staging=(4 * gib, 0)) is None  # RAM: not its


def test_a_folder_too_small_turns_the_tier_off_at_start(tmp_path):
    """A memory_dir on a full filesystem: one line at start, then training as without the tier."""
    proc = run_train(tmp_path / "f", 0, [*RUN, "train.max_steps=3", "ckpt.memory_dir=/proc/fsdp-ckpt-test"])
    off = [ln for ln in proc.stdout.splitlines() if "ckpt.memory_interval=1 -> off" in ln]
    assert len(off) == 1 and "GiB free" in off[0], proc.stdout[-2000:]
    assert [e["event"] for e in events(tmp_path / "f", "memory_tier_off")] == ["memory_tier_off"]
    assert sorted(losses(tmp_path / "f")) == [1, 2, 3]


@pytest.mark.skipif(os.getuid() != 0, reason="giving a folder to another user needs root")
def test_a_memory_folder_of_another_user_turns_the_tier_off(tmp_path):
    """The default folder's name is predictable: one that another user made first is not written into."""
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, 65534, 65534)
    tmp_path.chmod(0o755)  # the job runs as root anyway; the folder's owner is what is checked
    proc = run_train(tmp_path / "f", 0, [*RUN, "train.max_steps=2", f"ckpt.memory_dir={theirs}"])
    off = [ln for ln in proc.stdout.splitlines() if "ckpt.memory_interval=1 -> off" in ln]
    assert len(off) == 1 and f"{theirs} belongs to another user (uid 65534)" in off[0], proc.stdout[-2000:]
    assert os.listdir(theirs) == [] and sorted(losses(tmp_path / "f")) == [1, 2]


def test_a_run_without_the_tier_that_ends_normally_removes_an_earlier_attempts_memory_steps(tmp_path):
    """A job that crashed with the tier on and reran with it off: its steps would hold tmpfs pages until a reboot."""
    mem = tmp_path / "mem"
    (mem / "step-000003").mkdir(parents=True)
    (mem / "step-000003" / "__0_0.distcp").write_bytes(b"x" * 1000)
    proc = run_train(tmp_path / "f", 2, ["train.max_steps=2", "ckpt.memory_interval=0", f"ckpt.memory_dir={mem}"])
    assert not mem.exists()
    line = f"memory tier: removed 1 folder of an earlier attempt's memory steps from {mem}"
    assert sum(line in ln for ln in proc.stdout.splitlines()) == 1, proc.stdout[-2000:]
    (mem / "step-000003").mkdir(parents=True)
    (mem / "notes.txt").write_text("not the tier's")  # a memory_dir set to a folder that holds other things
    run_train(tmp_path / "g", 0, ["train.max_steps=2", "ckpt.memory_interval=1", f"ckpt.memory_dir={mem}"])
    assert os.listdir(mem) == ["notes.txt"]
    proc = run_train(tmp_path / "h", 0, ["train.max_steps=1", f"ckpt.memory_dir={mem}"])  # nothing of the tier's
    assert os.listdir(mem) == ["notes.txt"] and "memory tier" not in proc.stdout


def test_a_memory_folder_made_by_the_tier_is_this_users_alone(tmp_path):
    make_step_dir(str(tmp_path / "memory" / "step-000001"), {"meta.json": "{}"}, str(tmp_path / "memory" / "spare"),
                  frozenset())
    assert (tmp_path / "memory").stat().st_mode & 0o777 == 0o700
    assert (tmp_path / "memory" / "step-000001" / "meta.json").read_text() == "{}"


def test_default_memory_dir_is_per_ckpt_dir_and_in_shm(tmp_path):
    one, two = default_memory_dir(str(tmp_path / "a")), default_memory_dir(str(tmp_path / "b"))
    assert one.startswith("/dev/shm/fsdp-ckpt-") and one != two
    assert default_memory_dir(str(tmp_path / "a" / ".")) == one


def test_plan_shows_the_memory_tier_per_node(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)  # the preset's asset paths are relative to the repository
    tiny = os.path.join(ROOT, "configs", "tiny.yaml")
    assert train_fsdp.main(["--config", tiny, "--plan", "ckpt.memory_interval=1"]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("memory tier"))
    assert "per node in /dev/shm ((memory_keep 1 + 1) x 2 ranks x" in line  # tiny.yaml's plan: 1 node x 2 CPU ranks
    assert train_fsdp.main(["--config", tiny, "--plan", "--nodes", "2", "ckpt.memory_interval=1"]) == 0
    assert "((memory_keep 1 + 1) x (1 + 1 replica) x 2 ranks x" in capsys.readouterr().out

"""Process-mode staging preflight: descriptors, /dev/shm and RAM against the staging need; fallback to thread. RAM
is the node's MemAvailable or the memory cgroup's room, the smaller: read from fake cgroup trees (v2, v1, nested, a
hybrid host without v2's memory controller), and for real, a run in a memory cgroup whose limit holds the run but not
its memory tier: the tier is refused in one line and the run ends 0, where without the check it is OOM-killed.

    python -m pytest tests/test_preflight.py -q -n 0        # the real cgroup: root, a writable memory cgroup
"""

import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from conftest import FAST, ROOT, token_cache
from ckpt.preflight import FD_MARGIN, cgroup_memory_room, shortfall

GIB = 2**30


@pytest.mark.parametrize("limits, expect", [
    ((100_000, 128 * GIB, 256 * GIB), None),  # needs 8 x 10.5 GB = 78 GiB per node
    ((1024, 128 * GIB, 256 * GIB), "open files per rank, the limit is 1024"),
    ((100_000, 64 * 2**20, 256 * GIB), "in /dev/shm"),  # a container's default 64 MB /dev/shm
    ((100_000, 128 * GIB, 64 * GIB), "of RAM"),
])
def test_shortfall_names_what_is_short(limits, expect):
    # 7B on 8 GPUs per node, W=8: 291 parameter tensors x 4, 12 bytes x 7e9 / 8 per rank
    reason = shortfall(4 * 291, 12 * 7 * 10**9 // 8, 8, *limits)
    assert (reason is None) if expect is None else (expect in reason)


def test_fd_margin_counts():
    assert shortfall(1024 - FD_MARGIN, 1, 1, 1024, GIB, GIB) is None
    assert shortfall(1024 - FD_MARGIN + 1, 1, 1, 1024, GIB, GIB) is not None


PROBE = """
import resource, sys
sys.path.insert(0, {root!r})
resource.setrlimit(resource.RLIMIT_NOFILE, (200, 300))  # soft below hard: the preflight raises it
from ckpt import CheckpointManager
lines = []
mgr = CheckpointManager({ckpt!r}, "process", on_log=lines.append)
mgr.check_staging(n_tensors={n}, nbytes=1000, local_ranks=1)
print(resource.getrlimit(resource.RLIMIT_NOFILE)[0], mgr.async_mode, "|".join(lines))
"""


@pytest.mark.parametrize("n_tensors, mode", [(300 - FD_MARGIN, "process"), (300 - FD_MARGIN + 1, "thread")])
def test_manager_raises_soft_limit_then_falls_back_to_thread_mode(tmp_path, n_tensors, mode):
    out = subprocess.run([sys.executable, "-c", PROBE.format(root=ROOT, ckpt=str(tmp_path), n=n_tensors)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    soft, got_mode, log = out.stdout.split(" ", 2)
    assert soft == "300" and got_mode == mode
    if mode == "thread":
        assert log.startswith("ckpt.async_mode=process -> thread: ") and "the limit is 300" in log
    else:
        assert log.strip() == ""


# ---------------------------------------------------------------- the memory cgroup's room

def fake_tree(tmp_path, proc_cgroup: str, files: dict[str, str]) -> tuple[str, str]:
    root = tmp_path / "cgroup"
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    (tmp_path / "self-cgroup").write_text(proc_cgroup)
    return str(root), str(tmp_path / "self-cgroup")


def test_cgroup_room_is_the_smallest_limit_less_use_over_the_levels(tmp_path):
    mib = 2**20
    v2 = {"cgroup.controllers": "cpu memory io",
          "kubepods/pod1/memory.max": str(1000 * mib), "kubepods/pod1/memory.current": str(300 * mib),
          "kubepods/pod1/memory.stat": f"anon 1\ninactive_file {100 * mib}\n",
          "kubepods/pod1/ctr/memory.max": "max", "kubepods/pod1/ctr/memory.current": str(250 * mib)}
    root, proc = fake_tree(tmp_path / "a", "0::/kubepods/pod1/ctr\n", v2)
    assert cgroup_memory_room(root, proc) == 800 * mib, "the pod's limit less its use, page cache not counted"
    v2["kubepods/pod1/ctr/memory.max"] = str(400 * mib)
    root, proc = fake_tree(tmp_path / "b", "0::/kubepods/pod1/ctr\n", v2)
    assert cgroup_memory_room(root, proc) == 150 * mib, "the container's own limit is the smaller"
    root, proc = fake_tree(tmp_path / "c", "0::/\n", {"cgroup.controllers": "memory", "memory.max": "max",
                                                         "memory.current": "5"})
    assert cgroup_memory_room(root, proc) is None, "no limit"
    hybrid = {"unified/cgroup.controllers": "hugetlb", "memory/memory.usage_in_bytes": "1",
              "memory/ctr/memory.limit_in_bytes": str(512 * mib), "memory/ctr/memory.usage_in_bytes": str(112 * mib),
              "memory/ctr/memory.stat": f"cache 5\ntotal_inactive_file {12 * mib}\n",
              "memory/memory.limit_in_bytes": "9223372036854771712"}
    root, proc = fake_tree(tmp_path / "d", "4:memory:/ctr\n0::/\n", hybrid)
    assert cgroup_memory_room(root, proc) == 412 * mib, "cgroup v1, where v2 has no memory controller"
    assert cgroup_memory_room(root, str(tmp_path / "missing")) is None


def memory_cgroup(name: str, limit: int) -> str | None:
    """A new memory cgroup below this process's own with `limit` bytes (v2 if its hierarchy has the memory
    controller, else v1), or None where this machine gives none (not root, no memory controller)."""
    if os.geteuid() != 0:
        return None
    with open("/proc/self/cgroup") as f:
        lines = [ln.rstrip("\n").split(":", 2) for ln in f]
    v2 = next((p for h, c, p in lines if h == "0" and c == ""), None)
    v1 = next((p for _, c, p in lines if "memory" in c.split(",")), None)
    tries = []
    if v2 is not None:
        tries.append(("/sys/fs/cgroup" + v2.rstrip("/"), "memory.max"))
    if v1 is not None:
        tries.append(("/sys/fs/cgroup/memory" + v1.rstrip("/"), "memory.limit_in_bytes"))
    for parent, limit_file in tries:
        folder = os.path.join(parent, name)
        try:
            if limit_file == "memory.max":
                with open("/sys/fs/cgroup/cgroup.controllers") as f:
                    if "memory" not in f.read().split():
                        continue
                with open(os.path.join(parent, "cgroup.subtree_control"), "w") as f:
                    f.write("+memory")
            os.mkdir(folder)
            with open(os.path.join(folder, limit_file), "w") as f:
                f.write(str(limit))
            return folder
        except OSError:
            if os.path.isdir(folder):
                os.rmdir(folder)
    return None


def peak_bytes(folder: str) -> int:
    for name in ("memory.peak", "memory.max_usage_in_bytes"):
        if os.path.exists(os.path.join(folder, name)):
            with open(os.path.join(folder, name)) as f:
                return int(f.read())
    return 0


def in_cgroup(folder: str, *cmd: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(["sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', folder, *cmd],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})


def remove_cgroup(folder: str) -> None:
    for _ in range(50):  # the last task's exit reaches the cgroup a moment later
        try:
            os.rmdir(folder)
            return
        except OSError:
            time.sleep(0.1)


def test_a_tier_the_containers_memory_limit_cannot_hold_is_refused_in_one_line_not_oom_killed(tmp_path):
    """A one-rank run (a 25M-parameter model, 289 MiB of state) in a memory cgroup whose limit holds the run itself,
    measured first without the tier in a cgroup without a limit (its peak + 256 MiB), but not its memory tier
    (memory_keep 2: 3 steps in /dev/shm, charged to the cgroup, and the tier's staging: 1.13 GiB): the tier turns
    off in one line naming the cgroup limit and the run ends 0. With the cgroup's room not read, the node's
    MemAvailable lets the tier on and the run is OOM-killed (exit -9; checked by hand, docs/memory-tier.md)."""
    probe = memory_cgroup(f"fsdp-test-{os.getpid()}-probe", 2**40)
    if probe is None:
        pytest.skip("no memory cgroup to make here (needs root and a memory controller, v2 or v1)")
    model = tmp_path / "model"
    shutil.copytree(os.path.join(ROOT, "assets", "tiny-llama"), model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "intermediate_size": 65536}))  # 25M params: 289 MiB
    memory_dir = f"/dev/shm/fsdp-test-tier-{os.getpid()}"
    args = [sys.executable, "train_fsdp.py", "--config", "configs/tiny.yaml", *FAST, f"data.cache_dir={token_cache()}",
            f"model.config_path={model}", "train.max_steps=3", "train.eval_interval=0", "ckpt.interval=0",
            "ckpt.save_at_end=false", "ckpt.async_mode=off", "ckpt.memory_keep=2", f"ckpt.memory_dir={memory_dir}"]
    try:
        alone = in_cgroup(probe, *args, f"run.dir={tmp_path / 'alone'}", "ckpt.memory_interval=0")
        assert alone.returncode == 0, alone.stderr[-3000:]
        peak = peak_bytes(probe)
    finally:
        remove_cgroup(probe)
    folder = memory_cgroup(f"fsdp-test-{os.getpid()}", peak + 256 * 2**20)  # 64 MiB: OOM-killed once in CI
    try:
        out = in_cgroup(folder, *args, f"run.dir={tmp_path / 'run'}", "ckpt.memory_interval=1")
    finally:
        shutil.rmtree(memory_dir, ignore_errors=True)
        remove_cgroup(folder)
    assert out.returncode == 0, f"exit {out.returncode} (-9: OOM-killed)\n{out.stdout[-3000:]}{out.stderr[-3000:]}"
    off = [ln for ln in out.stdout.splitlines() if "ckpt.memory_interval=1 -> off:" in ln]
    assert len(off) == 1 and "memory cgroup limit" in off[0] and "of RAM" in off[0], out.stdout[-3000:]

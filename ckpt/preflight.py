"""Before the first async save: can this node stage every rank's checkpoint in shared memory?

    python -m pytest tests/test_preflight.py -q

Process mode (`ckpt.async_mode=process`) stages each rank's state in /dev/shm so the uploader process
reads it without a copy, and keeps one open file descriptor per staged tensor for the life of the job
(per parameter tensor: the parameter and its optimizer state's tensors, 4 with AdamW: exp_avg, exp_avg_sq,
step; 2 with SGD's momentum). So per node it needs about  (4 + S) bytes x params / W x (ranks on the node)  of
/dev/shm and of RAM, S the optimizer's state bytes per parameter (AdamW 8: 12 in all; SGD 4: 8), and per rank
about that many descriptors per parameter tensor (state.py staging_need gives both numbers). The soft
descriptor limit is raised to the hard one first; if anything is still short, the caller falls back to thread
mode (staging in private memory). "RAM" is the node's MemAvailable or, when smaller, the room left in this
process's memory cgroup (a container's limit: tmpfs pages are charged to it), which the memory tier's budget
(memory_tier/tier.py) reads too.
"""

from __future__ import annotations

import os
import resource

from common.procfs import kib_field
from common.words import plural

FD_MARGIN = 256  # descriptors the rank needs besides staging: sockets, data files, pipes, libraries


def raise_fd_limit() -> int:
    """Soft RLIMIT_NOFILE := hard (many sites leave the soft one at 1024). Returns the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard and (hard == resource.RLIM_INFINITY or soft < hard):
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    return soft


SHM_DIR = "/dev/shm"  # where process mode's staging buffers live (shared memory) and the memory tier by default


def shm_free_bytes(path: str = SHM_DIR) -> int:
    try:
        st = os.statvfs(path)
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize


CGROUP_ROOT = "/sys/fs/cgroup"
NO_LIMIT = 2**62  # cgroup v1 writes "no limit" as a page-rounded 2**63 - 1


def mem_available_bytes() -> int:
    """RAM this process may still fill: the node's MemAvailable, or its memory cgroup's room if smaller (a
    container's memory limit, which tmpfs pages count against: k8s memory emptyDirs, /dev/shm)."""
    node = kib_field("/proc/meminfo", "MemAvailable")
    room = cgroup_memory_room()
    return node if room is None else min(node, room)


def cgroup_memory_room(root: str = CGROUP_ROOT, proc_cgroup: str = "/proc/self/cgroup") -> int | None:
    """Bytes this process's memory cgroups can still take, the smallest over its own cgroup and each visible one
    above it (a pod's limit sits above its container's): limit less usage, page cache the kernel can drop
    (inactive_file) not counted as usage, as the kubelet's working set. cgroup v2 (memory.max, memory.current)
    where the memory controller is there, else v1 (memory.limit_in_bytes, memory.usage_in_bytes). None: no limit.
    `root` and `proc_cgroup` are parameters for the tests."""
    try:
        with open(proc_cgroup) as f:
            lines = [line.rstrip("\n").split(":", 2) for line in f if line.count(":") >= 2]
    except OSError:
        return None
    v2 = [path for hid, ctrls, path in lines if hid == "0" and ctrls == ""]
    v1 = [path for _, ctrls, path in lines if "memory" in ctrls.split(",")]
    candidates = [(mount, path, ("memory.max", "memory.current", "inactive_file"))
                  for path in v2 for mount in (root, os.path.join(root, "unified"))] + \
                 [(os.path.join(root, "memory"), path, ("memory.limit_in_bytes", "memory.usage_in_bytes",
                                                        "total_inactive_file")) for path in v1]
    for mount, path, names in candidates:
        if _has_memory_controller(mount, v2=names[0] == "memory.max"):
            rooms = [_level_room(os.path.join(mount, level.lstrip("/")), *names) for level in _levels(path)]
            return min((r for r in rooms if r is not None), default=None)
    return None


def _has_memory_controller(mount: str, v2: bool) -> bool:
    """v2: the hierarchy's root lists `memory` in cgroup.controllers (a hybrid host may mount v2 without it);
    v1: the memory hierarchy is mounted."""
    if not v2:
        return os.path.exists(os.path.join(mount, "memory.usage_in_bytes"))
    try:
        with open(os.path.join(mount, "cgroup.controllers")) as f:
            return "memory" in f.read().split()
    except OSError:
        return False


def _levels(path: str) -> list[str]:
    """'/a/b' -> ['/a/b', '/a', '/']: a cgroup and its ancestors (inside a cgroup namespace only '/' exists)."""
    parts = [p for p in path.split("/") if p]
    return ["/" + "/".join(parts[:n]) for n in range(len(parts), -1, -1)]


def _level_room(folder: str, limit_name: str, usage_name: str, inactive_name: str) -> int | None:
    try:
        with open(os.path.join(folder, limit_name)) as f:
            limit = f.read().strip()
        with open(os.path.join(folder, usage_name)) as f:
            usage = int(f.read())
    except (OSError, ValueError):
        return None
    if limit == "max" or int(limit) >= NO_LIMIT:
        return None
    inactive = 0
    try:
        with open(os.path.join(folder, "memory.stat")) as f:
            inactive = next((int(line.split()[1]) for line in f if line.split()[0] == inactive_name), 0)
    except (OSError, ValueError, IndexError):
        pass
    return max(0, int(limit) - (usage - inactive))


def shortfall(n_tensors: int, nbytes: int, local_ranks: int, fd_limit: int, shm_free: int,
              mem_available: int) -> str | None:
    """Why process-mode staging would fail on this node, or None. Pure: the tests pass fake limits."""
    node_bytes = nbytes * local_ranks
    if n_tensors + FD_MARGIN > fd_limit:
        return (f"{n_tensors} staged tensors need ~{n_tensors + FD_MARGIN} open files per rank, the limit is "
                f"{fd_limit} (raise the hard limit: ulimit -Hn)")
    if node_bytes > shm_free:
        return (f"{plural(local_ranks, 'rank')} x {nbytes / 2**30:.2f} GiB staged need {node_bytes / 2**30:.2f} GiB in "
                f"/dev/shm, {shm_free / 2**30:.2f} GiB free")
    if node_bytes > mem_available:
        return (f"{plural(local_ranks, 'rank')} x {nbytes / 2**30:.2f} GiB staged need {node_bytes / 2**30:.2f} GiB of RAM, "
                f"{mem_available / 2**30:.2f} GiB available")
    return None


def process_staging_shortfall(n_tensors: int, nbytes: int, local_ranks: int) -> str | None:
    """`shortfall` with this machine's numbers, after raising the descriptor limit."""
    return shortfall(n_tensors, nbytes, local_ranks, raise_fd_limit(), shm_free_bytes(), mem_available_bytes())

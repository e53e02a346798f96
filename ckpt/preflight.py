"""Before the first async save: can this node stage every rank's checkpoint in shared memory?

    python -m pytest tests/test_preflight.py -q

Process mode (`ckpt.async_mode=process`) stages each rank's state in /dev/shm so the uploader process
reads it without a copy, and keeps one open file descriptor per staged tensor for the life of the job
(per parameter tensor: the parameter and its optimizer state's tensors, 4 with AdamW: exp_avg, exp_avg_sq,
step; 2 with SGD's momentum). So per node it needs about  (4 + S) bytes x params / W x (ranks on the node)  of
/dev/shm and of RAM, S the optimizer's state bytes per parameter (AdamW 8: 12 in all; SGD 4: 8), and per rank
about that many descriptors per parameter tensor (state.py staging_need gives both numbers). The soft
descriptor limit is raised to the hard one first; if anything is still short, the caller falls back to thread
mode (staging in private memory).
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


def mem_available_bytes() -> int:
    return kib_field("/proc/meminfo", "MemAvailable")


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

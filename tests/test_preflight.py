"""Process-mode staging preflight: descriptors, /dev/shm and RAM against the staging need; fallback to thread.

    python -m pytest tests/test_preflight.py -q
"""

import subprocess
import sys

import pytest

from conftest import ROOT
from ckpt.preflight import FD_MARGIN, shortfall

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

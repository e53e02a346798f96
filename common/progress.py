"""Start and end lines for the long phases a person waits on (loading a checkpoint or HF weights, exporting),
so a quiet terminal never looks like a hung job.

    python -m pytest tests/test_progress.py -q

Two plain lines per phase, through the caller's rank-0 log (`info`): one as it starts, saying what is happening,
one as it ends, with the seconds it took. No progress bar, so a non-TTY log (Slurm, nohup) gets no flood of
carriage returns. A phase that raises prints no end line: the error is the news.
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable


@contextlib.contextmanager
def phase(info: Callable[[str], None], what: str):
    info(f"{what} ...")
    t0 = time.perf_counter()
    yield
    info(f"{what}: done in {time.perf_counter() - t0:.1f}s")

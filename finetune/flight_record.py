"""torch's flight recorders of the collectives (which collective each group enqueued, started and completed: the one
a rank never joined), kept in run.dir: NCCL's own dump at its timeout, and every recorder's dump at a hang's exit.

    python -m pytest tests/test_hang.py -q -k flight

A dump lands in <run.dir>/hang/flight-attempt<k>/ as `<prefix><rank>`, the folder torch's analyser reads
(`torchfrtrace <folder> --prefix nccl_rank_`; docs/reliability.md shows how to read a gloo dump). A torch build
with no recorder is said in one line (`no_recorder_line`).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading

import torch
from torch._C import _distributed_c10d as c10d

from common.dist import worker_attempt

# torch's flight recorders, by the file prefix their dumps get: NCCL's (CUDA builds) and the one gloo records in
FLIGHT_RECORDERS = (("nccl_rank_", "_dump_nccl_trace"), ("gloo_rank_", "_dump_fr_trace"))
FLIGHT_ENV = ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")  # NCCL's own dump: the path prefix
FLIGHT_DUMP_S = 10.0  # a dump that takes longer (a recorder's lock held by a stuck thread) is given up


def flight_folder(run_dir: str) -> str:
    """<run.dir>/hang/flight-attempt<k>/: this attempt's flight-recorder dumps, `<prefix><rank>` as torch's
    analyser reads them (`torchfrtrace <folder> --prefix nccl_rank_`)."""
    return os.path.join(run_dir, "hang", f"flight-attempt{worker_attempt()}")


def keep_nccl_flight_record(run_dir: str) -> None:
    """Before the process group exists: NCCL's own dump at its collective timeout goes to this attempt's flight
    folder in run.dir, not to node-local /tmp (gone with SLURM's per-job tmpfs or a pod restart), unless the launcher
    chose a place (either name). NCCL opens the file without making its folder: made here, on CUDA only."""
    if any(os.environ.get(name) for name in FLIGHT_ENV):
        return
    os.environ[FLIGHT_ENV[0]] = os.path.join(flight_folder(run_dir), FLIGHT_RECORDERS[0][0])
    if hasattr(c10d, FLIGHT_RECORDERS[0][1]) and torch.cuda.is_available():
        with contextlib.suppress(OSError):  # NCCL logs its own error then; the hang exit writes it anyway
            os.makedirs(flight_folder(run_dir), exist_ok=True)


def dump_flight_records(run_dir: str, rank: int) -> list[str]:
    """Each flight recorder this torch build has (the last collectives each group enqueued, started and completed,
    which name the one a rank never joined), to flight_folder; the paths written, none where the build has none.
    Bounded by FLIGHT_DUMP_S: this runs on the way to an exit that must happen."""
    written = []

    def dump():
        for prefix, name in FLIGHT_RECORDERS:
            if hasattr(c10d, name):
                path = os.path.join(flight_folder(run_dir), f"{prefix}{rank}")
                data = getattr(c10d, name)()
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with open(path, "wb") as f:
                    f.write(data)
                written.append(path)
    worker = threading.Thread(target=lambda: _warn_if_raises(dump, "the flight records"), daemon=True)
    worker.start()
    worker.join(FLIGHT_DUMP_S)
    if worker.is_alive():
        print(f"warning: the flight records were not written within {FLIGHT_DUMP_S:g}s: given up", file=sys.stderr,
              flush=True)
    return list(written)


def _warn_if_raises(fn, what: str) -> None:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - a diagnosis that failed must not stop the exit it precedes
        print(f"warning: could not write {what}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)


def no_recorder_line(folder: str) -> str:
    return (f"warning: no flight record of the collectives in {folder}: torch {torch.__version__} has neither of "
            f"{[name for _, name in FLIGHT_RECORDERS]}")

"""Rank-0 work that other ranks wait for through the filesystem, with no collective deadline; a small integer
all-reduce for work every rank shares.

    python -m pytest tests/test_data.py -q -k wait

A collective (gloo broadcast, NCCL barrier) times out after its process group's timeout, so a job whose
rank 0 tokenizes a large data set for an hour would crash in the other ranks. Here rank 0 builds a
folder whose "ready" file appears last; the others poll for it (one stat a second, one line a minute)
and for an error file rank 0 writes if it fails, so every rank stops with rank 0's message.
"""

from __future__ import annotations

import glob
import os
import time
from typing import Callable

import torch
import torch.distributed as dist


def _error_file(ready_file: str, nonce: str) -> str:
    return f"{os.path.dirname(ready_file)}.error-{nonce}"


def _job_nonce() -> str:
    """A token all ranks share (one tiny broadcast, all ranks arrive together): names this job's error file,
    so a waiter never mistakes an old job's error for this one's."""
    out = [os.urandom(8).hex()]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(out, src=0)
    return out[0]


def rank0_builds_others_wait(build: Callable[[], str], ready_file: str, what: str, error_type: type[Exception],
                             poll_s: float = 1.0, report_s: float = 60.0, log=print) -> str:
    """Rank 0 returns build() (which must create `ready_file`); other ranks return once `ready_file` exists.

    If build() raises on rank 0, the error is written next to the folder and every other rank raises
    `error_type` with the same message. `log` prints the waiting line on one rank per node.
    """
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    if world == 1:
        return build()
    nonce = _job_nonce()
    error_file = _error_file(ready_file, nonce)
    if rank == 0:
        for stale in glob.glob(_error_file(ready_file, "*")):
            os.remove(stale)
        try:
            return build()
        except Exception as e:  # noqa: BLE001 - told to the waiters, then re-raised here
            msg = str(e) if isinstance(e, error_type) else f"{type(e).__name__}: {e}"
            with open(error_file + ".tmp", "w") as f:
                f.write(msg)
            os.replace(error_file + ".tmp", error_file)
            raise
    talk = rank == 1 or int(os.environ.get("LOCAL_RANK", rank)) == 0
    t0 = next_report = time.monotonic()
    while not os.path.exists(ready_file):
        if os.path.exists(error_file):
            with open(error_file) as f:
                raise error_type(f.read())
        now = time.monotonic()
        if now >= next_report + report_s:
            next_report = now
            if talk:
                log(f"rank {rank}: waiting for rank 0 to build {what} ({(now - t0) / 60:.0f} min)")
        time.sleep(poll_s)
    return os.path.dirname(ready_file)


def all_ranks_reduce(value: int, op: str) -> int:
    """`value` summed ("sum") or minimised ("min") over the ranks; the value itself outside a process group.
    A CPU tensor, so it goes over gloo also where nccl serves the GPU tensors."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op={"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN}[op])
    return int(t.item())

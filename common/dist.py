"""Rank-0 helpers shared by data loading and ckpt/: rank-0 work that other ranks wait for through the filesystem
(no collective deadline), rank-0 work whose result or error every rank receives, the first problem any rank
found (every rank learns it), a small integer all-reduce,
a free local port for a one-process group, the world-size divisibility rule, which start of the workers this is,
and the end of the process groups (aborted after an error).

    python -m pytest tests/test_data.py -q -k wait

A collective (gloo broadcast, NCCL barrier) times out after its process group's timeout, so a job whose
rank 0 tokenizes a large data set for an hour would crash in the other ranks. Here rank 0 builds a
folder whose "ready" file appears last; the others poll for it (one stat a second, one line a minute)
and for an error file rank 0 writes if it fails, so every rank stops with rank 0's message.
"""

from __future__ import annotations

import glob
import os
import socket
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


def on_rank0_then_share(fn: Callable[[], object], group, error_type: type[Exception]) -> object:
    """Run fn on rank 0 only and hand every rank its result or its error (as `error_type`), so all ranks fail
    together with the same message instead of the others hanging in the next collective."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    out = [None, None]
    if rank == 0:
        try:
            out[0] = fn()
        except Exception as e:  # noqa: BLE001 - re-raised on every rank below
            out[1] = f"{e}" if isinstance(e, error_type) else f"{type(e).__name__}: {e}"
    if dist.is_initialized():
        dist.broadcast_object_list(out, src=0, group=group)
    if out[1] is not None:
        raise error_type(out[1])
    return out[0]


def first_problem(problem: str | None, group) -> str | None:
    """The first problem any rank of `group` found (in rank order), on every rank; None if none did. One 1-float
    all-reduce; the problems themselves are gathered only when there is one."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return problem
    flag = torch.tensor([float(problem is not None)])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    if not flag.item():
        return None
    problems = [None] * dist.get_world_size(group)
    dist.all_gather_object(problems, problem, group=group)
    return next(p for p in problems if p is not None)


def end_process_group(graceful: bool) -> None:
    """Destroy every process group when the run ended as planned; abort them after an error: NCCL's graceful
    shutdown flushes work that peers may never match (a rank raised mid-step) and can block the exit."""
    if not dist.is_initialized():
        return
    if graceful:
        dist.destroy_process_group()
    else:
        dist.distributed_c10d._abort_process_group()


def torchrun_restart() -> int:
    """Which start of the workers under this torchrun this is, 0 the first (--max-restarts); the launcher's store
    outlives a restart, so keys written per attempt carry it."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0)


def worker_attempt() -> int:
    """Which start of this job's workers this is, 0 the first: torchrun's restarts plus SLURM's requeues (a requeued
    job's torchrun counts from 0 again). Unique as long as only one of the two counts moves, as under
    slurm/train.sbatch (torchrun without --max-restarts) and under torchrun alone."""
    return torchrun_restart() + int(os.environ.get("SLURM_RESTART_COUNT") or 0)


def free_port() -> int:
    """A free TCP port on 127.0.0.1, for a process group of this machine only."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def divisibility_problem(name: str, value: int, world_size: int) -> str | None:
    """Why `value` (the config key `name`) cannot be split evenly over `world_size` ranks, or None."""
    if value % world_size == 0:
        return None
    ok = [w for w in range(1, value + 1) if value % w == 0]
    return f"{name}={value} is not divisible by world size {world_size}; world sizes that work: {ok}"

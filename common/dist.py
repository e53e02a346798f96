"""Rank-0 helpers shared by data loading and ckpt/: rank-0 work whose result or error every rank receives, the
first problem any rank found (every rank learns it), a small integer all-reduce, gloo pairs connected when first
used, a free local port for a one-process group, the world-size divisibility rule, which start of the workers this
is (every launcher's restarts), and the end of the process groups (aborted after an error). (Rank-0 work the others
wait for without a collective deadline, such as tokenizing: handoff.py.)

    python -m pytest tests/test_ckpt_unit.py -q -k rank0
"""

from __future__ import annotations

import os
import socket
from typing import Callable

import torch
import torch.distributed as dist

from common.launcher import RESTART_COUNT_ENV


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


def lazy_gloo_pairs() -> None:
    """Gloo groups made from now on, in this process and the ones it starts (DCP's process-mode uploaders inherit the
    environment), connect a pair of ranks when a collective first uses it, not every pair when the group is made.

    gloo's default connects a group's full mesh at creation, through the job's one store: every rank sets a key of
    8W + ~150 bytes (its address and a pair id per peer) and waits for and reads all W keys, 2W^2 + W requests and
    ~8W^3 bytes per group, and W - 1 sockets per rank; the job makes 5 gloo groups at start (the default group's, 2
    checkpoint, 2 memory-tier) and the uploaders' world at the first save. With TORCH_GLOO_LAZY_INIT=1 (torch 2.13
    reads it whenever a gloo group is made) each rank sets one short key per group, and a pair costs one wait + get
    when first used: a ring all-reduce touches 2 peers, a gather connects its root to each rank once. Counted by
    bench/scale_gloo.py and tests/test_gloo_groups.py; docs/scale.md. A value the user set is kept."""
    os.environ.setdefault("TORCH_GLOO_LAZY_INIT", "1")


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
    """Which start of this job's workers this is, 0 the first: torchrun's restarts plus SLURM's requeues plus the
    restarts of a launcher that starts torchrun again itself (RESTART_COUNT_ENV, common/launcher.py; set by
    k8s/entrypoint.sh). Each launcher's count starts from 0 when the one above it restarts it, so the sum is
    unique as long as the counts only grow, as under slurm/train.sbatch and k8s/ (torchrun without
    --max-restarts) and under torchrun alone. Test faults (`attempt=`) and hang stack files carry it."""
    return torchrun_restart() + sum(int(os.environ.get(name) or 0) for name in ("SLURM_RESTART_COUNT",
                                                                                 RESTART_COUNT_ENV))


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

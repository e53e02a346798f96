"""How this process was launched, and how bad input is reported once however many ranks it started.

    python -m pytest tests/test_launch.py -q

Supported launchers: torchrun, `python -m torch.distributed.run`, srun via slurm/train.sbatch (one torchrun per
node), `accelerate launch --multi_gpu` (torch's elastic launcher underneath). Each sets RANK/WORLD_SIZE in every
worker. Plain `python train_fsdp.py` is a world of one.

Bad input (config, model folder, data files) is checked by every rank, identically, before any process group.
Only global rank 0 prints its `error:` line. The others stay silent and wait: torchrun stops every worker of a node
as soon as one exits, so a silent rank that exited first could cut off the one that prints. Rank 0 in turn waits, up
to BAD_INPUT_WAIT_S, until every rank has reached the same verdict (each adds itself to a counter in the launcher's
own TCPStore, no process group needed), so that no rank still checking is stopped by torchrun before it knows; then
it says so in the store, and the others exit at once (another node's torchrun would not stop them: it stops only
its own workers). A rank that is still alive after BAD_INPUT_WAIT_S (rank 0 never got there: its input differs)
prints its own line, naming its rank. All ranks exit with the same code. train_fsdp.py reports a user error found after the
process group the same way: most are raised on every rank alike, and a rank-local one is still printed, 30 s late.
Every rank also writes the message into torchrun's error file (TORCHELASTIC_ERROR_FILE, what `@record` does;
common/launcher.py tell_torchrun), so torchrun's failure summary shows it for each rank instead of a link on how to
enable tracebacks, and a launcher above torchrun reads the 2 there.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from datetime import timedelta

from torch.distributed import TCPStore

from common.dist import torchrun_restart
from common.launcher import tell_torchrun

BAD_INPUT_WAIT_S = 30.0  # how long a silent rank waits for torchrun to stop it after rank 0's error
STOPPED_WITHIN_S = 5.0  # once rank 0 reported: how long a silent rank lingers for its torchrun to stop it


def launch_rank() -> int:
    """The global rank the launcher gave this process (0 without one)."""
    return int(os.environ.get("RANK", "0") or 0)


def launch_world() -> int:
    """How many ranks the launcher started (1 without one)."""
    return int(os.environ.get("WORLD_SIZE", "1") or 1)


def launch_node() -> tuple[int, int]:
    """(this node's number, how many nodes) as torchrun numbers its agents (GROUP_RANK, GROUP_WORLD_SIZE); one
    node without them."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0) or launch_world()
    nodes = int(os.environ.get("GROUP_WORLD_SIZE", "0") or 0) or max(1, launch_world() // local)
    return int(os.environ.get("GROUP_RANK", "") or launch_rank() // local), nodes


def report_bad_input(message: str, exit_code: int, wait_s: float = BAD_INPUT_WAIT_S) -> None:
    """Print `error: message` on rank 0 only; see the module docstring for the other ranks, which end with
    `exit_code` too (SystemExit), stopped by torchrun or after `wait_s`."""
    rank = launch_rank()
    tell_torchrun(exit_code, f"bad input (its one-line message is above): {message}")
    # before counting in: rank 0 may exit, and torchrun stop us, right after; rank 0 too, once the others exit
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(exit_code))  # torchrun stopping us: the same exit code
    store = launcher_store()
    reached = _count_in(store)
    if rank == 0:
        print(f"error: {message}", file=sys.stderr, flush=True)
        _wait_for_every_rank(store, reached, wait_s)
        _tell(store, _reported_key())
        return
    if not _seen_within(store, _reported_key(), wait_s):
        print(f"error: rank {rank}: {message}", file=sys.stderr, flush=True)
    else:  # reported: rank 0's torchrun stops its node's ranks at once (SIGTERM: exit_code, above); exiting on our
        # own at that moment races it (a SIGTERM during interpreter shutdown is -15); another node's torchrun
        # stops nobody, so its ranks exit after the grace
        time.sleep(STOPPED_WITHIN_S)


def launcher_store() -> TCPStore | None:
    """The TCPStore torchrun's agent serves at MASTER_ADDR:MASTER_PORT (c10d rendezvous, what --standalone, the
    README and slurm/train.sbatch use); None for a world of one, a launcher without one, or one not reachable."""
    if launch_world() < 2 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    try:
        return TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                        timeout=timedelta(seconds=5), wait_for_workers=False)
    except (KeyError, ValueError, RuntimeError):
        return None  # then rank 0 exits at once, as without a launcher store


def _bad_input_key() -> str:
    """One counter per launch attempt: the agent's store outlives a restart (--max-restarts)."""
    return f"finetune/bad_input/{torchrun_restart()}"


def _reported_key() -> str:
    return f"{_bad_input_key()}/reported"


def _tell(store: TCPStore | None, key: str) -> None:
    if store is not None:
        with contextlib.suppress(RuntimeError):
            store.set(key, "1")


def _seen_within(store: TCPStore | None, key: str, wait_s: float) -> bool:
    """Whether `key` appears in the store within `wait_s` (polled; a store gone counts as never)."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            if store is not None and store.check([key]):
                return True
        except RuntimeError:
            store = None
        time.sleep(0.1)
    return False


def _count_in(store: TCPStore | None) -> int:
    """Add this rank to the ranks that reached the bad-input verdict; how many have, this one included."""
    if store is None:
        return 0
    try:
        return store.add(_bad_input_key(), 1)
    except RuntimeError:
        return 0


def _wait_for_every_rank(store: TCPStore | None, reached: int, wait_s: float) -> None:
    """Rank 0 returns (and exits) once every rank has counted in, or after `wait_s`."""
    deadline = time.monotonic() + wait_s
    while store is not None and reached < launch_world() and time.monotonic() < deadline:
        time.sleep(0.1)
        try:
            reached = store.add(_bad_input_key(), 0)
        except RuntimeError:
            return


def accelerate_world_problem() -> str | None:
    """`accelerate launch --num_processes N` without --multi_gpu (e.g. with --cpu) starts ONE process through
    its simple launcher, which sets MASTER_ADDR/MASTER_PORT (for N > 1) and ACCELERATE_* but no RANK/WORLD_SIZE:
    the run would silently train at world size 1. None when the launch is fine."""
    accelerate = "ACCELERATE_MIXED_PRECISION" in os.environ or "ACCELERATE_USE_CPU" in os.environ
    if not accelerate or "RANK" in os.environ or "MASTER_PORT" not in os.environ:
        return None
    return ("accelerate launch asked for several processes but started one process without RANK/WORLD_SIZE (its "
            "simple launcher, used for --cpu or without --multi_gpu): this run would train at world size 1. Use "
            "`torchrun --nproc_per_node N train_fsdp.py ...` (CPU or GPU), or `accelerate launch --multi_gpu "
            "--num_processes N train_fsdp.py ...` without --cpu")

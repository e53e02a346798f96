"""Checkpoint errors: one line each, naming the checkpoint and the cause; a full disk and a timed-out collective
are told apart, because the emergency-save rules (loop.py) treat them differently; a lost peer is told apart from
this rank's own error, because the launcher restarts after the first and not after the second (common/launcher.py).

    python -m pytest tests/test_save_errors.py -q
"""

from __future__ import annotations

import errno
import shutil

import torch.distributed as dist
from torch.distributed.checkpoint import CheckpointException


class CheckpointError(RuntimeError):
    """A save, load or lock problem; the message names the checkpoint and the cause."""


class RetentionError(CheckpointError):
    """Deleting old checkpoints failed after the new one was committed: that checkpoint is intact, so it must
    not be saved again (a re-save first moves the folder in its way, the committed one, into .trash)."""


class DiskFullError(CheckpointError):
    """A save failed because its filesystem is full: another save there (an emergency one) cannot succeed."""


# DCP's CheckpointException derives from BaseException, so `except Exception` misses it
SAVE_ERRORS = (Exception, CheckpointException)


def _errors_in(error: BaseException):
    """`error`, its causes, and the per-rank failures inside a DCP CheckpointException."""
    seen, todo = set(), [error]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo += [e.__cause__, e.__context__]
        if isinstance(e, CheckpointException):
            todo += [exc for exc, _ in e.failures.values()]


def _disk_full(error: BaseException, path: str) -> bool:
    """ENOSPC/EDQUOT anywhere in the error, or (torch.save's zip writer reports "unexpected pos" instead of
    the errno) less than 1 MiB left on the filesystem of `path` right after the failure."""
    if any(isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT) for e in _errors_in(error)):
        return True
    try:
        return shutil.disk_usage(path).free < 2**20
    except OSError:
        return False


def cause_line(error: BaseException) -> str:
    """One line: the first rank's own exception of a CheckpointException (its str() is a traceback wall)."""
    if isinstance(error, CheckpointException) and error.failures:
        rank, (exc, _) = next(iter(sorted(error.failures.items(), key=lambda kv: kv[0])))
        return f"rank {rank}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return f"{type(error).__name__}: {error}"


def save_failure(error: BaseException, ckpt_dir: str, what: str) -> CheckpointError:
    """The one-line error of a failed write under `ckpt_dir`; DiskFullError when its filesystem is full."""
    if isinstance(error, CheckpointError):
        return error
    if collective_timed_out(error):
        return CheckpointError(f"writing {what}: a checkpoint collective timed out waiting for another rank, which "
                               "is stuck or dead")
    if _disk_full(error, ckpt_dir):
        return DiskFullError(f"no space left on {ckpt_dir} while writing {what}")
    return CheckpointError(f"writing {what} failed: {cause_line(error)}")


def lost_a_rank(error: BaseException) -> bool:
    """Whether `error` is a collective or store call that lost its peer: gloo's "Connection closed by peer" /
    "Connection reset by peer" (a plain RuntimeError in torch 2.13), or torch.distributed's DistError family
    (NCCL's remote errors, a store gone). The cause is another rank or node, not this rank's code."""
    return any(isinstance(e, dist.DistError) or (isinstance(e, RuntimeError) and any(
        words in str(e) for words in ("Connection closed by peer", "Connection reset by peer")))
        for e in _errors_in(error))


def collective_timed_out(error: BaseException) -> bool:
    """Whether `error` is a collective that gave up waiting for a rank (gloo's "Timed out waiting ...", as
    such, as a cause, or inside a DCP CheckpointException). NCCL's watchdog aborts the process instead."""
    return any(isinstance(e, RuntimeError) and "Timed out waiting" in str(e) for e in _errors_in(error))


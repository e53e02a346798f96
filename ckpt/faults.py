"""Fault injection for the tests: kill or fail at a named moment of training or of a save.

    CKPT_FAULT="kill@after_step:8" torchrun ... train_fsdp.py ...       # SIGKILL every rank after step 8
    CKPT_FAULT="oserror@write:6" ...                                    # ENOSPC while writing step 6's shards
    python -m pytest tests/test_faults.py -q                            # the suite that uses it

Format `<action>@<point>[:<step>][,rank=<r>][,attempt=<n>][,secs=<s>][,file=<path>]`, several joined by `;`
(`attempt`: only in the n-th start of the workers, 0 the first run, counting torchrun's restarts and SLURM's
requeues: a kill that torchrun's --max-restarts or a requeue recovers from must not fire again after it).
Actions: `kill` (SIGKILL this process, no cleanup, like an OOM kill or a lost node), `oserror` (raise
OSError(ENOSPC), like a full disk), `sleep` (wait `secs`, to widen a window; with `file`, create it first, so a test knows the process
got there), `stop` (SIGSTOP this process, like a frozen machine or a
process stuck in the kernel; with `file`, create it first) and `wait_for` (wait until `file` exists, at most
`secs`: e.g. an async save's commit marker, so a test does not depend on how loaded the machine is). Points, in the
order a step and its save reach them:
  mid_step       a step begun (loop.py step_in_progress), its batch about to be taken, not finished
  after_step     step finished and logged (loop.py after_step)
  eval           an evaluation of this step's model begins (train_fsdp.py run_eval)
  forward        inside the first decoder block's forward, in a training step, after FSDP's all-gather (the
                 step is not known there: no `:<step>`; train_fsdp.py watch_progress, for a slow-GPU straggler)
  staged         state copied for an async save, upload not started (training process)
  write          storage writer starts writing this rank's shards (the upload: in process async mode
                 this runs in the uploader process, so `kill` kills only the uploader)
  partial_write  the first bytes of a shard file are on disk, the rest are not (a torn file)
  replicate      memory tier: this rank's files are written, their copies to peer nodes not started
  partial_replica  memory tier: the first bytes of a copy from a peer are on disk (a .part file), the rest not
  before_commit  every rank's data is durable (memory tier: and copied), commit marker not written (memory
                 tier: this node's; it fires on every rank, the marker is its node leader's; `oserror`
                 given to one node's ranks: that node's marker alone fails)
  after_commit   marker written (rank 0 only), retention not run yet
  sweep          retention moved the old folders into .trash, no file deleted yet (every rank, in the
                 background after a commit; also before a save whose folder held a leftover)
The code marks its points with the `fault_at` decorator (or, inside step_in_progress, one fault_point call):
unset in normal runs, a point is then one environment lookup, and the writer is the plain one.
"""

from __future__ import annotations

import errno
import functools
import inspect
import os
import signal
import time
from contextlib import contextmanager

from torch.distributed.checkpoint.filesystem import FileSystem

from common.dist import worker_attempt


def _parse(spec: str) -> list[dict]:
    faults = []
    for one in filter(None, (x.strip() for x in spec.split(";"))):
        head, _, opts = one.partition(",")
        action, _, where = head.partition("@")
        point, _, step = where.partition(":")
        kv = dict(o.split("=", 1) for o in opts.split(",") if "=" in o)
        faults.append({"action": action, "point": point, "step": int(step) if step else None,
                       "rank": int(kv["rank"]) if "rank" in kv else None,
                       "attempt": int(kv["attempt"]) if "attempt" in kv else None, "secs": float(kv.get("secs", 5)), "file": kv.get("file")})
    return faults


def wants(point: str) -> bool:
    """Whether CKPT_FAULT names `point`: lets callers install a test-only hook only when it is asked for."""
    return any(f["point"] == point for f in _parse(os.environ.get("CKPT_FAULT", "")))


def fault_at(point: str, after: bool = False):
    """Decorator: CKPT_FAULT's `point` fires as the function starts (`after`: once it has returned), with the
    call's `step` argument, or its object's `.step`. Unset CKPT_FAULT: one environment lookup per call."""
    def decorate(fn):
        signature = inspect.signature(fn)

        @functools.wraps(fn)
        def run(*args, **kwargs):
            if not os.environ.get("CKPT_FAULT"):
                return fn(*args, **kwargs)
            bound = signature.bind(*args, **kwargs).arguments
            step = bound["step"] if "step" in bound else bound["self"].step
            if not after:
                fault_point(point, step)
            out = fn(*args, **kwargs)
            if after:
                fault_point(point, step)
            return out
        return run
    return decorate


def fault_point(point: str, step: int | None = None) -> None:
    spec = os.environ.get("CKPT_FAULT")
    if not spec:
        return
    for f in _parse(spec):
        if f["point"] != point or f["step"] not in (None, step):
            continue
        if f["rank"] is not None and f["rank"] != int(os.environ.get("RANK", "0")):
            continue
        if f["attempt"] is not None and f["attempt"] != worker_attempt():
            continue
        if f["action"] == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif f["action"] == "oserror":
            raise OSError(errno.ENOSPC, f"No space left on device (injected by CKPT_FAULT at {point}, step {step})")
        elif f["action"] == "stop":
            if f["file"]:
                open(f["file"], "a").close()
            os.kill(os.getpid(), signal.SIGSTOP)
        elif f["action"] == "sleep":
            if f["file"]:
                open(f["file"], "a").close()
            time.sleep(f["secs"])
        elif f["action"] == "wait_for":
            deadline = time.monotonic() + f["secs"]
            while not os.path.exists(f["file"]) and time.monotonic() < deadline:
                time.sleep(0.05)
        else:
            raise ValueError(f"CKPT_FAULT: unknown action {f['action']!r}")


class TornWriteFileSystem(FileSystem):
    """DCP's FileSystem whose write streams reach `partial_write` right after their first bytes hit the file.
    Module level so that it pickles into the process-mode uploader with the storage writer."""

    def __init__(self, step: int):
        super().__init__()
        self.step = step

    @contextmanager
    def create_stream(self, path, mode):
        with super().create_stream(path, mode) as stream:
            yield _TornStream(stream, self.step) if "w" in mode else stream


class _TornStream:
    def __init__(self, stream, step: int):
        self._stream, self._step = stream, step

    def write(self, data) -> int:
        n = self._stream.write(data)
        self._stream.flush()  # these bytes reach the file; a kill now leaves it torn
        fault_point("partial_write", self._step)
        return n

    def __getattr__(self, name):  # tell, fileno, flush, close: the real file's
        return getattr(self._stream, name)

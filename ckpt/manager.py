"""CheckpointManager: saves, commits and resumes for one ckpt.dir; loop.py says when, this says how.

    python -m pytest tests/test_ckpt_resume.py tests/test_retention.py tests/test_staging_wait.py -q

The manager owns the process groups, the one save in flight and the agreement on its outcome; each part of a
save lives in its own file:
- lock: rank 0 holds <ckpt.dir>/.lock for the life of the job (lock.py).
- save(): drain the previous save, then write this one (saver.py): sync, or async with a reused stager and a
  thread or process uploader (uploader.py). Training blocks only while the state is staged.
- commit and retention (committer.py): rank 0 writes the marker from every rank's digests; then, on the
  committer thread of every rank, retention empties .trash, each rank deleting its share.
- agreement: poll()/wait()/save() raise a background save's error on every rank at the same call (one
  all-reduce), so no rank goes on while another failed.
- resume: choose_checkpoint / load (resume.py).
"""

from __future__ import annotations

import os
import time
from concurrent.futures import Future
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

from . import resume as _resume
from .committer import Committer
from .errors import CheckpointError, RetentionError
from .layout import step_dir, step_of, trash_dir
from .lock import DirLock, lock_for_job
from .preflight import process_staging_shortfall
from .prestage import ReusedStager
from .saver import StagingWait, start_async, write_sync
from .uploader import CheckpointWriter, stop_uploader_process

# off: save() returns once committed; thread: staged, then written by a background thread; process: staged in
# shared memory and written by an uploader process (ckpt.async_mode offers these)
ASYNC_MODES = ("off", "thread", "process")


def _noop(*_args, **_kwargs) -> None:
    pass


def checkpoint_groups(timeout: timedelta | None = None) -> tuple:
    """(save group, agreement group); (None, None) outside a process group. `timeout`: how long a checkpoint
    collective (DCP's plan/finish steps, the rank-0 commit, the agreement on a save's outcome) waits for a
    stuck or dead rank before it raises; torch's default (30 min) when None. Checkpoint groups have their own,
    as a save can take far longer than a step.

    Which thread may use which group (the one place that says so). Checkpoint collectives run on gloo groups
    of their own: they never queue behind training collectives, and async save has the CPU backend it needs
    even when training runs on NCCL. The save group has one user at a time: the in-flight save's background
    chain (DCP's upload thread, then the commit and the sweep on the committer thread), or the main thread
    when nothing is in flight (save() and resume calls come after wait() or before any save), so the two never
    interleave collectives on it. The agreement group is the main thread's only: rank agreement on save
    outcomes while the background chain may be busy on the save group."""
    if not dist.is_initialized():
        return None, None
    return dist.new_group(backend="gloo", timeout=timeout), dist.new_group(backend="gloo", timeout=timeout)


class CheckpointManager:
    def __init__(self, ckpt_dir: str, async_mode: str = "thread", keep_last: int = 3,
                 on_event: Callable[..., None] = _noop, on_log: Callable[[str], None] = _noop,
                 timeout: timedelta | None = None, keep_best: int = 0, groups: tuple | None = None,
                 lock: DirLock | None = None, committer=None, writer: type = CheckpointWriter, upload_nice: int = 0):
        """`groups`: checkpoint_groups(timeout), made here when None. `lock`: the ckpt.dir lock its caller took
        on groups[0] (lock_for_job), released by close(); or acquire_lock() later. `committer`, `writer`: the
        memory tier's (memory_tier/replicate.py), made on groups[0]; else the Committer and CheckpointWriter of ckpt.dir.
        `upload_nice`: the upload thread's niceness (uploader.py)."""
        if async_mode not in ASYNC_MODES:
            raise ValueError(f"async_mode must be {'|'.join(ASYNC_MODES)}, got {async_mode!r}")
        self.dir, self.async_mode, self.upload_nice = ckpt_dir, async_mode, upload_nice
        self.rank, self.world_size = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        self.pg, self._agree_pg = groups or checkpoint_groups(timeout)
        self.committer, self.writer = committer or Committer(ckpt_dir, self.pg, keep_last, keep_best, on_event, on_log), writer
        # events go through the committer's guard: an event that fails to record is logged, never raised
        self.on_log, self.on_event = on_log, self.committer.on_event
        self._stager = ReusedStager(async_mode)  # host buffers allocated ahead of the first save (prestage.py)
        self._inflight: Future | None = None  # the committer thread's work for the last save
        self._inflight_step: int | None = None
        self._staging: StagingWait | None = None  # the last async save's staging, until the training thread waited
        self._lock, self.last_saved_step = lock, None
        self.staged: tuple[int, object] | None = None  # (step, staged copy) of the last async save, for the memory tier

    def acquire_lock(self) -> None:
        """Refuse to run if another live job owns this ckpt.dir (lock.py: flock, or a heartbeat without flock)."""
        self._lock = lock_for_job(self.dir, self.pg)

    # ------------------------------------------------------------ save

    def check_staging(self, n_tensors: int, nbytes: int, local_ranks: int) -> None:
        """Process mode only: if this node cannot stage `local_ranks` x `nbytes` in /dev/shm with `n_tensors`
        open files per rank (see preflight.py), switch to thread mode, with one line saying why.
        Every rank decides together, so all of them save the same way."""
        # also raises the soft fd limit, which every mode benefits from
        reason = process_staging_shortfall(n_tensors, nbytes, local_ranks)
        if self.async_mode != "process":
            return
        if any(self.any_rank(reason is not None)):
            self.async_mode = "thread"
            self.on_log(f"ckpt.async_mode=process -> thread: {reason or 'staging is short on another node'}")
            self.on_event("staging_fallback", reason=reason or "another node")

    def save(self, step: int, state: dict, files: dict[str, str], blocking: bool = False, stager=None) -> float:
        """Save `state` (Statefuls and plain values) as step-NNNNNN; returns the training-blocking seconds.

        `files` (name -> text) are written beside the shards by rank 0 (meta.json, config.yaml).
        blocking=True (or async_mode=off) returns only once the checkpoint is committed. `stager`: instead of
        this manager's own (memory_tier/tier.py: a replay of the disk save's staged copy)."""
        t0 = time.perf_counter()
        self.wait()  # at most one save in flight; raises a previous save's error
        path = step_dir(self.dir, step)
        self.committer.prepare(path, step, files)
        if blocking or self.async_mode == "off":
            metadata = write_sync(state, path, step, self.pg, self.dir)
            blocking_s = self.committer.commit_sync(path, step, metadata, list(files), t0, time.perf_counter() - t0)
            self._inflight = self.committer.start_retention(step)
        else:
            upload, self._staging = start_async(state, path, step, self.pg, stager or self._stager.ready(),
                                                self.async_mode, self.dir, self.writer, self.upload_nice)
            self.staged = (step, self._staging.staged)
            blocking_s = time.perf_counter() - t0
            self._inflight = self.committer.start_async_commit(upload, path, step, self.async_mode, t0, blocking_s,
                                                               list(files), self._staging)
        self.last_saved_step, self._inflight_step = step, step
        return blocking_s

    def prepare_staging(self, state: dict) -> None:
        """Async modes: allocate the host buffers the saves of `state` stage into, in the background, so the
        first save blocks no longer than the next (prestage.py). Call once the optimizer state exists."""
        self._stager.prepare(state)

    def wait_for_staging(self) -> None:
        """Call right before the optimizer mutates parameters again (after backward, so that forward and
        backward hid the device-to-host copy): the staged copy must be complete. The time this waits
        is training time lost to the save, and goes into the checkpoint event's blocking_s."""
        if self._staging is not None:
            staging, self._staging = self._staging, None
            staging.wait()

    # ------------------------------------------------------------ agreement (main thread, self._agree_pg)

    def any_rank(self, *flags: bool) -> list[bool]:
        """Each flag, OR-ed over all ranks. A save that fails on one rank only (its uploader died, rank 0's
        commit failed) must raise on every rank at the same step, or the others wait in the next collective."""
        if self._agree_pg is None:
            return list(flags)
        t = torch.tensor([float(f) for f in flags])
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self._agree_pg)
        return [bool(v) for v in t.tolist()]

    def flags(self) -> tuple[bool, ...]:
        """This rank's (failed, running) of the save in flight, () with none (on every rank); OR-ed for `settle`."""
        done = self._inflight is not None and self._inflight.done()  # once: both flags from the same moment
        return () if self._inflight is None else (done and self._inflight.exception() is not None, not done)

    def settle(self, failed: bool, running: bool) -> None:
        """`flags()` OR-ed over all ranks: a save failed on any rank raises on every rank at this same call."""
        if failed:
            self.wait()  # raises everywhere
        elif not running:
            self._inflight = None

    def wait(self) -> None:
        """Block until the in-flight save (if any) is committed on every rank; if it failed on any rank,
        raise on all (this rank's error, or one naming the step). A failure of only the retention after the
        commit is a warning (and a `retention_failed` event), not a failed save: raising would make the loop
        save the step again, moving the committed folder into .trash first."""
        self.wait_for_staging()
        if self._inflight is None:
            return
        fut, self._inflight = self._inflight, None
        error = fut.exception()  # blocks until this rank's upload and commit are done
        failed, save_failed = self.any_rank(error is not None, not isinstance(error, (RetentionError, type(None))))
        if not failed:
            return
        if not save_failed:  # only retention failed, after the commit: the checkpoint stands; the next sweep retries
            why = str(error) if error is not None else (f"checkpoint step {self._inflight_step} is committed, but "
                                                        "deleting old checkpoints after it failed on another rank")
            self.on_log(f"warning: {why}; what is left in {trash_dir(self.dir)} goes with the next save's sweep")
            self.on_event("retention_failed", step=self._inflight_step, error=why)
            return
        if isinstance(error, CheckpointError) and not isinstance(error, RetentionError):
            raise error
        cause = f"{type(error).__name__}: {error}" if error is not None else "it failed on another rank"
        raise CheckpointError(f"background save of step {self._inflight_step} failed: {cause}") from error

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self.committer.close()
            if self.async_mode == "process":
                stop_uploader_process()
            self._stager.close()
            if self._lock is not None:
                self._lock.release()
                self._lock = None

    # ------------------------------------------------------------ resume

    def choose_checkpoint(self, resume: str, newer_than: int = -1) -> str | None:
        """'none' -> None; 'auto' -> newest verified one after step `newer_than` (skips logged); a path -> it."""
        return _resume.choose_checkpoint(self.dir, resume, self.pg, self.on_log, self.on_event, newer_than)

    def load(self, path: str, state: dict, model_state: dict | None = None, prefix: str = "") -> None:
        """Load `state` in place (resume.py); `model_state` is checked against the keys under `prefix` first."""
        _resume.load(path, state, self.pg, model_state, prefix)
        if os.path.realpath(os.path.dirname(os.path.normpath(path))) == os.path.realpath(self.dir):
            self.last_saved_step = step_of(path)  # a final save of this same step must not rewrite (and risk) it



def settle_alone(mgr: CheckpointManager) -> None:
    """For a caller without the training loop's per-step all-reduce (a benchmark, a tool): the save in flight's
    flags OR-ed on the manager's own agreement group, then settled. One tiny all-reduce while a save is in flight,
    none otherwise; a failed save raises on every rank at this call."""
    flags = mgr.flags()
    if flags:
        mgr.settle(*mgr.any_rank(*flags))

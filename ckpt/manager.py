"""CheckpointManager: saves, commits and resumes for one ckpt.dir; loop.py says when, this says how.

    python -m pytest tests/test_ckpt_resume.py

- save(): sync (`dcp.save`) or async (`dcp.async_save` with a reused stager, thread or process uploader,
  uploader.py). Training blocks only while the state is staged; at most one save is in flight.
- commit: each rank checksums the files it writes as it writes them; DCP's finish gathers the digests
  to rank 0, which writes the marker from them (commit.py). A save is committed, and a sync save returns,
  once the marker is durable.
- retention, after every commit, sync or async, on the committer thread of every rank: rank 0 moves the
  folders retention dooms into .trash, then each rank deletes its share of it (retention.py), so no rank
  waits while one deletes a whole checkpoint. Errors in the background are kept and raised by the next
  poll()/wait()/save(), on every rank at the same step (the agreement all-reduce).
- resume: find_resume / verify / load (resume.py).
- lock: rank 0 holds <ckpt.dir>/.lock for the life of the job (lock.py).
Checkpoint collectives run on a dedicated gloo group, so they never queue behind training collectives
and async save has the CPU backend it needs even when training runs on NCCL.
"""

from __future__ import annotations

import contextlib
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, AsyncSaveResponse

from finetune.dist import on_rank0_then_share
from . import resume as _resume
from .commit import commit_checkpoint
from .errors import SAVE_ERRORS, CheckpointError, DiskFullError, collective_timed_out, save_failure
from .faults import fault_point
from .layout import is_marked_committed, list_step_dirs, read_saved_config, step_dir, step_of
from .lock import DirLock, LockError
from .preflight import process_staging_shortfall
from .retention import apply_retention, clear_stale, delete_share, list_trash, remove_trash
from .uploader import _planner, _preemption_signals_blocked, _StagingWait, _Writer, make_stager, stop_uploader_process


def _noop(*_args, **_kwargs) -> None:
    pass


class CheckpointManager:
    def __init__(self, ckpt_dir: str, async_mode: str = "thread", keep_last: int = 3,
                 on_event: Callable[..., None] = _noop, on_log: Callable[[str], None] = _noop,
                 timeout: timedelta | None = None, keep_best: int = 0):
        """`timeout`: how long a checkpoint collective (DCP's plan/finish steps, the rank-0 commit, the
        agreement on a save's outcome) waits for a stuck or dead rank before it raises; torch's default
        (30 min) when None. Checkpoint groups have their own, as a save can take far longer than a step."""
        if async_mode not in ("off", "thread", "process"):
            raise ValueError(f"async_mode must be off|thread|process, got {async_mode!r}")
        self.dir, self.async_mode, self.keep_last, self.keep_best = ckpt_dir, async_mode, keep_last, keep_best
        self.on_event, self.on_log = on_event, on_log
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        # One user at a time: the in-flight save's background chain (DCP's upload thread, then the sweep on the
        # committer thread), or the main thread when nothing is in flight (save() and resume() calls come
        # after wait() or before any save), so the two never interleave collectives on it.
        self.pg = dist.new_group(backend="gloo", timeout=timeout) if dist.is_initialized() else None
        # main thread only: rank agreement on save outcomes while the upload thread may be busy on self.pg
        self._agree_pg = dist.new_group(backend="gloo", timeout=timeout) if dist.is_initialized() else None
        self._stager: DefaultStager | None = None
        self._committer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-commit")
        self._inflight: Future | None = None
        self._inflight_step: int | None = None
        self._staging: tuple[Future, _StagingWait] | None = None  # background staging of the last save (CUDA)
        self._lock: DirLock | None = None
        self.last_saved_step: int | None = None

    # ------------------------------------------------------------ agreement helpers

    def _on_rank0_then_share(self, fn: Callable[[], object]) -> object:
        return on_rank0_then_share(fn, self.pg, CheckpointError)

    def _any_rank(self, *flags: bool) -> list[bool]:
        """Each flag, OR-ed over all ranks. A save that fails on one rank only (its uploader died, rank 0's
        commit failed) must raise on every rank at the same step, or the others wait in the next collective."""
        if self._agree_pg is None:
            return list(flags)
        t = torch.tensor([float(f) for f in flags])
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self._agree_pg)
        return [bool(v) for v in t.tolist()]

    # ------------------------------------------------------------ lock

    def acquire_lock(self) -> None:
        """Refuse to run if another live job owns this ckpt.dir (lock.py: flock, or a heartbeat where the
        file system has no flock)."""
        def lock():
            self._lock = DirLock(self.dir)
            try:
                self._lock.acquire()
            except LockError as e:
                self._lock = None
                raise CheckpointError(str(e)) from None
        self._on_rank0_then_share(lock)

    # ------------------------------------------------------------ save

    def check_staging(self, n_tensors: int, nbytes: int, local_ranks: int) -> None:
        """Process mode only: if this node cannot stage `local_ranks` x `nbytes` in /dev/shm with `n_tensors`
        open files per rank (see preflight.py), switch to thread mode, with one line saying why.
        Every rank decides together, so all of them save the same way."""
        # also raises the soft fd limit, which every mode benefits from
        reason = process_staging_shortfall(n_tensors, nbytes, local_ranks)
        if self.async_mode != "process":
            return
        if any(self._any_rank(reason is not None)):
            self.async_mode = "thread"
            self.on_log(f"ckpt.async_mode=process -> thread: {reason or 'staging is short on another node'}")
            self.on_event("staging_fallback", reason=reason or "another node")

    def _stager_for_mode(self) -> DefaultStager:
        if self._stager is None:
            self._stager = make_stager(self.async_mode)
        return self._stager

    def save(self, step: int, state: dict, files: dict[str, str], blocking: bool = False) -> float:
        """Save `state` (Statefuls and plain values) as step-NNNNNN; returns the training-blocking seconds.

        `files` (name -> text) are written beside the shards by rank 0 (meta.json, config.yaml).
        blocking=True (or async_mode=off) returns only once the checkpoint is committed.
        """
        t0 = time.perf_counter()
        self.wait()  # at most one save in flight; raises a previous save's error
        path = step_dir(self.dir, step)

        def prepare() -> bool:
            try:
                # a leftover of a crashed save of this same step, never committed data we keep
                stale = os.path.lexists(path) and clear_stale(path, self.on_log)
                os.makedirs(path)
                for name, text in files.items():
                    with open(os.path.join(path, name), "w") as f:
                        f.write(text)
            except OSError as e:
                raise save_failure(e, self.dir, f"checkpoint {path}") from e
            return stale
        if self._on_rank0_then_share(prepare):
            self._sweep_trash(step)  # rare (after a crash): free the leftover's space before this save writes
        writer = _Writer(path, step)
        if blocking or self.async_mode == "off":
            try:
                metadata = dcp.save(state, storage_writer=writer, process_group=self.pg, planner=_planner())
                upload_s = time.perf_counter() - t0
                fault_point("before_commit", step)
                self._on_rank0_then_share(lambda: self._commit(path, step, metadata, list(files)))
            except SAVE_ERRORS as e:
                raise save_failure(e, self.dir, f"checkpoint {path}") from e
            blocking_s = time.perf_counter() - t0
            self.last_saved_step = step
            self.on_event("checkpoint", step=step, path=path, mode="sync", blocking_s=blocking_s, upload_s=upload_s,
                          committed_s=blocking_s)
            self._inflight, self._inflight_step = self._committer.submit(self._apply_retention, step), step
            return blocking_s
        try:
            with _preemption_signals_blocked():
                resp = dcp.async_save(
                    state, storage_writer=writer, process_group=self.pg, async_stager=self._stager_for_mode(),
                    planner=_planner(),
                    async_checkpointer_type=(AsyncCheckpointerType.PROCESS if self.async_mode == "process"
                                             else AsyncCheckpointerType.THREAD))
        except SAVE_ERRORS as e:  # staging: process mode copies into shared memory (/dev/shm)
            raise save_failure(e, "/dev/shm" if self.async_mode == "process" else self.dir,
                               f"the staged copy of checkpoint {path}") from e
        staged = _StagingWait()
        if isinstance(resp, AsyncSaveResponse):  # staging runs in the background (CUDA)
            self._staging, upload = (resp.staging_completion, staged), resp.upload_completion
        else:
            upload = resp
            staged.done.set()
        fault_point("staged", step)
        blocking_s = time.perf_counter() - t0
        self.last_saved_step = step
        self._inflight = self._committer.submit(self._finish_async, upload, path, step, t0, blocking_s, list(files),
                                                staged)
        self._inflight_step = step
        return blocking_s

    def wait_for_staging(self) -> None:
        """Call right before the optimizer mutates parameters again (after backward, so that forward and
        backward hid the device-to-host copy): the staged copy must be complete. The time this waits
        is training time lost to the save, and goes into the checkpoint event's blocking_s."""
        if self._staging is None:
            return
        (future, staged), self._staging = self._staging, None
        t0 = time.perf_counter()
        try:
            future.result()
        finally:
            staged.wait_s = time.perf_counter() - t0
            staged.done.set()

    def _finish_async(self, upload: Future, path: str, step: int, t0: float, blocking_s: float,
                      own_files: list[str], staged: _StagingWait) -> None:
        try:
            metadata = upload.result()
            upload_s = time.perf_counter() - t0
            fault_point("before_commit", step)
            if self.rank == 0:
                self._commit(path, step, metadata, own_files)
        except SAVE_ERRORS as e:
            # The sweep is a collective: every rank joins it whatever its own outcome (DCP's upload fails on all
            # ranks alike, rank 0's commit or a fault point on one), unless the group itself is broken.
            if not collective_timed_out(e):
                with contextlib.suppress(*SAVE_ERRORS):  # the save's own error is the one to report
                    self._sweep_trash(step)
            raise save_failure(e, self.dir, f"checkpoint {path} (in the background)") from e
        committed_s = time.perf_counter() - t0
        # The upload is done, so staging is too: the training thread's wait, if not yet recorded, returns at
        # once when it comes. Bounded, so a job that exits without wait_for_staging() never hangs here.
        staged.done.wait(timeout=5.0)
        self.on_event("checkpoint", step=step, path=path, mode=self.async_mode, blocking_s=blocking_s + staged.wait_s,
                      upload_s=upload_s, committed_s=committed_s, staging_wait_s=staged.wait_s)
        self._apply_retention(step)

    def _commit(self, path: str, step: int, metadata, own_files: list[str]) -> None:
        """Write the marker (rank 0). The checkpoint is committed once the marker is durable, so committed_s
        stops here; retention comes after, on every rank (_apply_retention)."""
        try:
            marker = commit_checkpoint(path, self.world_size, metadata.file_digests, metadata, own_files)
        except OSError as e:
            raise save_failure(e, self.dir, f"the commit marker of {path}") from e
        fault_point("after_commit", step)
        size = sum(f["size"] for f in marker["files"].values())
        self.on_log(f"checkpoint step {step} committed: {path} ({size / 2**20:.1f} MiB)")

    # ------------------------------------------------------------ retention (committer thread, every rank)

    def _apply_retention(self, newest: int) -> None:
        """Retention after the commit of `newest`, on every rank together: rank 0 moves the folders it dooms
        into .trash (renames), then every rank deletes its share (retention.py)."""
        self._sweep_trash(newest, lambda: apply_retention(self.dir, newest, self.keep_last, self.keep_best,
                                                          self.on_log))

    def _sweep_trash(self, step: int, doom: Callable[[], list[str]] = lambda: []) -> None:
        """Empty <ckpt.dir>/.trash, a collective on self.pg: rank 0 runs `doom` (moves more folders in, returns
        their paths), lists .trash and shares the list; each rank deletes every W-th file; after a barrier
        rank 0 removes the rest. O(bytes / W) per rank. A `retention` event (rank 0) says what it deleted."""
        t0 = time.perf_counter()
        try:
            gone, files = self._on_rank0_then_share(lambda: (doom(), list_trash(self.dir)))
        except CheckpointError as e:
            raise CheckpointError(f"retention after checkpoint step {step}: {e}") from None
        fault_point("sweep", step)
        if files is not None:  # None (no .trash) is the same answer on every rank
            delete_share(self.dir, files, self.rank, self.world_size)
            if self.pg is not None:
                dist.barrier(group=self.pg)
            if self.rank == 0:
                remove_trash(self.dir, self.on_log)
        if self.rank == 0 and (gone or files):
            for path in gone:
                self.on_log(f"retention: deleted {path}")
            self.on_event("retention", step=step, deleted=gone, files=len(files or []),
                          seconds=time.perf_counter() - t0)

    def poll(self) -> None:
        """Raise the error of a finished background save, on every rank at once. Call it every step:
        while a save is in flight it costs one tiny all-reduce, otherwise nothing."""
        if self._inflight is None:  # the same on every rank: saves start and settle on all ranks together
            return
        done = self._inflight.done()
        failed, running = self._any_rank(done and self._inflight.exception() is not None, not done)
        if failed:
            self.wait()  # raises everywhere
        elif not running:
            self._inflight = None

    def wait(self) -> None:
        """Block until the in-flight save (if any) is committed on every rank; if it failed on any rank,
        raise on all (this rank's error, or one naming the step)."""
        self.wait_for_staging()
        if self._inflight is None:
            return
        fut, self._inflight = self._inflight, None
        error = fut.exception()  # blocks until this rank's upload and commit are done
        if not self._any_rank(error is not None)[0]:
            return
        if isinstance(error, CheckpointError):
            raise error
        cause = f"{type(error).__name__}: {error}" if error is not None else "it failed on another rank"
        raise CheckpointError(f"background save of step {self._inflight_step} failed: {cause}") from error

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._committer.shutdown(wait=True)
            if self.async_mode == "process":
                stop_uploader_process()
            if self._stager is not None:
                self._stager.close()
                self._stager = None
            if self._lock is not None:
                self._lock.release()
                self._lock = None

    # ------------------------------------------------------------ resume

    def find_resume(self, resume: str) -> str | None:
        """'none' -> None; 'auto' -> newest verified checkpoint (skips are logged); a path -> that one."""
        return _resume.find_resume(self.dir, resume, self.pg, self.on_log, self.on_event)

    def saved_config(self, path: str) -> str | None:
        """The training config saved in `path` (rank 0 reads it, every rank receives it), None if it has none."""
        return self._on_rank0_then_share(lambda: read_saved_config(path))

    def verify(self, path: str) -> dict:
        return _resume.verify(path, self.pg)

    def load(self, path: str, state: dict, model_state: dict | None = None, prefix: str = "") -> None:
        """Load `state` in place (resume.py); `model_state` is checked against the keys under `prefix` first."""
        _resume.load(path, state, self.pg, model_state, prefix)
        if os.path.realpath(os.path.dirname(os.path.normpath(path))) == os.path.realpath(self.dir):
            self.last_saved_step = step_of(path)  # a final save of this same step must not rewrite (and risk) it


def latest_committed_step(ckpt_dir: str) -> int | None:
    steps = [s for s, p in list_step_dirs(ckpt_dir) if is_marked_committed(p)]
    return steps[-1] if steps else None


__all__ = ["CheckpointManager", "CheckpointError", "DiskFullError", "collective_timed_out", "latest_committed_step"]

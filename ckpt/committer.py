"""The committer: once a save's data is durable, rank 0 writes its commit marker; then retention empties
<ckpt.dir>/.trash on every rank. Owns the committer thread (one per process, "ckpt-commit").

    python -m pytest tests/test_retention.py tests/test_ckpt_unit.py tests/test_faults.py -q

The protocol, per save:
1. commit: rank 0 writes commit.json from every rank's digests, which DCP's finish gathered (commit_protocol.py). The save
   is committed once the marker is durable: a sync save returns there, and the `checkpoint` event's committed_s
   stops there. A sync save commits on the calling thread and every rank receives rank 0's outcome
   (`commit_sync`); an async one commits on the committer thread once its upload is done (`start_async_commit`).
2. retention, on the committer thread of every rank, for sync and async saves alike (`start_retention`): rank 0
   moves the folders retention dooms into .trash (on S3: deletes their markers), lists it (their objects) and shares
   the list; each rank deletes every W-th file; after a barrier rank 0 removes the rest (retention.py). O(bytes / W) per rank; nobody waits while one
   rank deletes a whole checkpoint. A `retention` event (rank 0) says what went.
3. errors on the committer thread stay in the future the manager holds, which raises them on every rank at
   the same call (manager.py, the agreement). A failed upload or commit still joins the sweep, a collective,
   unless the group itself timed out. A failed sweep after a commit is a RetentionError: the checkpoint
   stands (the manager warns). Recording an event never raises (a logger's failure must not make rank 0 skip
   a collective): it is logged.
Which thread may use which process group: CheckpointManager.__init__ (manager.py), the one place that says so.
"""

from __future__ import annotations

import contextlib
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import torch.distributed as dist

from common.dist import on_rank0_then_share
from .commit_protocol import commit_checkpoint
from .errors import SAVE_ERRORS, CheckpointError, RetentionError, cause_line, collective_timed_out, save_failure
from .faults import fault_at
from .retention import apply_retention, delete_share, list_trash, remove_trash
from .saver import StagingWait, prepare_step_dir


def record_event(on_event: Callable[..., None], on_log: Callable[[str], None], name: str, **fields) -> None:
    """`on_event(name, **fields)`; a failure to record is logged, never raised (rank 0 must not skip a collective
    because a logger failed)."""
    try:
        on_event(name, **fields)
    except Exception as e:  # noqa: BLE001 - e.g. a TensorBoard/W&B write; the protocol goes on
        on_log(f"warning: could not record the {name} event: {type(e).__name__}: {e}")


class Committer:
    def __init__(self, ckpt_dir: str, pg, keep_last: int, keep_best: int, on_event: Callable[..., None],
                 on_log: Callable[[str], None]):
        """`pg`: the checkpoint group the manager made; the sweep is a collective on it."""
        self.dir, self.pg, self.keep_last, self.keep_best = ckpt_dir, pg, keep_last, keep_best
        self._on_event, self.on_log = on_event, on_log
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-commit")

    def close(self) -> None:
        self._thread.shutdown(wait=True)

    def on_event(self, name: str, **fields) -> None:
        record_event(self._on_event, self.on_log, name, **fields)

    def prepare(self, path: str, step: int, files: dict[str, str]) -> None:
        """Before a save writes: rank 0 makes the step folder and its small files (saver.py), every rank receives
        the outcome; a leftover of the same step moved into .trash is swept first, so its space is free."""
        if on_rank0_then_share(lambda: prepare_step_dir(self.dir, path, files, self.on_log), self.pg, CheckpointError):
            self.sweep_trash(step)

    # ------------------------------------------------------------ commit

    @fault_at("before_commit")
    def commit_on_rank0(self, path: str, step: int, metadata, own_files: list[str], share: bool) -> None:
        """Every rank, once its data is durable: rank 0 commits; `share` (a sync save): every rank receives the
        outcome, else (the committer thread) only rank 0 learns it, and the agreement in manager.py tells all."""
        if share:
            on_rank0_then_share(lambda: self.commit(path, step, metadata, own_files), self.pg, CheckpointError)
        elif self.rank == 0:
            self.commit(path, step, metadata, own_files)

    def commit(self, path: str, step: int, metadata, own_files: list[str]) -> None:
        """Rank 0: write the marker. The checkpoint is committed once it is durable."""
        size = self._write_marker(path, step, metadata, own_files)
        self.on_log(f"checkpoint step {step} committed: {path} ({size / 2**20:.1f} MiB)")

    @fault_at("after_commit", after=True)
    def _write_marker(self, path: str, step: int, metadata, own_files: list[str]) -> int:
        """The marker, durable; returns the checkpoint's bytes."""
        try:
            marker = commit_checkpoint(path, self.world_size, metadata.file_digests, metadata, own_files)
        except OSError as e:
            raise save_failure(e, self.dir, f"the commit marker of {path}") from e
        return sum(f["size"] for f in marker["files"].values())

    def commit_sync(self, path: str, step: int, metadata, own_files: list[str], t0: float, upload_s: float) -> float:
        """A sync save, on the calling thread of every rank: rank 0 commits, every rank receives the outcome.
        Returns the seconds since `t0`, the save's start: all of it blocked training."""
        try:
            self.commit_on_rank0(path, step, metadata, own_files, share=True)
        except SAVE_ERRORS as e:
            raise save_failure(e, self.dir, f"checkpoint {path}") from e
        blocking_s = time.perf_counter() - t0
        self.on_event("checkpoint", step=step, path=path, mode="sync", blocking_s=blocking_s, upload_s=upload_s,
                      committed_s=blocking_s)
        return blocking_s

    def start_async_commit(self, upload: Future, path: str, step: int, mode: str, t0: float, blocking_s: float,
                           own_files: list[str], staged: StagingWait) -> Future:
        """An async save: on the committer thread, wait for `upload`, commit, then retention. `blocking_s`: what
        save() blocked training; `staged` adds the training thread's wait for background staging."""
        return self._thread.submit(self._finish_async, upload, path, step, mode, t0, blocking_s, own_files, staged)

    def _finish_async(self, upload: Future, path: str, step: int, mode: str, t0: float, blocking_s: float,
                      own_files: list[str], staged: StagingWait) -> None:
        try:
            metadata = upload.result()
            upload_s = time.perf_counter() - t0
            self.commit_on_rank0(path, step, metadata, own_files, share=False)
        except SAVE_ERRORS as e:
            # The sweep is a collective: every rank joins it whatever its own outcome (DCP's upload fails on all
            # ranks alike, rank 0's commit or a fault point on one), unless the group itself is broken.
            if not collective_timed_out(e):
                with contextlib.suppress(*SAVE_ERRORS):  # the save's own error is the one to report
                    self.sweep_trash(step)
            raise save_failure(e, self.dir, f"checkpoint {path} (in the background)") from e
        committed_s = time.perf_counter() - t0
        # The upload is done, so staging is too: the training thread's wait, if not yet recorded, returns at
        # once when it comes. Bounded, so a job that exits without wait_for_staging() never hangs here.
        staged.done.wait(timeout=5.0)
        self.on_event("checkpoint", step=step, path=path, mode=mode, blocking_s=blocking_s + staged.wait_s,
                      upload_s=upload_s, committed_s=committed_s, staging_wait_s=staged.wait_s)
        self.apply_retention(step)

    # ------------------------------------------------------------ retention (every rank)

    def start_retention(self, newest: int) -> Future:
        """Retention after a sync save's commit, on the committer thread."""
        return self._thread.submit(self.apply_retention, newest)

    def apply_retention(self, newest: int) -> None:
        """Retention after the commit of `newest`, on every rank together: rank 0 moves the folders it dooms
        into .trash (renames), then every rank deletes its share (retention.py). Raises RetentionError."""
        try:
            self.sweep_trash(newest, lambda: apply_retention(self.dir, newest, self.keep_last, self.keep_best,
                                                             self.on_log))
        except SAVE_ERRORS as e:
            raise RetentionError(f"checkpoint step {newest} is committed, but deleting old checkpoints after it "
                                 f"failed: {cause_line(e)}") from e

    def sweep_trash(self, step: int, doom: Callable[[], list[str]] = lambda: []) -> None:
        """Empty <ckpt.dir>/.trash, a collective on self.pg: rank 0 runs `doom` (moves more folders in, returns
        their paths), lists .trash and shares the list; each rank deletes every W-th file; after a barrier
        rank 0 removes the rest. O(bytes / W) per rank. A `retention` event (rank 0) says what it deleted."""
        t0 = time.perf_counter()
        gone, files = self._doom_and_list(step, doom)
        if files is not None:  # None (no .trash) is the same answer on every rank
            delete_share(self.dir, files, self.rank, self.world_size)
            if self.pg is not None:
                dist.barrier(group=self.pg)
            if self.rank == 0:
                remove_trash(self.dir, self.on_log, gone)
        if self.rank == 0 and (gone or files):
            for path in gone:
                self.on_log(f"retention: deleted {path}")
            self.on_event("retention", step=step, deleted=gone, files=len(files or []),
                          seconds=time.perf_counter() - t0)

    @fault_at("sweep", after=True)
    def _doom_and_list(self, step: int, doom: Callable[[], list[str]]) -> tuple[list[str], list[str] | None]:
        """Rank 0 runs `doom` and lists .trash (None: no .trash); every rank receives both."""
        try:
            def doom_and_list() -> tuple[list[str], list[str] | None]:
                gone = doom()
                return gone, list_trash(self.dir, gone)  # an object store lists the prefixes just doomed
            return on_rank0_then_share(doom_and_list, self.pg, CheckpointError)
        except CheckpointError as e:
            raise CheckpointError(f"retention after checkpoint step {step}: {e}") from None

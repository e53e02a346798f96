"""How the bytes of one save are written: its folder and small files, then DCP's sync save, or an async one that
returns once the state is staged.

    python -m pytest tests/test_staging_wait.py tests/test_save_errors.py tests/test_faults.py -q

The protocol (CheckpointManager.save runs it, after draining the previous save):
1. rank 0 makes <ckpt.dir>/step-NNNNNN and writes the small files (meta.json, config.yaml) into it
   (`prepare_step_dir`); a leftover there, from a crashed save of this step, goes to .trash first.
2. sync (`write_sync`): `dcp.save` returns once every rank's shards and digests are durable; the commit follows
   on the calling thread (committer.py).
3. async (`start_async`): `dcp.async_save` stages the state into host memory (pinned; shared memory in process
   mode) and hands the upload to DCP's thread or process; the committer thread waits for it. On CUDA the
   staging itself runs in the background too: `StagingWait` is what the training thread must wait for before
   the optimizer changes the parameters, and how long it waited.
A failure is raised as a one-line CheckpointError (errors.py) naming the folder, or /dev/shm for process mode's
staging. `pg` is the manager's checkpoint group; which thread may use it: CheckpointManager.__init__ (manager.py).
"""

from __future__ import annotations

import threading
import time
from contextlib import nullcontext
from concurrent.futures import Future
from typing import Callable

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, AsyncSaveResponse

from . import collector
from .errors import SAVE_ERRORS, save_failure
from .faults import fault_at
from .retention import clear_stale
from .storage import join, storage_for
from .uploader import save_planner, preemption_signals_blocked, uploader_store, CheckpointWriter


def prepare_step_dir(ckpt_dir: str, path: str, files: dict[str, str], on_log: Callable[[str], None]) -> bool:
    """Rank 0: create `path` and write `files` (name -> text) into it. Returns whether a stale folder of the same
    step was moved to .trash first (then the caller sweeps it, so its bytes are freed before this save writes)."""
    store = storage_for(path)
    try:
        # a leftover of a crashed save of this same step, never committed data we keep
        stale = store.occupied(path) and clear_stale(path, on_log)
        store.prepare_folder(path)  # an object store: no folder to make, objects only
        for name, text in files.items():
            store.create(join(path, name), text.encode())
    except OSError as e:
        raise save_failure(e, ckpt_dir, f"checkpoint {path}") from e
    return stale


def write_sync(state: dict, path: str, step: int, pg, ckpt_dir: str) -> Metadata:
    """Every rank: write its shards of `state` (checksummed as written) and return DCP's metadata, which carries
    every rank's file digests for the marker."""
    try:
        with collector.paused(collector.coordinates(pg)):  # the coordinator's GC pauses would stop its heartbeat
            return dcp.save(state, storage_writer=CheckpointWriter(path, step), process_group=pg,
                            planner=save_planner(ckpt_dir, pg))
    except SAVE_ERRORS as e:
        raise save_failure(e, ckpt_dir, f"checkpoint {path}") from e


class StagingWait:
    """One async save's staging as the training thread sees it: `future` (background staging on CUDA, else
    None: staged already), how long the training thread waited for it, and `done` once it has. `staged`: what
    the stager returned (the staged state dict, or its future), which a second save of the same step may reuse."""

    def __init__(self, future: Future | None, staged=None):
        self.future, self.staged, self.wait_s, self.done = future, staged, 0.0, threading.Event()
        if future is None:
            self.done.set()

    def wait(self) -> None:
        """Training thread: block until the staged copy is complete; the time goes into the checkpoint event."""
        if self.done.is_set():
            return
        t0 = time.perf_counter()
        try:
            self.future.result()
        finally:
            self.wait_s = time.perf_counter() - t0
            self.done.set()


class _Recorded:
    """A stager that remembers what it staged (StagingWait.staged); everything else is the stager's."""

    def __init__(self, stager):
        self.stager, self.staged = stager, None

    def stage(self, state_dict):
        self.staged = self.stager.stage(state_dict)
        return self.staged

    def __getattr__(self, name):
        return getattr(self.stager, name)


class Replay:
    """A stager that stages nothing: it hands DCP a copy another save already staged (StagingWait.staged)."""
    should_synchronize_after_execute = False

    def __init__(self, staged):
        self.staged = staged

    def stage(self, _state_dict):
        return self.staged

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


def wait_for_state_writes() -> None:
    """DCP copies the state to the host on a staging stream of its own, which does not wait for the compute
    stream: the writes already launched (`optimizer.step()` right before the save) must be done first, or the
    copy mixes values from before and after them. A no-op in the training loop, which has just synchronised."""
    if torch.cuda.is_initialized():
        torch.cuda.current_stream().synchronize()


@fault_at("staged", after=True)
def start_async(state: dict, path: str, step: int, pg, stager: AsyncStager, async_mode: str,
                ckpt_dir: str, writer: type = CheckpointWriter, upload_nice: int = 0) -> tuple[Future, StagingWait]:
    """Every rank: stage `state` and start its upload in DCP's uploader (`async_mode` thread or process, whose
    signal mask keeps preemption signals out and whose priority is lowered to `upload_nice`, uploader.py),
    through `writer` and its planner. Returns the upload's future (DCP's metadata) and the staging to wait for."""
    kind = AsyncCheckpointerType.PROCESS if async_mode == "process" else AsyncCheckpointerType.THREAD
    recorded = _Recorded(stager)
    wait_for_state_writes()
    # thread mode: the coordinator plans in this process, its GC pauses would stop the heartbeat (collector.py)
    resumed = collector.paused_until(async_mode == "thread" and collector.coordinates(pg))
    try:
        with preemption_signals_blocked(), uploader_store(pg) if async_mode == "process" else nullcontext():
            resp = dcp.async_save(state, storage_writer=writer(path, step, upload_nice), process_group=pg,
                                  async_stager=recorded, planner=save_planner(ckpt_dir, pg, writer.dedup_to_lowest_rank),
                                  async_checkpointer_type=kind)
    except BaseException as e:
        resumed(None)
        if not isinstance(e, SAVE_ERRORS):
            raise
        raise save_failure(e, "/dev/shm" if async_mode == "process" else ckpt_dir,
                           f"the staged copy of checkpoint {path}") from e
    resumed(resp.upload_completion if isinstance(resp, AsyncSaveResponse) else resp)
    if isinstance(resp, AsyncSaveResponse):  # staging runs in the background (CUDA)
        return resp.upload_completion, StagingWait(resp.staging_completion, recorded.staged)
    return resp, StagingWait(None, recorded.staged)

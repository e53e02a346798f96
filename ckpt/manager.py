"""CheckpointManager: the training script says *when* (save / load / finish); this decides *how*.

    python -m pytest tests/test_ckpt_resume.py

- save(): sync (`dcp.save`) or async (`dcp.async_save` with a reused `DefaultStager`, thread or
  process uploader). Training blocks only while the state is staged; at most one save is in flight.
- commit: each rank checksums the files it writes as it writes them; DCP's finish gathers the digests
  to rank 0, which writes the marker from them (commit.py), then applies retention. Errors in the
  background are kept and raised by the next poll()/wait()/save().
- load(): verified checkpoints only, each rank checking its share of the files (O(bytes / W)) and all
  agreeing on the verdict; resume="auto" walks back from the newest, logging what it skips.
- lock: rank 0 holds <ckpt.dir>/.lock for the life of the job (lock.py).
Checkpoint collectives run on a dedicated gloo group, so they never queue behind training collectives
and async save has the CPU backend it needs even when training runs on NCCL.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import json
import logging
import os
import shutil
import signal
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException, FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, AsyncSaveResponse

from .checksum import ChecksummingWriter
from .commit import VerifyError, check_files, check_manifest, commit_checkpoint, shares
from .lock import DirLock, LockError
from .faults import TornWriteFileSystem, fault_point, wants
from .preflight import process_staging_shortfall
from .inspect import read_meta_or_empty
from .layout import COMMIT_FILE, CONFIG_FILE, list_step_dirs, is_marked_committed, step_dir, step_of


class CheckpointError(RuntimeError):
    """A save, load or lock problem; the message names the checkpoint and the cause."""


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


def _cause(error: BaseException) -> str:
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
    return CheckpointError(f"writing {what} failed: {_cause(error)}")


class _Writer(ChecksummingWriter):
    """The checkpoint writer (fsync + checksums, checksum.py) with the `write` fault point for the tests.

    per_thread_copy_ahead=0: the staged state is already in host memory, and DCP's default (10 MB) sends
    the upload through its CUDA-stream loader, which opens a CUDA context on GPU 0 from every rank's
    uploader thread or process."""

    def __init__(self, path: str, step: int):
        torn = TornWriteFileSystem(step) if wants("partial_write") else None  # tests: files that tear early
        super().__init__(path, torn, per_thread_copy_ahead=0)
        self.step = step

    def write_data(self, plan, planner):
        fault_point("write", self.step)
        return super().write_data(plan, planner)


class _StagingWait:
    """What the training thread waited for one save's background staging, and when it has (see wait_for_staging)."""

    def __init__(self):
        self.wait_s = 0.0
        self.done = threading.Event()


def _noop(*_args, **_kwargs) -> None:
    pass


def _planner() -> DefaultSavePlanner:
    """Save-plan caching: from the second save on, a rank whose local plan is unchanged (same keys,
    shapes, shards) sends DCP's coordinator an empty plan and reuses the cached global plan."""
    return DefaultSavePlanner(enable_plan_caching=True)


@contextlib.contextmanager
def _preemption_signals_blocked():
    """Block SIGTERM/SIGUSR1 while DCP starts its upload thread (and, in process mode, the uploader
    process): both inherit the mask, so a preemption signal sent to every process of the job (SLURM
    does) reaches only the training process, which finishes the in-flight upload before its emergency
    save, instead of killing the uploader mid-write. A signal arriving meanwhile stays pending and is
    delivered to the training process when the mask is restored."""
    from multiprocessing import resource_tracker
    resource_tracker.ensure_running()  # started lazily later, it would SIG_UNBLOCK SIGTERM in the spawning thread
    atexit.register(stop_uploader_process)  # the uploader ignores SIGTERM, so multiprocessing's exit hook can't stop it
    sigs = {signal.SIGTERM, signal.SIGUSR1}
    old = signal.pthread_sigmask(signal.SIG_BLOCK, sigs)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def stop_uploader_process() -> None:
    """Stop DCP's process-mode uploader: ask it to exit, SIGKILL it if it doesn't within 30 s.

    It has SIGTERM blocked (above), so `Process.terminate()` in multiprocessing's own exit hook would
    wait forever. DCP keeps it in a private module global; this is the one place that touches it."""
    from torch.distributed.checkpoint import _async_process_executor as uploader
    proc = getattr(uploader, "_CHECKPOINT_PROCESS", None)
    if proc is None:
        return
    uploader._CHECKPOINT_PROCESS = None
    try:
        if proc._save_process.is_alive():
            proc._send(uploader._CheckpointSaveProcessControlOpts.TERMINATE)
            proc._save_process.join(timeout=30)
    except (OSError, EOFError):  # pipe already gone: the process is dead or dying
        pass
    finally:
        if proc._save_process.is_alive():
            proc._save_process.kill()
            proc._save_process.join()


def collective_timed_out(error: BaseException) -> bool:
    """Whether `error` is a collective that gave up waiting for a rank (gloo's "Timed out waiting ...", as
    such, as a cause, or inside a DCP CheckpointException). NCCL's watchdog aborts the process instead."""
    return any(isinstance(e, RuntimeError) and "Timed out waiting" in str(e) for e in _errors_in(error))


def quiet_uploader_logs() -> None:
    """Call in DCP's process-mode uploader while it starts (spawn re-imports the training script there, as
    `__mp_main__`): DCP sets the root logger to INFO in that process and prints about 3 lines per rank per
    save. Warnings and errors still print."""
    logging.disable(logging.INFO)


def on_rank0_then_share(fn: Callable[[], object], group=None, error_type=None) -> object:
    """Run fn on rank 0 only and hand every rank its result or its error, so all ranks fail together
    with the same message instead of the others hanging in the next collective."""
    error_type = error_type or CheckpointError
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
        return on_rank0_then_share(fn, self.pg)

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
            cuda = torch.cuda.is_available()
            # Reused across saves: StateDictStager caches its CPU buffers per source storage, so only
            # the first save allocates. Shared memory lets the uploader process read them with no copy.
            self._stager = DefaultStager(StagingOptions(
                use_pinned_memory=cuda, use_shared_memory=self.async_mode == "process",
                use_async_staging=cuda, use_non_blocking_copy=cuda))
        return self._stager

    def save(self, step: int, state: dict, files: dict[str, str], blocking: bool = False) -> float:
        """Save `state` (Statefuls and plain values) as step-NNNNNN; returns the training-blocking seconds.

        `files` (name -> text) are written beside the shards by rank 0 (meta.json, config.yaml).
        blocking=True (or async_mode=off) returns only once the checkpoint is committed.
        """
        t0 = time.perf_counter()
        self.wait()  # at most one save in flight; raises a previous save's error
        path = step_dir(self.dir, step)

        def prepare():
            if os.path.lexists(path):
                self._clear_stale(path)  # leftover of a crashed save of this same step, never committed data we keep
            try:
                os.makedirs(path)
                for name, text in files.items():
                    with open(os.path.join(path, name), "w") as f:
                        f.write(text)
            except OSError as e:
                raise save_failure(e, self.dir, f"checkpoint {path}") from e
        self._on_rank0_then_share(prepare)
        writer = _Writer(path, step)
        if blocking or self.async_mode == "off":
            try:
                metadata = dcp.save(state, storage_writer=writer, process_group=self.pg, planner=_planner())
                upload_s = time.perf_counter() - t0
                fault_point("before_commit", step)
                retention_s = self._on_rank0_then_share(lambda: self._commit(path, step, metadata, list(files)))
            except SAVE_ERRORS as e:
                raise save_failure(e, self.dir, f"checkpoint {path}") from e
            blocking_s = time.perf_counter() - t0
            self.last_saved_step = step
            self.on_event("checkpoint", step=step, path=path, mode="sync", blocking_s=blocking_s, upload_s=upload_s,
                          committed_s=blocking_s - retention_s, retention_s=retention_s)
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
            retention_s = self._commit(path, step, metadata, own_files) if self.rank == 0 else 0.0
        except SAVE_ERRORS as e:
            raise save_failure(e, self.dir, f"checkpoint {path} (in the background)") from e
        committed_s = time.perf_counter() - t0 - retention_s
        # The upload is done, so staging is too: the training thread's wait, if not yet recorded, returns at
        # once when it comes. Bounded, so a job that exits without wait_for_staging() never hangs here.
        staged.done.wait(timeout=5.0)
        self.on_event("checkpoint", step=step, path=path, mode=self.async_mode, blocking_s=blocking_s + staged.wait_s,
                      upload_s=upload_s, committed_s=committed_s, staging_wait_s=staged.wait_s, retention_s=retention_s)

    def _clear_stale(self, path: str) -> None:
        """Remove a folder (or anything else) in the way of this step's save. It is not a checkpoint this job
        trusts: resume verified newer ones and skipped it, or it is this job's own failed attempt. If it
        cannot be removed (a damaged tree), it is moved aside so the save goes on."""
        _remove_checkpoint(path)
        if os.path.lexists(path):
            aside = f"{path}.damaged-{os.getpid()}-{int(time.time())}"
            os.replace(path, aside)
            self.on_log(f"checkpoint: moved damaged {path} aside to {aside}")

    def _commit(self, path: str, step: int, metadata, own_files: list[str]) -> float:
        """Write the marker, then apply retention; returns the seconds retention took. The checkpoint is
        committed once the marker is durable, so committed_s stops there: deleting old checkpoints (rmtree of
        GBs, 0.3 s per GB here) comes after and is reported apart as retention_s."""
        try:
            marker = commit_checkpoint(path, self.world_size, metadata.file_digests, metadata, own_files)
        except OSError as e:
            raise save_failure(e, self.dir, f"the commit marker of {path}") from e
        fault_point("after_commit", step)
        size = sum(f["size"] for f in marker["files"].values())
        self.on_log(f"checkpoint step {step} committed: {path} ({size / 2**20:.1f} MiB)")
        t0 = time.perf_counter()
        self._apply_retention(step)
        return time.perf_counter() - t0

    def _apply_retention(self, newest: int) -> None:
        """Delete committed checkpoints beyond keep_last (oldest first) and dead partial folders older
        than `newest`, the step just committed. Folders of later steps are left alone: they are from an
        earlier run (e.g. skipped as corrupt on resume) and must not push out the checkpoint just made.
        Runs right after a commit, when no other save can be in flight."""
        dirs = [(s, p) for s, p in list_step_dirs(self.dir) if s <= newest]
        committed = [(s, p) for s, p in dirs if is_marked_committed(p)]
        doomed = committed[:-self.keep_last] if self.keep_last else []
        best = best_scored(committed, self.keep_best)
        doomed = [(s, p) for s, p in doomed if s not in best]
        doomed += [(s, p) for s, p in dirs if s < newest and not is_marked_committed(p)]
        for s, p in doomed:
            _remove_checkpoint(p)
            self.on_log(f"retention: deleted {p}")

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
        """'none' -> None; 'auto' -> newest verified checkpoint (skips are logged); a path -> that one.
        Every rank takes part: rank 0 lists the folders, each rank checks its share of each one's files."""
        if resume == "none":
            return None
        if resume != "auto":
            try:
                self.verify(resume)
            except VerifyError as e:
                raise CheckpointError(f"cannot resume from {resume}: {e}") from None
            return resume
        for step, path in reversed(self._on_rank0_then_share(lambda: list_step_dirs(self.dir))):
            try:
                self.verify(path)
                return path
            except VerifyError as e:
                self.on_log(f"resume: skipping {path}: {e}")
                self.on_event("resume_skip", step=step, path=path, reason=str(e))
        return None

    def verify(self, path: str) -> dict:
        """verify_checkpoint split over the ranks: rank 0 checks the manifest (no data read), each rank the
        sizes and checksums of its share of the files (O(bytes / W)), and all agree on one verdict.
        Returns the marker; raises VerifyError, with the same message, on every rank."""
        marker = on_rank0_then_share(lambda: check_manifest(path), self.pg, VerifyError)
        mine = shares(marker["files"], self.world_size)[self.rank]
        problem = check_files(path, marker, mine)
        if self.pg is not None:
            flag = torch.tensor([float(problem is not None)])
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.pg)
            if flag.item():  # only on failure: every rank learns the first problem found
                problems = [None] * self.world_size
                dist.all_gather_object(problems, problem, group=self.pg)
                problem = next(p for p in problems if p is not None)
        if problem:
            raise VerifyError(problem)
        return marker

    def load(self, path: str, state: dict, model_state: dict | None = None, prefix: str = "app.model.") -> None:
        """Load `state` in place from a verified checkpoint; `model_state` (the current model's state
        dict) is checked against the saved shapes first, for an error that names the mismatch."""
        if model_state is not None:
            check_model_matches(path, model_state, prefix)
        try:
            dcp.load(state, checkpoint_id=path, process_group=self.pg)
        except SAVE_ERRORS as e:
            raise CheckpointError(f"loading {path} failed: {_cause(e)}") from e
        if os.path.realpath(os.path.dirname(os.path.normpath(path))) == os.path.realpath(self.dir):
            self.last_saved_step = step_of(path)  # a final save of this same step must not rewrite (and risk) it


def _remove_checkpoint(path: str) -> None:
    """Marker first: a crash halfway through leaves an uncommitted folder, never a marked partial one.
    Anything may stand where a file or folder belongs (a folder named commit.json, a file named step-N)."""
    if not os.path.isdir(path) or os.path.islink(path):
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)
        return
    marker = os.path.join(path, COMMIT_FILE)
    if os.path.isdir(marker) and not os.path.islink(marker):
        shutil.rmtree(marker, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.remove(marker)
    shutil.rmtree(path, ignore_errors=True)


def best_scored(checkpoints: list[tuple[int, str]], k: int) -> set[int]:
    """Steps of the k checkpoints with the lowest meta.json `score` (the trainer's eval loss); unscored never count."""
    scored = [(meta["score"], s) for s, p in checkpoints if k and "score" in (meta := read_meta_or_empty(p))]
    return {s for _, s in sorted(scored)[:k]}


def read_meta(path: str) -> dict:
    with open(os.path.join(path, "meta.json")) as f:
        return json.load(f)


def read_saved_config(path: str) -> str | None:
    """The training config saved beside the shards (text), or None for a checkpoint without one."""
    try:
        with open(os.path.join(path, CONFIG_FILE)) as f:
            return f.read()
    except FileNotFoundError:
        return None


def _few(names: list[str], shown: int = 3) -> str:
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(f"'{n}'" for n in names[:shown]) + more


def check_model_matches(path: str, model_state: dict, prefix: str = "app.model.") -> None:
    """Same tensor names in both directions, and the same shapes: a checkpoint of a deeper model must not
    load into a shallower one by leaving the extra layers behind."""
    saved = FileSystemReader(path).read_metadata().state_dict_metadata
    in_ckpt = {k[len(prefix):] for k in saved if k.startswith(prefix)}
    lacking = sorted(set(model_state) - in_ckpt)
    extra = sorted(in_ckpt - set(model_state))
    if lacking:
        raise CheckpointError(f"checkpoint {path} does not match the model: it has no {_few(lacking)} "
                              "(a different model architecture?)")
    if extra:
        raise CheckpointError(f"checkpoint {path} does not match the model: the model has no {_few(extra)} "
                              f"({len(extra)} saved tensors; a different model architecture?)")
    for name, tensor in model_state.items():
        key = prefix + name
        saved_shape = tuple(getattr(saved[key], "size", ()))
        if saved_shape != tuple(tensor.shape):
            raise CheckpointError(f"checkpoint {path} does not match the model: '{name}' is {list(saved_shape)} "
                                  f"in the checkpoint but {list(tensor.shape)} in the model")


def latest_committed_step(ckpt_dir: str) -> int | None:
    steps = [s for s, p in list_step_dirs(ckpt_dir) if is_marked_committed(p)]
    return steps[-1] if steps else None


__all__ = ["CheckpointManager", "CheckpointError", "DiskFullError", "best_scored", "collective_timed_out",
           "on_rank0_then_share", "read_meta", "read_saved_config", "latest_committed_step", "step_of"]

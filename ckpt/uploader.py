"""DCP's uploader, as the saver (saver.py) uses it: the checksumming writer, the save planner, and the signal mask
and shutdown of the process-mode uploader (the stager: prestage.py).

    python -m pytest tests/test_staging_wait.py tests/test_preemption.py -q
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import os
import signal
import socket
import sys
import threading
import time
from typing import Iterator

import torch
import torch.distributed as dist
from torch.distributed import TCPStore
from torch.distributed.checkpoint import _async_process_executor as dcp_uploader

from common.procfs import stat_fields

from .checksum import ChecksummingWriter
from .faults import TornWriteFileSystem, fault_at, wants
from .save_plan import SweepSavePlanner
from .storage import storage_for
from .writeback import WritebackFileSystem


class CheckpointWriter(ChecksummingWriter):
    """The checkpoint writer (fsync + checksums, checksum.py) with the `write` fault point for the tests. Local
    files go through WritebackFileSystem (bounded writes, writeback started as they go: writeback.py), with
    torch.save's own CRC-32 off (torch_save_without_crc32).

    per_thread_copy_ahead=0: the staged state is already in host memory, and DCP's default (10 MB) sends
    the upload through its CUDA-stream loader, which opens a CUDA context on GPU 0 from every rank's
    uploader thread or process."""
    dedup_to_lowest_rank = False  # the save planner's: DCP spreads the items every rank holds over the ranks
    local_filesystem = WritebackFileSystem

    def __init__(self, path: str, step: int, upload_nice: int = 0):
        """`upload_nice`: the niceness (0-19) the upload takes when it runs off the training thread (an async
        save's uploader thread or process): see lower_priority."""
        # tests: files that tear early, where a reader can see a partial write (an object store shows an object
        # whole or not at all)
        store = storage_for(path)
        torn = TornWriteFileSystem(step) if wants("partial_write") and store.partial_writes else None
        super().__init__(path, torn or store.writer_filesystem(self.local_filesystem), per_thread_copy_ahead=0)
        self.step, self.upload_nice = step, upload_nice
        self.created_on = (os.getpid(), threading.get_native_id())  # the training thread: never lowered

    @fault_at("write")
    def write_data(self, plan, planner):
        if self.upload_nice and (os.getpid(), threading.get_native_id()) != self.created_on:
            lower_priority(self.upload_nice)
        with torch_save_without_crc32():
            return super().write_data(plan, planner)


def lower_priority(nice: int) -> None:
    """Give the calling thread (an async upload: its writes, checksums and the kernel's copying into the page
    cache run on it) niceness `nice`, so that the training threads of the machine get the cores first and the
    upload takes what they leave: a step that overlaps an upload slows less, the commit comes later
    (docs/performance.md measures both). Linux keeps a niceness per thread; a thread can lower its priority, not
    raise it back, so it is never done to the training thread. No I/O priority: it only counts with the bfq
    scheduler, and the disk here (and most NVMe) uses none or mq-deadline."""
    if not sys.platform.startswith("linux"):  # elsewhere the niceness is the whole process's: training's too
        return
    tid = threading.get_native_id()
    with contextlib.suppress(OSError):  # not allowed (a container's policy): the upload runs at training's priority
        os.setpriority(os.PRIO_PROCESS, tid, max(nice, os.getpriority(os.PRIO_PROCESS, tid)))


_crc32 = {"lock": threading.Lock(), "writers": 0, "before": True}


@contextlib.contextmanager
def torch_save_without_crc32():
    """torch.save's CRC-32 of each record, off while checkpoint files are written. DCP writes every tensor with
    torch.save; torch.load never checks that CRC (torch.serialization.set_crc32_options: files without it load),
    and the commit marker's XXH3 digest of every file is the check here. It was a quarter of the write path's
    time (0.49 of 1.95 s writing 0.89 GB to /dev/shm). The setting is process-wide, so writers are counted: the
    last one to finish restores what was set before the first began."""
    with _crc32["lock"]:
        if _crc32["writers"] == 0:
            _crc32["before"] = torch.serialization.get_crc32_options()
            torch.serialization.set_crc32_options(False)
        _crc32["writers"] += 1
    try:
        yield
    finally:
        with _crc32["lock"]:
            _crc32["writers"] -= 1
            if _crc32["writers"] == 0:
                torch.serialization.set_crc32_options(_crc32["before"])


def save_planner(ckpt_dir: str, pg, to_lowest_rank: bool = False) -> SweepSavePlanner:
    """Save-plan caching: from the second save on, a rank whose local plan is unchanged (same keys,
    shapes, shards) sends DCP's coordinator an empty plan and reuses the cached global plan.

    DCP keeps that cache per planner class name, process-wide (and a forked process inherits it), so two
    managers in one process, or one world size after another, would merge their plans: a W=2 save after a
    W=1 one in the same process failed in gloo's scatter with one plan for two ranks. One key per checkpoint
    dir and world size keeps them apart. `to_lowest_rank`: an item several ranks hold is written by the lowest
    of them, not spread over them (the memory tier, memory_tier/replicate.py). The planner is torch's
    DefaultSavePlanner with its global plan checked in O(n log n) chunks, not O(W^2) (save_plan.py)."""
    planner = SweepSavePlanner(enable_plan_caching=True, dedup_save_to_lowest_rank=to_lowest_rank)
    world_size = dist.get_world_size(pg) if dist.is_initialized() else 1
    planner._cached_plans_key = f"{type(planner).__name__}:{os.path.realpath(ckpt_dir)}:W={world_size}"
    return planner


@contextlib.contextmanager
def preemption_signals_blocked():
    """Block SIGTERM/SIGUSR1 while DCP starts its upload thread (and, in process mode, the uploader
    process): both inherit the mask, so a preemption signal sent to every process of the job (SLURM
    does) reaches only the training process, which finishes the in-flight upload before its emergency
    save, instead of killing the uploader mid-write. A signal arriving meanwhile stays pending and is
    delivered to the training process when the mask is restored."""
    from multiprocessing import resource_tracker
    resource_tracker.ensure_running()  # started lazily later, it would SIG_UNBLOCK SIGTERM in the spawning thread
    _stop_uploader_at_exit()
    sigs = {signal.SIGTERM, signal.SIGUSR1}
    old = signal.pthread_sigmask(signal.SIG_BLOCK, sigs)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


@functools.cache
def _stop_uploader_at_exit() -> None:
    """Once per process, not once per save: the uploader ignores SIGTERM, so multiprocessing's exit hook can't stop
    it."""
    atexit.register(stop_uploader_process)


# the worker's pid, as its uploader reads it: spawn records the parent as getppid() when the uploader starts, which
# is already another process if the worker was killed first
WORKER_PID_ENV = "CKPT_UPLOADER_WORKER_PID"
_UPLOADER_STORE: TCPStore | None = None  # rank 0: the store the process-mode uploaders meet at, kept while they run


@contextlib.contextmanager
def uploader_store(pg) -> Iterator[None]:
    """Around the dcp.async_save that starts the process-mode uploaders (the first, or the first after one died):
    they meet at a store rank 0 has already bound, not at a port DCP picks.

    DCP's own way asks the kernel for a free port, lets go of it and binds it again in the spawned uploader
    seconds later (after its imports); any outbound connection on the node can take that port meanwhile. In
    CI a storage client's connection took it, and the save failed with EADDRINUSE. With DCP_USE_PREFIX_STORE
    (read by every rank) DCP takes MASTER_ADDR/MASTER_PORT from rank 0 and broadcasts them, so rank 0's are
    pointed, for this call, at a store of its own: bound to port 0, it holds its port from the start, and it is
    new per uploader, so no key of an earlier one (a torchrun restart) is read by the next."""
    global _UPLOADER_STORE
    os.environ[WORKER_PID_ENV] = str(os.getpid())  # kept: DCP may spawn the uploader after this block has ended
    if dcp_uploader._CHECKPOINT_PROCESS is not None or not dist.is_initialized():
        yield
        return
    meet = {"DCP_USE_PREFIX_STORE": "1"}
    if dist.get_rank(pg) == 0:
        addr = os.environ.get("MASTER_ADDR") or socket.getfqdn()
        _UPLOADER_STORE = TCPStore(addr, 0, is_master=True, wait_for_workers=False)
        meet.update(MASTER_ADDR=addr, MASTER_PORT=str(_UPLOADER_STORE.port))
    saved = {k: os.environ.get(k) for k in meet}
    os.environ.update(meet)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def stop_uploader_process() -> None:
    """Stop DCP's process-mode uploader: ask it to exit, SIGKILL it if it doesn't within 30 s.

    It has SIGTERM blocked (above), so `Process.terminate()` in multiprocessing's own exit hook would
    wait forever. DCP keeps it in a private module global; this is the one place that touches it."""
    global _UPLOADER_STORE
    proc, _UPLOADER_STORE = dcp_uploader._CHECKPOINT_PROCESS, None
    if proc is None:
        return
    dcp_uploader._CHECKPOINT_PROCESS = None
    try:
        if proc._save_process.is_alive():
            proc._send(dcp_uploader._CheckpointSaveProcessControlOpts.TERMINATE)
            proc._save_process.join(timeout=30)
    except (OSError, EOFError):  # pipe already gone: the process is dead or dying
        pass
    finally:
        if proc._save_process.is_alive():
            proc._save_process.kill()
            proc._save_process.join()


def setup_uploader_process() -> None:
    """Call in DCP's process-mode uploader while it starts (spawn re-imports the training script there, as
    `__mp_main__`, with the training worker as its parent):
    - DCP sets the root logger to INFO in that process and prints about 3 lines per rank per save; warnings still
      print. Its errors do not (reported_by_the_worker): each is a failure it also sends to the worker.
    - the uploader must not outlive its worker: with the worker gone nothing can commit what it writes, and it
      would keep writing a large save and holding its shared memory. It has SIGTERM blocked (see above), and a
      parent-death signal (prctl) cannot be used: Linux sends it when the *thread* that spawned the process exits,
      and DCP spawns it from a thread pool it shuts down after the first save. So a guard process, forked here,
      checks once a second that the uploader's parent is still the worker, and SIGKILLs it when it is not (also
      mid-write). A thread in the uploader would need its GIL, which the uploader's main thread holds while it
      connects to rank 0's store (uploader_store): a worker killed then would leave its uploader retrying for
      the store's 5-minute timeout."""
    logging.disable(logging.INFO)
    logging.getLogger().addFilter(reported_by_the_worker)
    worker = int(os.environ.get(WORKER_PID_ENV) or os.getppid())
    uploader = os.getpid()
    if os.fork() == 0:
        _guard(uploader, worker)


def _guard(uploader: int, worker: int) -> None:
    """The uploader's guard process (setup_uploader_process): SIGKILL the uploader once its parent is no longer
    `worker`; end once the uploader has ended. It holds none of the uploader's descriptors, so the worker still
    sees the uploader's pipe close when the uploader dies."""
    close_inherited_fds()
    try:
        while os.getppid() == uploader:
            if _parent_of(uploader) not in (worker, None):
                os.kill(uploader, signal.SIGKILL)
                break
            time.sleep(1.0)
    finally:
        os._exit(0)


def close_inherited_fds() -> None:
    """Close every descriptor above stderr that /proc/self/fd lists: one close per open descriptor, where
    os.closerange(3, SC_OPEN_MAX) makes one per number on a Python built without close_range (glibc < 2.34, e.g.
    conda's), minutes where a container's nofile limit is ~1e9, which both launchers raise the soft limit to."""
    try:
        fds = [int(name) for name in os.listdir("/proc/self/fd")]
    except OSError:  # no /proc: every number up to the limit
        os.closerange(3, os.sysconf("SC_OPEN_MAX"))
        return
    for fd in fds:
        if fd > 2:
            with contextlib.suppress(OSError):  # the listing's own descriptor, closed already
                os.close(fd)


def _parent_of(pid: int) -> int | None:
    """`pid`'s parent, None if `pid` is gone."""
    try:
        return int(stat_fields(pid)[1])
    except (OSError, IndexError, ValueError):
        return None


def reported_by_the_worker(record: logging.LogRecord) -> bool:
    """A logging filter for DCP's uploader process: False for its error records. It logs every failed start or
    save, with str() of DCP's CheckpointException (every rank's traceback), and sends the same exception to its
    worker, which reports it once, as one line (errors.py: `error: no space left on ...`)."""
    return not (record.levelno >= logging.ERROR and record.module == "_async_process_executor")

"""The memory tier: the same checkpoint as the disk tier, every ckpt.memory_interval steps, into node-local memory
(tmpfs files under /dev/shm by default), so a job whose processes died resumes from RAM, at any world size.

    python -m pytest tests/test_memory_tier.py -q

The protocol (docs/memory-tier.md):
- a memory step is a second CheckpointManager's checkpoint in `memory_dir`: the same DCP files, per-file
  checksums and commit marker (committer.py), saved off the training thread (async thread mode); a step counts
  only once marked, all or nothing. Its retention keeps the newest `memory_keep` steps and never sees ckpt.dir.
- a step where the disk tier saves is not saved to memory too (the disk copy is the newer tier's equal).
- the files live in the folder, not in a process: they outlive a SIGKILLed rank; under `torchrun --max-restarts`
  the restarted ranks resume from them. The folder is removed when the run ends normally (exit 0).
- resume=auto: the ranks agree (verify's all-reduce) on the newest verified memory step, then on the newest
  verified disk step after it; the newer wins. A damaged memory step is skipped with one line.
- one node only: with several nodes the tier turns off with one line (replication to peers is not built).
- budget: (memory_keep + 1) x the rank's state bytes per local rank must fit the folder's filesystem (and RAM,
  for tmpfs), or the tier turns off at start with one line: never a SIGBUS mid-run.
A failed memory save is a warning (a `checkpoint_failed` event with tier=memory): the disk tier still stands.
"""

from __future__ import annotations

import getpass
import hashlib
import os
import shutil

from common.words import plural
from .errors import CheckpointError
from .layout import step_of
from .manager import CheckpointManager, checkpoint_groups
from .preflight import mem_available_bytes, shm_free_bytes

RAM_FILESYSTEMS = ("tmpfs", "ramfs")
QUIET = ("checkpoint step", "retention: deleted")  # the memory manager's per-save lines (committer.py)


def default_memory_dir(ckpt_dir: str) -> str:
    """/dev/shm/fsdp-ckpt-<hash of ckpt.dir>-<user>: one per job (its ckpt.dir lock guards it too), per user."""
    digest = hashlib.sha256(os.path.realpath(ckpt_dir).encode()).hexdigest()[:12]
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no passwd entry (containers)
        user = str(os.getuid())
    return f"/dev/shm/fsdp-ckpt-{digest}-{user}"


def node_count() -> int:
    return max(1, int(os.environ.get("WORLD_SIZE", "1")) // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))


def _existing(path: str) -> str:
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


def _filesystem_type(path: str) -> str:
    """The type of the mount holding `path` (the longest mount point above it), from /proc/mounts."""
    best, kind, real = "", "", os.path.realpath(path)
    try:
        with open("/proc/mounts") as f:
            for line in f:
                _, mount, fstype, *_ = line.split()
                if (real == mount or real.startswith(mount.rstrip("/") + "/")) and len(mount) > len(best):
                    best, kind = mount, fstype
    except OSError:
        pass
    return kind


def _held_bytes(folder: str) -> int:
    """Bytes of memory steps already in `folder` (a previous attempt's): retention frees them as new ones commit."""
    return sum(os.path.getsize(os.path.join(d, n)) for d, _, names in os.walk(folder) for n in names
               if os.path.isfile(os.path.join(d, n)))


def memory_shortfall(nbytes: int, local_ranks: int, keep: int, folder: str, free: int, held: int,
                     mem_available: int | None) -> str | None:
    """Why `local_ranks` ranks of `nbytes` state each cannot keep `keep` memory steps (plus the one being written)
    in `folder`, or None. `mem_available`: RAM, when the folder is in RAM (tmpfs), else None. Pure: tests pass
    fake numbers."""
    need, gib = nbytes * local_ranks * (keep + 1), 2**30
    what = f"{plural(local_ranks, 'rank')} x {keep + 1} steps x {nbytes / gib:.2f} GiB need {need / gib:.2f} GiB"
    if need > free + held:
        return f"{what} in {folder}, {(free + held) / gib:.2f} GiB free"
    if mem_available is not None and need > mem_available + held:
        return f"{what} of RAM ({folder} is in memory), {(mem_available + held) / gib:.2f} GiB available"
    return None


def folder_shortfall(nbytes: int, local_ranks: int, keep: int, folder: str) -> str | None:
    """`memory_shortfall` with this node's numbers."""
    in_ram = _filesystem_type(_existing(folder)) in RAM_FILESYSTEMS
    held = _held_bytes(folder) if os.path.isdir(folder) else 0
    return memory_shortfall(nbytes, local_ranks, keep, folder, shm_free_bytes(_existing(folder)), held,
                            mem_available_bytes() if in_ram else None)


class MemoryTier:
    """One job's memory tier, or the tier turned off (`mgr` None: every method is then a no-op)."""

    def __init__(self, log, interval: int = 0, keep: int = 1):
        self.log, self.interval, self.keep = log, interval, keep
        self.mgr: CheckpointManager | None = None
        self.skipped: list[str] = []  # resume: memory steps that failed verification, with why

    @classmethod
    def open(cls, options, timeout, log) -> "MemoryTier":
        """The tier `options` (memory_interval, memory_dir, memory_keep; absent: off) asks for, on every rank."""
        tier = cls(log, getattr(options, "memory_interval", 0), getattr(options, "memory_keep", 1))
        if not tier.interval:
            return tier
        if node_count() > 1:
            tier.turn_off(f"{plural(node_count(), 'node')}, and replication of memory steps to other nodes is not "
                          "built yet (docs/memory-tier.md); the disk tier stands")
            return tier
        folder = getattr(options, "memory_dir", "") or default_memory_dir(options.dir)
        tier.mgr = CheckpointManager(folder, "thread", tier.keep, tier._event, tier._info,
                                     groups=checkpoint_groups(timeout))
        log.info(f"memory tier: every {plural(tier.interval, 'step')} into {folder} (keeping {tier.keep})")
        return tier

    def _info(self, line: str) -> None:
        if not line.startswith(QUIET):  # a save every step: its commit and retention are events, not log lines
            self.log.info(f"memory tier: {line}")

    def _event(self, name: str, **fields) -> None:
        if name == "resume_skip":
            self.skipped.append(f"step {fields['step']} ({fields['reason']})")
        self.log.event(name, tier="memory", **fields)

    def turn_off(self, why: str) -> None:
        self.log.info(f"ckpt.memory_interval={self.interval} -> off: {why}")
        self.log.event("memory_tier_off", reason=why)
        if self.mgr is not None:
            self.mgr.close()
        self.mgr = None

    def check_budget(self, nbytes: int, local_ranks: int, any_rank) -> None:
        """Turn the tier off on every rank (`any_rank`: the flag OR-ed over ranks) if a node lacks the room."""
        if self.mgr is None:
            return
        reason = folder_shortfall(nbytes, local_ranks, self.keep, self.mgr.dir)
        if any(any_rank(reason is not None)):
            self.turn_off(reason or "memory is short on another node")

    def resume_candidate(self, disk: CheckpointManager, resume: str) -> tuple:
        """(manager, path or None, tier): with resume=auto and the tier on, the newest verified step of either
        tier (the disk one only if newer), with one line saying which and why newer memory steps were skipped."""
        if self.mgr is None or resume != "auto":
            return disk, disk.find_resume(resume), "disk"
        mem_path = self.mgr.find_resume("auto")
        mem_step = step_of(mem_path) if mem_path else -1
        path = disk.find_resume("auto", newer_than=mem_step)
        why = f"; skipped newer memory steps: {', '.join(self.skipped)}" if self.skipped else ""
        if path is not None or mem_path is None:
            newest = f"step {mem_step}" if mem_path else "none"
            self.log.info(f"resume: disk tier, {f'step {step_of(path)}' if path else 'nothing'} (newest verified "
                          f"memory step: {newest}){why}")
            return disk, path, "disk"
        self.log.info(f"resume: memory tier, step {mem_step} from {mem_path} (no newer verified step in "
                      f"{disk.dir}){why}")
        return self.mgr, mem_path, "memory"

    def maybe_save(self, step: int, state: dict, files_for, max_steps: int) -> None:
        """Every `interval` steps before the last (the final save covers that one): a background save."""
        if self.mgr is not None and step % self.interval == 0 and step < max_steps:
            self._tolerated(step, lambda: self.mgr.save(step, state, files_for(step)))

    def poll(self, step: int) -> None:
        if self.mgr is not None:
            self._tolerated(step, self.mgr.poll)

    def wait_for_staging(self) -> None:
        if self.mgr is not None:
            self.mgr.wait_for_staging()

    def drain(self, step: int) -> None:
        """Finish the in-flight memory save (before a final or emergency disk save)."""
        if self.mgr is not None:
            self._tolerated(step, self.mgr.wait)

    def _tolerated(self, step: int, call) -> None:
        try:
            call()
        except CheckpointError as e:  # the disk tier still stands; the next memory step may succeed
            self.log.info(f"warning: memory checkpoint failed, training continues: {e}")
            self.log.event("checkpoint_failed", step=step, error=str(e), tier="memory")

    def close(self, remove: bool) -> None:
        """Release the tier; `remove` (the run ended normally): delete its folder, once per node."""
        if self.mgr is None:
            return
        folder = self.mgr.dir
        self.mgr.close()
        self.mgr = None
        if remove and int(os.environ.get("LOCAL_RANK", "0")) == 0:
            shutil.rmtree(folder, ignore_errors=True)

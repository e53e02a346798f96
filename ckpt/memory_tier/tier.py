"""The memory tier: the same checkpoint as the disk tier, every ckpt.memory_interval steps, into node-local memory
(tmpfs files under /dev/shm by default), copied to `ckpt.memory_replicas` other nodes, so a job whose processes
died, or that lost a node, resumes from RAM, at any world size.

    python -m pytest tests/test_memory_tier.py tests/test_memory_replicas.py -q

The protocol (docs/memory-tier.md):
- a memory step is a second CheckpointManager's checkpoint in `memory_dir`: the same DCP files and per-file
  checksums, saved off the training thread (async thread mode), copied to the next nodes of the ring, and marked
  per node once every rank's files have their copies (replicate.py); all or nothing. Retention is per node: the
  newest `memory_keep` steps; it never sees ckpt.dir.
- a step the disk tier saves too reuses the disk save's staged copy (no second staging): the newest step is in
  memory as well. Its buffers are the disk tier's, so the disk tier's next save waits for that memory save.
- the files live in the folder, not in a process: they outlive a SIGKILLed rank; under `torchrun --max-restarts`
  the restarted ranks resume from them. The folder is removed when the run ends normally (exit 0).
- resume=auto: the ranks agree on the newest memory step the live nodes hold every file of (recover.py), verify
  it, then look for a newer verified disk step; the newer wins. What a rank reads and its node lacks comes from
  a peer over gloo. A damaged or incomplete memory step is skipped with one line.
- budget: (memory_keep + 1) x (1 + replicas) x the rank's state bytes per local rank must fit the folder's
  filesystem (and RAM, for tmpfs: the node's MemAvailable or the container's memory cgroup room, the smaller,
  ckpt/preflight.py) beside both tiers' async staging buffers (in /dev/shm too in process mode), or the tier
  turns off at start with one line: never a SIGBUS or an OOM kill mid-run.
A failed memory save is a warning (a `checkpoint_failed` event with tier=memory): the disk tier still stands.
"""

from __future__ import annotations

import contextlib
import getpass
import hashlib
import os

from common.dist import all_ranks_reduce
from common.words import plural
from ..errors import CheckpointError
from ..layout import step_dir, step_of
from ..manager import CheckpointManager, checkpoint_groups
from ..preflight import SHM_DIR, mem_available_bytes, shm_free_bytes
from ..saver import Replay
from .peers import NodeLayout
from .recover import TierRecovery, PeerLoad
from .replicate import TierWriter, NodeCommitter, remove_memory_folder, tier_folders

RAM_FILESYSTEMS = ("tmpfs", "ramfs")


def default_memory_dir(ckpt_dir: str) -> str:
    """/dev/shm/fsdp-ckpt-<hash of ckpt.dir>-<user>: one per job (its ckpt.dir lock guards it too), per user."""
    digest = hashlib.sha256(os.path.realpath(ckpt_dir).encode()).hexdigest()[:12]
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no passwd entry (containers)
        user = str(os.getuid())
    return os.path.join(SHM_DIR, f"fsdp-ckpt-{digest}-{user}")


def foreign_folder(folder: str) -> str | None:
    """Why `folder` must not hold this job's steps: it exists and is another user's, or is a link to another
    user's folder, or a link that another user made. The default name is predictable, in a folder every user may
    write to: someone else's folder of that name could read the weights, or hand this job steps of their making.
    A folder made here is this user's alone (peers.py make_step_folder)."""
    owners = set()
    for look in (os.lstat, os.stat):  # the name itself, and what it leads to
        with contextlib.suppress(OSError):
            owners.add(look(folder).st_uid)
    theirs = owners - {os.getuid()}
    return f"{folder} belongs to another user (uid {min(theirs)})" if theirs else None


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
    """Bytes of memory steps already in `folder` (a previous attempt's, and the spare): retention frees them or
    writes over them as new ones commit. Other files there stay, so they are no room."""
    return sum(os.path.getsize(os.path.join(d, n)) for top in tier_folders(folder) for d, _, names in os.walk(top)
               for n in names if os.path.isfile(os.path.join(d, n)))


def memory_shortfall(nbytes: int, local_ranks: int, keep: int, folder: str, free: int, held: int,
                     mem_available: int | None, replicas: int = 0, staging: tuple[int, int] = (0, 0)) -> str | None:
    """Why `local_ranks` ranks of `nbytes` state each, with `replicas` other nodes' copies, cannot keep `keep`
    memory steps (plus the one being written) in `folder`, or None. `mem_available`: RAM, when the folder is in
    RAM (tmpfs), else None. `staging`: the bytes of the node's async staging buffers (not allocated yet when this
    runs), and how many of them are files in the folder's filesystem (process mode's in /dev/shm): both tiers'
    buffers and the steps must fit together. Pure: tests pass fake numbers."""
    need, gib = nbytes * local_ranks * (keep + 1) * (1 + replicas), 2**30
    copies = f" x (1 + {plural(replicas, 'replica')})" if replicas else ""
    what = f"{plural(local_ranks, 'rank')} x {keep + 1} steps{copies} x {nbytes / gib:.2f} GiB need {need / gib:.2f} GiB"
    staged, staged_here = staging
    if need + staged_here > free + held:
        return f"{what}{_beside(staged_here)} in {folder}, {(free + held) / gib:.2f} GiB free"
    if mem_available is not None and need + staged > mem_available + held:
        return (f"{what}{_beside(staged)} of RAM ({folder} is in memory), {(mem_available + held) / gib:.2f} GiB "
                "available (MemAvailable or, if smaller, the memory cgroup limit less its use)")
    return None


def _beside(staged: int) -> str:
    return f" (+ {staged / 2**30:.2f} GiB to stage async saves)" if staged else ""


def folder_shortfall(nbytes: int, local_ranks: int, keep: int, folder: str, replicas: int,
                     disk_mode: str) -> str | None:
    """`memory_shortfall` with this node's numbers. Staging: the memory tier's own buffers (in RAM), and with an
    async disk tier (`disk_mode`) its buffers too, files in /dev/shm in process mode."""
    in_ram = _filesystem_type(_existing(folder)) in RAM_FILESYSTEMS
    held = _held_bytes(folder) if os.path.isdir(folder) else 0
    node_bytes = nbytes * local_ranks
    staged = node_bytes * (2 if disk_mode != "off" else 1)
    shm_staging = disk_mode == "process" and _same_filesystem(folder, SHM_DIR)
    return memory_shortfall(nbytes, local_ranks, keep, folder, shm_free_bytes(_existing(folder)), held,
                            mem_available_bytes() if in_ram else None, replicas,
                            (staged, node_bytes if shm_staging else 0))


def _same_filesystem(a: str, b: str) -> bool:
    try:
        return os.stat(_existing(a)).st_dev == os.stat(b).st_dev
    except OSError:
        return False


def node_layout() -> NodeLayout | str:
    """This rank's node layout, or why the ring cannot be built (the same answer on every rank: two all-reduces)."""
    layout = NodeLayout.here()
    smallest, largest = all_ranks_reduce(layout.ranks_per_node, "min"), -all_ranks_reduce(-layout.ranks_per_node, "min")
    if smallest != largest or not layout.regular:
        return (f"{layout.world_size} ranks are not the same number on every node (LOCAL_WORLD_SIZE {smallest} to "
                f"{largest}), which the ring of replicas needs")
    return layout


class MemoryTier:
    """One job's memory tier, or the tier turned off (`mgr` None: every method is then a no-op)."""

    def __init__(self, log, interval: int = 0, keep: int = 1):
        self.log, self.interval, self.keep = log, interval, keep
        self.mgr: CheckpointManager | None = None
        self.layout, self.replicas = NodeLayout(0, 1, 1), 0
        self.folder: str | None = None  # this user's memory folder of the job, the tier on or off: exit 0 removes it
        self.skipped: list[str] = []  # resume: memory steps that could not be used, with why
        self.reusing = False  # the save in flight reads the disk tier's staged copy (its buffers)

    @classmethod
    def open(cls, options, timeout, log) -> "MemoryTier":
        """The tier `options` (memory_interval, memory_dir, memory_keep, memory_replicas; absent: off) asks for,
        on every rank."""
        tier = cls(log, getattr(options, "memory_interval", 0), getattr(options, "memory_keep", 1))
        folder = getattr(options, "memory_dir", "") or default_memory_dir(options.dir)
        foreign = foreign_folder(folder)
        tier.folder = None if foreign else folder  # with the tier off too: an earlier attempt's steps may be there
        tier.layout = NodeLayout.here()  # its leaders remove that folder, once per node
        if not tier.interval:
            return tier
        layout = node_layout()
        if isinstance(layout, str):
            tier.turn_off(f"{layout}; the disk tier stands")
            return tier
        tier.layout, tier.replicas = layout, min(getattr(options, "memory_replicas", 1), layout.nodes - 1)
        if all_ranks_reduce(int(foreign is not None), "sum"):
            why = foreign or "on another node, the memory folder belongs to another user"
            tier.turn_off(f"{why}; the disk tier stands")
            return tier
        groups = checkpoint_groups(timeout)
        nice = getattr(options, "upload_nice", 0)
        committer = NodeCommitter(folder, groups[0], tier.keep, layout, tier.replicas, tier._event, tier._info, nice)
        tier.mgr = CheckpointManager(folder, "thread", tier.keep, tier._event, tier._info, groups=groups,
                                     committer=committer, writer=TierWriter, upload_nice=nice)
        copies = (f", {plural(layout.nodes, 'node')}, each step's files also on the next "
                  f"{plural(tier.replicas, 'node') if tier.replicas > 1 else 'node'}" if tier.replicas else
                  f", {plural(layout.nodes, 'node')}, no replicas" if layout.nodes > 1 else "")
        log.info(f"memory tier: every {plural(tier.interval, 'step')} into {folder} (keeping {tier.keep}{copies})")
        return tier

    def _info(self, line: str) -> None:
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

    def check_budget(self, nbytes: int, local_ranks: int, any_rank, disk_mode: str) -> None:
        """Turn the tier off on every rank (`any_rank`: the flag OR-ed over ranks) if a node lacks the room, with
        the staging of the disk tier's saves (`disk_mode`: its async_mode, after its own check) counted too."""
        if self.mgr is None:
            return
        reason = folder_shortfall(nbytes, local_ranks, self.keep, self.mgr.dir, self.replicas, disk_mode)
        if any(any_rank(reason is not None)):
            self.turn_off(reason or "memory is short on another node")

    def choose_checkpoint(self, disk: CheckpointManager, resume: str) -> tuple:
        """(manager, path or None, tier): with resume=auto and the tier on, the newest step of either tier (the disk
        one only if newer), with one line saying which and why newer memory steps were skipped; a memory step's
        `manager` fetches, inside its load, the files this node lacks (recover.py)."""
        if self.mgr is None or resume != "auto":
            return disk, disk.choose_checkpoint(resume), "disk"
        recovery = TierRecovery(self.mgr.dir, self.layout, self.mgr.pg, self.log.info, self._event)
        found = recovery.find()
        mem_step = found.step if found else -1
        path = disk.choose_checkpoint("auto", newer_than=mem_step)
        why = f"; skipped newer memory steps: {', '.join(self.skipped)}" if self.skipped else ""
        if path is not None or found is None:
            newest = f"step {mem_step}" if found else "none"
            self.log.info(f"resume: disk tier, {f'step {step_of(path)}' if path else 'nothing'} (newest recoverable "
                          f"memory step: {newest}){why}")
            return disk, path, "disk"
        mem_path = step_dir(self.mgr.dir, mem_step)
        self.log.info(f"resume: memory tier, step {mem_step} from {mem_path} (no newer verified step in "
                      f"{disk.dir}){why}")
        recovery.fetch_small_files(found)
        return PeerLoad(self.mgr, recovery, found), mem_path, "memory"

    def maybe_save(self, step: int, state: dict, files_for, max_steps: int, disk: CheckpointManager) -> None:
        """Every `interval` steps before the last (the final save covers that one): a background save. At a step
        the disk tier saved in the background too, it saves the disk save's staged copy; after a synchronous disk
        save (async_mode=off) there is none, and the disk copy is as new: no memory save then."""
        if self.mgr is None or step % self.interval or step >= max_steps:
            return
        staged = disk.staged[1] if disk.staged and disk.staged[0] == step else None
        if staged is None and disk.last_saved_step == step:
            return
        self.reusing = staged is not None
        self._tolerated(step, lambda: self.mgr.save(step, {} if self.reusing else state, files_for(step),
                                                    stager=Replay(staged) if self.reusing else None))

    def before_disk_save(self, step: int) -> None:
        """The disk tier is about to stage into its buffers again: a memory save still reading them finishes first."""
        if self.reusing:
            self.drain(step)
            self.reusing = False

    def prepare_staging(self, state: dict) -> None:
        """The memory saves' own staging buffers, allocated in the background before the first (prestage.py)."""
        if self.mgr is not None:
            self.mgr.prepare_staging(state)

    def flags(self) -> tuple[bool, ...]:
        """The memory save's (failed, running) on this rank (manager.py flags); () when off or none in flight."""
        return self.mgr.flags() if self.mgr is not None else ()

    def settle(self, step: int, flags: list[bool]) -> None:
        """`flags()` OR-ed over all ranks: a failed memory save is a warning on every rank at once."""
        if self.mgr is not None and flags:
            self._tolerated(step, lambda: self.mgr.settle(*flags))

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
        """Release the tier; `remove` (the run ended normally): delete its folder, once per node, also where the
        tier was off in this run and an earlier attempt's steps are there (tmpfs pages held until a reboot)."""
        was_on = self.mgr is not None
        if was_on:
            self.mgr.close()
            self.mgr = None
        if remove and self.layout.leader and self.folder and os.path.isdir(self.folder):
            gone = remove_memory_folder(self.folder)
            if gone and not was_on:
                self.log.info(f"memory tier: removed {plural(len(gone), 'folder')} of an earlier attempt's memory "
                              f"steps from {self.folder} (the run ended normally)")
        self.folder = None

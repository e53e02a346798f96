"""The memory tier's save across nodes: each node's folder gets its own ranks' files and `ckpt.memory_replicas`
peers' copies, over gloo, off the training thread; a marker per node, written last, says a step is complete.

    python -m pytest tests/test_memory_replicas.py tests/test_memory_tier.py -q

A memory step, step by step (docs/memory-tier.md):
1. prepare (training thread): each node's leader (local rank 0) makes the step folder in its node's memory
   folder, with meta.json and config.yaml; a leftover of the same step (never marked, or skipped on resume)
   is deleted first. Every rank learns a leader's failure.
2. write (DCP's upload thread): each rank writes its own files into its node's folder, with checksums
   (`TierWriter`: the shards in __<rank>_0.distcp, the rank's other items in __<rank>_s0.distcp; the planner
   puts every item all ranks hold on rank 0, so __0_s0.distcp, a few MB at 70B, is the only small file every
   rank loads). Rank 0 writes .metadata into node 0's folder.
3. replicate (the committer thread, `NodeCommitter`): each rank sends its files to the same local rank on the
   next R nodes and receives the previous R nodes' (peers.py `exchange`, each file checked against the
   manifest on arrival): O(R x its bytes) per rank, whatever the world size. Every node gets .metadata (its
   leader writes it from the Metadata DCP already broadcast to every rank) and rank 0's small file (one
   broadcast), so at the same world size no rank needs another node's file.
4. agree, mark, agree again: one all-reduce says every rank's files and copies are in place; then each leader writes
   its node's commit.json: the step's whole manifest (every file's size and checksum, this node's .metadata)
   plus "held", the files this folder holds. Written last, atomically: a node's marker means every shard of
   every rank has its replicas, and these files are here. A kill before it leaves no marker on that node. Then
   a second all-reduce says every leader wrote its marker; if one could not (a write error there alone), the
   save fails on every rank with that node's reason, and no node goes on to step 5.
5. retention (leader, node-local), only once every node marked the step, as on disk an older checkpoint goes
   only once the newer one is committed: else a node that marked it could drop the step before, which a node
   that did not still needs, and after a lost node neither step would have every rank's files. The newest
   `ckpt.memory_keep` marked steps stay, older folders go, but one: its marker removed, it becomes the folder's
   `spare`, and step 1 of the next step renames it into place and keeps the data files this node writes or
   receives again, which the writers then overwrite in place (writeback.py InPlaceFileSystem, peers.py
   `_Incoming`): on tmpfs that skips allocating and freeing the pages of a whole step each time. Peak use is as
   before (keep + 1 steps); between saves the spare holds one step.
With memory_replicas=0 (or one node) there is no step 3 exchange: a node's marker still means every rank
wrote its files, but a node's files live only there.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
import pickle
import shutil
import socket
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import torch.distributed as dist
from torch.distributed.checkpoint.planner import WriteItemType

from common.dist import first_problem
from ..checksum import ALGORITHM, new_hasher
from ..commit_protocol import METADATA_FILE, VerifyError, commit_checkpoint
from ..committer import record_event
from ..errors import SAVE_ERRORS, CheckpointError, save_failure
from ..faults import fault_at
from ..layout import COMMIT_FILE, list_step_dirs
from ..retention import doomed
from ..saver import StagingWait
from ..uploader import CheckpointWriter, lower_priority
from ..writeback import InPlaceFileSystem
from .peers import NodeLayout, Transfer, exchange, make_step_folder, rank_of_file

SMALL = "s"  # DCP file-name prefix suffix of a rank's items that are not shards: __<rank>_s0.distcp


def small_file(rank: int) -> str:
    return f"__{rank}_{SMALL}0.distcp"


SHARED = small_file(0)  # the items every rank holds (optimizer hyperparameters, scheduler, data position...)
SPARE = "spare"  # a superseded step's folder, unmarked: the next step's files are written over its files


def shard_file(rank: int) -> str:
    return f"__{rank}_0.distcp"


class TierWriter(CheckpointWriter):
    """The memory tier's writer: a rank's shards in __<rank>_0.distcp, its other items (its RNG; on rank 0 the
    items every rank holds, which the planner puts there) in the small __<rank>_s0.distcp; over the spare's file
    of that name where there is one."""
    dedup_to_lowest_rank = True
    local_filesystem = InPlaceFileSystem
    shares_metadata = True  # every rank's copies need the digests, every leader writes .metadata (step 3)

    def write_data(self, plan, planner):
        shards = [i for i in plan.items if i.type == WriteItemType.SHARD]
        small = [i for i in plan.items if i.type != WriteItemType.SHARD]
        small_plan = dataclasses.replace(plan, items=small, storage_data=dataclasses.replace(
            plan.storage_data, prefix=plan.storage_data.prefix + SMALL))
        if not shards or not small:
            return super().write_data(small_plan if small else plan, planner)
        first = super().write_data(dataclasses.replace(plan, items=shards), planner).value()
        done = super().write_data(small_plan, planner)
        done.value()[:0] = first  # one list of results; its digests (the writer's, cumulative) name both files
        return done


def ring_transfers(digests: dict[str, dict], layout: NodeLayout, replicas: int) -> list[Transfer]:
    """The copies this rank sends (its files to its ring) and receives (its ring sources' files)."""
    def files_of(rank: int) -> list[str]:
        return sorted(n for n in digests if rank_of_file(n) == rank and n != SHARED)  # SHARED goes to every node
    out = [Transfer(layout.rank, dst, n, digests[n], tag) for dst in layout.ring(layout.rank, replicas)
           for tag, n in enumerate(files_of(layout.rank))]
    return out + [Transfer(src, layout.rank, n, digests[n], tag) for src in layout.ring_sources(layout.rank, replicas)
                  for tag, n in enumerate(files_of(src))]


def ranks_held(layout: NodeLayout, replicas: int) -> set[int]:
    """The ranks whose files this node's folder holds: its own and their ring sources."""
    mine = layout.ranks_of(layout.node)
    return {*mine, *(s for r in mine for s in layout.ring_sources(r, replicas))}


def held_here(digests: dict[str, dict], layout: NodeLayout, replicas: int, own_files: list[str]) -> list[str]:
    """The files this node's folder holds once a step is replicated: its ranks' own, their ring sources', rank 0's
    small file, .metadata and the small files every leader writes."""
    ranks = ranks_held(layout, replicas)
    names = {n for n in digests if rank_of_file(n) in ranks} | ({SHARED} & set(digests))
    return sorted(names | {METADATA_FILE, *own_files})


def _write_atomic(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def unmark(path: str) -> None:
    """A step folder's marker goes first, before its files or its name: a kill then leaves an unmarked folder."""
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        os.remove(os.path.join(path, COMMIT_FILE))


def remove_step(path: str) -> None:
    """A memory step folder, its marker first: a kill halfway leaves an unmarked folder, never a marked partial one."""
    unmark(path)
    shutil.rmtree(path, ignore_errors=True)


def tier_folders(folder: str) -> list[str]:
    """What the tier keeps in memory folder `folder`: its step folders and the spare (nothing else is its own)."""
    spare = os.path.join(folder, SPARE)
    return [path for _, path in list_step_dirs(folder)] + ([spare] if os.path.isdir(spare) else [])


def remove_memory_folder(folder: str) -> list[str]:
    """`tier_folders`, then `folder` itself if nothing else is left in it (a memory_dir set by hand to a folder
    holding other things keeps them); returns what it removed. Nodes sharing a hand-set folder may race here:
    what is already gone is not an error."""
    gone = tier_folders(folder)
    for path in gone:
        remove_step(path)
    with contextlib.suppress(OSError):
        os.rmdir(folder)
    return gone


def demote(path: str, spare: str) -> None:
    """Step folder `path` becomes the spare, never a step again."""
    unmark(path)
    os.replace(path, spare)


def make_step_dir(path: str, files: dict[str, str], spare: str, reused: frozenset) -> None:
    """A step folder with `files` (name -> text): a leftover of the same step goes first. Where folder `spare`
    exists, it is renamed into place, holding only its files named in `reused` (to be written over); else a new
    folder."""
    if os.path.lexists(path):
        remove_step(path)
    if os.path.isdir(spare):
        os.replace(spare, path)
        for name in set(os.listdir(path)) - reused:
            os.remove(os.path.join(path, name))
    else:
        make_step_folder(path)
    for name, text in files.items():
        with open(os.path.join(path, name), "w") as f:
            f.write(text)


class NodeCommitter:
    """The memory manager's committer (CheckpointManager `committer`): steps 1 and 3-5 of the docstring above, on
    thread `ckpt-memory` for async saves; the memory tier saves nothing synchronously."""

    def __init__(self, folder: str, pg, keep: int, layout: NodeLayout, replicas: int, on_event: Callable[..., None],
                 on_log: Callable[[str], None], nice: int = 0):
        """`nice`: the thread's niceness (ckpt.upload_nice): copies to peers and their checksums take the cores
        training leaves, like the uploads (uploader.py lower_priority)."""
        self.dir, self.pg, self.keep, self.layout, self.replicas = folder, pg, keep, layout, replicas
        self._on_event, self.on_log = on_event, on_log
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-memory",
                                          initializer=lower_priority, initargs=(nice,))

    def close(self) -> None:
        self._thread.shutdown(wait=True)

    def on_event(self, name: str, **fields) -> None:
        record_event(self._on_event, self.on_log, name, **fields)

    def prepare(self, path: str, step: int, files: dict[str, str]) -> None:
        """Step 1 (every rank, the training thread): the leaders make the folder; all raise a leader's failure."""
        problem = None
        if self.layout.leader:
            try:
                reused = frozenset(shard_file(r) for r in ranks_held(self.layout, self.replicas))
                make_step_dir(path, files, os.path.join(self.dir, SPARE), reused)
            except OSError as e:
                problem = f"memory step {step}: cannot make {path} on {socket.gethostname()} ({e.strerror or e})"
        problem = first_problem(problem, self.pg)
        if problem:
            raise CheckpointError(problem)

    def start_async_commit(self, upload: Future, path: str, step: int, mode: str, t0: float, blocking_s: float,
                           own_files: list[str], staged: StagingWait) -> Future:
        return self._thread.submit(self._finish, upload, path, step, t0, blocking_s, own_files, staged)

    def _finish(self, upload: Future, path: str, step: int, t0: float, blocking_s: float, own_files: list[str],
                staged: StagingWait) -> None:
        try:
            metadata = upload.result()  # DCP's upload fails on every rank alike (its finish is a collective)
        except SAVE_ERRORS as e:
            raise save_failure(e, self.dir, f"memory step {path}") from e
        upload_s = time.perf_counter() - t0
        problem = first_problem(self.replicate(path, step, metadata), self.pg)  # every rank, or no marker anywhere
        if problem:
            raise CheckpointError(f"memory step {step} not replicated: {problem}")
        problem = first_problem(self._mark_problem(path, step, metadata, own_files), self.pg)
        if problem:  # a node without its marker: nobody drops the older step, which every node still has marked
            raise CheckpointError(f"memory step {step} not marked: {problem}")
        staged.done.wait(timeout=5.0)  # as Committer._finish_async: the staging wait is known, or soon
        self.on_event("checkpoint", step=step, path=path, mode="thread", blocking_s=blocking_s + staged.wait_s,
                      upload_s=upload_s, committed_s=time.perf_counter() - t0, staging_wait_s=staged.wait_s,
                      replicas=self.replicas)
        if self.layout.leader:
            self.retain(step)

    @fault_at("replicate")
    def replicate(self, path: str, step: int, metadata) -> str | None:
        """Step 3 on this rank: its copies out and in, then what every node's leader needs. Its first problem."""
        digests = metadata.file_digests
        problems = exchange(ring_transfers(digests, self.layout, self.replicas), self.layout.rank, self.pg, path,
                            path, ALGORITHM, step)
        if self.layout.nodes > 1:
            problems += self._to_every_node(path, metadata)
        return problems[0] if problems else None

    def _to_every_node(self, path: str, metadata) -> list[str]:
        """Rank 0's small file, broadcast; the leaders of other nodes write it and their own .metadata."""
        digests, data, problems = metadata.file_digests, [None], []
        if SHARED in digests:
            if self.layout.rank == 0:
                try:
                    with open(os.path.join(path, SHARED), "rb") as f:
                        data[0] = f.read()
                except OSError as e:  # still broadcast (None): the others must not wait for it
                    problems.append(f"{os.path.join(path, SHARED)}: cannot be read ({e.strerror or e})")
            dist.broadcast_object_list(data, src=0, group=self.pg)
        if not self.layout.leader or self.layout.node == 0:
            return problems
        plain = copy.copy(metadata)
        vars(plain).pop("file_digests", None)  # as rank 0's finish pickled it: the digests go in the marker
        try:
            _write_atomic(os.path.join(path, METADATA_FILE), pickle.dumps(plain))
            if data[0] is not None:
                hasher = new_hasher(ALGORITHM)
                hasher.update(data[0])
                if hasher.hexdigest() != digests[SHARED][ALGORITHM]:
                    return [f"{SHARED} from rank 0: checksum mismatch on arrival"]
                _write_atomic(os.path.join(path, SHARED), data[0])
        except OSError as e:
            return [f"{path}: cannot write .metadata or {SHARED} ({e.strerror or e})"]
        return []

    def _mark_problem(self, path: str, step: int, metadata, own_files: list[str]) -> str | None:
        """Step 4's marker on this rank, or why its node has none: said, not raised, so that every rank still
        joins the agreement after it (a raise on one node would leave the others waiting in it)."""
        try:
            self.mark(path, step, metadata, own_files)
        except SAVE_ERRORS as e:  # a fault point's error comes from outside mark's own try
            why = save_failure(e, self.dir, f"the marker of memory step {path}")
            return f"node {self.layout.node} ({socket.gethostname()}): {why}"
        return None

    @fault_at("before_commit")
    def mark(self, path: str, step: int, metadata, own_files: list[str]) -> None:
        """Step 4 on a leader: this node's marker, from the step's whole manifest."""
        if not self.layout.leader:
            return
        held = held_here(metadata.file_digests, self.layout, self.replicas, own_files)
        try:
            commit_checkpoint(path, self.layout.world_size, metadata.file_digests, metadata, own_files, held=held,
                              node=self.layout.node, nodes=self.layout.nodes, replicas=self.replicas,
                              ranks_per_node=self.layout.ranks_per_node, host=socket.gethostname())
        except (OSError, VerifyError) as e:
            raise save_failure(e, self.dir, f"the marker of memory step {path}") from e

    def retain(self, newest: int) -> None:
        """Step 5 on a leader, once every node marked `newest`: the newest `keep` marked steps up to `newest` stay
        (a later step, from an earlier job, is left alone, as on disk); older ones and unmarked leftovers go, the
        newest of them to the spare."""
        gone = doomed(self.dir, newest, self.keep, 0)
        spare = os.path.join(self.dir, SPARE)
        for path in reversed(gone):
            if not os.path.isdir(spare):
                with contextlib.suppress(OSError):  # not renamed: removed like the others
                    demote(path, spare)
                    continue
            remove_step(path)
        if gone:
            self.on_event("retention", step=newest, deleted=gone)

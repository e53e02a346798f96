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
   rank loads). Rank 0 writes .metadata and its index (checksum.py, metadata_index.py) into node 0's folder;
   as on disk, DCP hands the global Metadata (O(tensors x W)) back to rank 0 alone.
3. replicate (the committer thread, `NodeCommitter`): rank 0 hands each rank the digests of its ring transfers
   (one scatter: O(R) entries a rank) and each other node's leader the manifest (one message: O(W) digests, never
   the Metadata; `share_digests`). Each rank sends its files to the same local rank on the next R nodes and
   receives the previous R nodes' (peers.py `exchange`, each file checked against the manifest on arrival):
   O(R x its bytes) per rank, whatever the world size. Rank 0 sends each other leader rank 0's small file and the
   index files of the ranks that node holds (INDEX, and the buckets of its own ranks and their ring sources: what
   they load at the same world size), a batch of leaders at a time (`FANOUT_BYTES` of buffers); never .metadata,
   which only node 0 holds. So at the same world size no rank needs another node's file.
4. agree, mark, agree again: one all-reduce says every rank's files and copies are in place; then each leader writes
   its node's commit.json: the step's whole manifest (every file's size and checksum, .metadata's as rank 0
   hashed it) plus "held", the files this folder holds. Written last, atomically: a node's marker means every
   shard of every rank has its replicas, and these files are here. A kill before it leaves no marker on that
   node. Then a second all-reduce says every leader wrote its marker; if one could not (a write error there
   alone), the save fails on every rank with that node's reason, and no node goes on to step 5.
5. retention (leader, node-local), only once every node marked the step, as on disk an older checkpoint goes
   only once the newer one is committed: else a node that marked it could drop the step before, which a node
   that did not still needs, and after a lost node neither step would have every rank's files. The newest
   `ckpt.memory_keep` marked steps stay, older folders go, but one: its marker removed, it becomes the folder's
   `spare`, and step 1 of the next step renames it into place and keeps the data files this node writes or
   receives again, which the writers then overwrite in place (writeback.py InPlaceFileSystem, peers.py
   `_Incoming`): on tmpfs that skips allocating and freeing the pages of a whole step each time. Peak use is as
   before (keep + 1 steps); between saves the spare holds one step.
With memory_replicas=0 (or one node) there is no step 3 ring: a node's marker still means every rank wrote its
files, but a node's files live only there.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import socket
import time
import types
from collections import defaultdict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import torch.distributed as dist
from torch.distributed.checkpoint.planner import WriteItemType

from common.dist import first_problem
from ..checksum import ALGORITHM, file_digest
from ..commit_protocol import METADATA_FILE, VerifyError, commit_checkpoint
from ..committer import record_event
from ..errors import SAVE_ERRORS, CheckpointError, save_failure
from ..faults import fault_at
from ..layout import COMMIT_FILE, list_step_dirs
from ..retention import doomed
from ..saver import StagingWait
from ..uploader import CheckpointWriter, lower_priority
from ..writeback import InPlaceFileSystem
from ..metadata_index import index_files_of, is_index_file, ranks_per_bucket
from .peers import CHUNK, NodeLayout, Transfer, exchange, make_step_folder, rank_of_file

SMALL = "s"  # DCP file-name prefix suffix of a rank's items that are not shards: __<rank>_s0.distcp


def small_file(rank: int) -> str:
    return f"__{rank}_{SMALL}0.distcp"


SHARED = small_file(0)  # the items every rank holds (optimizer hyperparameters, scheduler, data position...)
SPARE = "spare"  # a superseded step's folder, unmarked: the next step's files are written over its files
FANOUT_BYTES = 256 << 20  # rank 0's buffers for the files it sends the other nodes' leaders at once (step 3)


def shard_file(rank: int) -> str:
    return f"__{rank}_0.distcp"


class TierWriter(CheckpointWriter):
    """The memory tier's writer: a rank's shards in __<rank>_0.distcp, its other items (its RNG; on rank 0 the
    items every rank holds, which the planner puts there) in the small __<rank>_s0.distcp; over the spare's file
    of that name where there is one. Rank 0's finish writes .metadata and its index (checksum.py); as on disk,
    only rank 0 gets the global Metadata back, and step 3 hands each rank the digests it needs."""
    dedup_to_lowest_rank = True
    local_filesystem = InPlaceFileSystem

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


def ranks_held(layout: NodeLayout, replicas: int, node: int | None = None) -> set[int]:
    """The ranks whose files node `node`'s folder holds (this rank's node by default): its own and their ring
    sources."""
    mine = layout.ranks_of(layout.node if node is None else node)
    return {*mine, *(s for r in mine for s in layout.ring_sources(r, replicas))}


def index_for_node(names, layout: NodeLayout, replicas: int, node: int) -> list[str]:
    """The metadata index files node `node` holds: node 0 all of them (rank 0 wrote them there); another node INDEX
    and the buckets of the ranks it holds: what its ranks load at the same world size (metadata_index.py)."""
    if node == 0:
        return sorted(n for n in names if is_index_file(n))
    return index_files_of(names, ranks_held(layout, replicas, node), ranks_per_bucket())


def from_node0(names, layout: NodeLayout, replicas: int, node: int) -> list[str]:
    """What node `node` (not 0) receives from rank 0 besides its ring copies: rank 0's small file and its index
    files. Never .metadata, O(tensors x W): only node 0 holds it."""
    return sorted(({SHARED} & set(names)) | set(index_for_node(names, layout, replicas, node)))


def held_here(digests: dict[str, dict], layout: NodeLayout, replicas: int, own_files: list[str]) -> list[str]:
    """The files this node's folder holds once a step is replicated: its ranks' own, their ring sources', rank 0's
    small file, its index files, the small files every leader writes, and on node 0 .metadata."""
    ranks = ranks_held(layout, replicas)
    names = {n for n in digests if rank_of_file(n) in ranks} | ({SHARED} & set(digests))
    names |= set(index_for_node(digests, layout, replicas, layout.node))
    return sorted(names | set(own_files) | ({METADATA_FILE} if layout.node == 0 else set()))


@dataclasses.dataclass
class StepDigests:
    """What a rank knows of a step's files after step 3's hand-out (`share_digests`): `digests`, those of its ring
    transfers (its own files and its ring sources'); on a leader `manifest`, every file's (.metadata's included:
    O(files) = O(W) entries, never the O(tensors x W) Metadata), and `data_files`, those .metadata references."""
    digests: dict[str, dict]
    manifest: dict[str, dict] | None = None
    data_files: set | None = None


def _manifest(metadata, path: str) -> dict[str, dict]:
    """Rank 0: every file's digest, .metadata's hashed here once for every node's marker. Unreadable: left out, and
    each marker then fails on its own (commit_protocol.build_manifest), after the collectives, as one failed save."""
    try:
        return {**metadata.file_digests, METADATA_FILE: file_digest(os.path.join(path, METADATA_FILE))}
    except OSError:
        return dict(metadata.file_digests)


def share_digests(metadata, layout: NodeLayout, replicas: int, path: str, pg) -> StepDigests:
    """Step 3's first part (every rank): rank 0, the only one DCP hands the global Metadata (checksum.py
    SavedMetadata), gives each rank the digests of its ring transfers (one scatter, O(R) entries a rank), and each
    other node's leader the manifest its marker needs (one message each)."""
    if layout.world_size == 1:
        manifest = _manifest(metadata, path)
        return StepDigests(manifest, manifest, set(metadata.data_files))
    out: list = [None]
    if layout.rank == 0:
        manifest = _manifest(metadata, path)
        by_rank = defaultdict(dict)
        for name, digest in manifest.items():
            by_rank[rank_of_file(name)][name] = digest
        dist.scatter_object_list(out, [{n: d for r in (rank, *layout.ring_sources(rank, replicas))
                                        for n, d in by_rank[r].items()} for rank in range(layout.world_size)],
                                 src=0, group=pg)
        for node in range(1, layout.nodes):
            dist.send_object_list([manifest, set(metadata.data_files)], dst=layout.ranks_of(node)[0], group=pg)
        return StepDigests(out[0], manifest, set(metadata.data_files))
    dist.scatter_object_list(out, None, src=0, group=pg)
    if not layout.leader:
        return StepDigests(out[0])
    received: list = [None, None]
    dist.recv_object_list(received, src=0, group=pg)
    return StepDigests(out[0], *received)


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
        files = share_digests(metadata, self.layout, self.replicas, path, self.pg)
        problem = first_problem(self.replicate(path, step, files), self.pg)  # every rank, or no marker anywhere
        if problem:
            raise CheckpointError(f"memory step {step} not replicated: {problem}")
        problem = first_problem(self._mark_problem(path, step, files, own_files), self.pg)
        if problem:  # a node without its marker: nobody drops the older step, which every node still has marked
            raise CheckpointError(f"memory step {step} not marked: {problem}")
        staged.done.wait(timeout=5.0)  # as Committer._finish_async: the staging wait is known, or soon
        self.on_event("checkpoint", step=step, path=path, mode="thread", blocking_s=blocking_s + staged.wait_s,
                      upload_s=upload_s, committed_s=time.perf_counter() - t0, staging_wait_s=staged.wait_s,
                      replicas=self.replicas)
        if self.layout.leader:
            self.retain(step)

    @fault_at("replicate")
    def replicate(self, path: str, step: int, files: StepDigests) -> str | None:
        """Step 3 on this rank: its copies out and in, then what each other node gets from node 0. Its first
        problem."""
        problems = exchange(ring_transfers(files.digests, self.layout, self.replicas), self.layout.rank, self.pg, path,
                            path, ALGORITHM, step)
        if self.layout.nodes > 1:
            problems += self._from_node0(path, step, files)
        return problems[0] if problems else None

    def _from_node0(self, path: str, step: int, files: StepDigests) -> list[str]:
        """Rank 0's small file and the index files each other node holds (`from_node0`), rank 0 to each leader,
        checked on arrival like the ring's copies; rank 0 sends to a batch of leaders at a time, so that its
        buffers (two per file, peers.py) stay within FANOUT_BYTES whatever the node count."""
        if self.layout.rank != 0:
            if not self.layout.leader:
                return []
            return exchange(self._node0_transfers(files.manifest, self.layout.node), self.layout.rank, self.pg, path,
                            path, ALGORITHM, step)
        problems, batch, batch_bytes = [], [], 0
        for node in range(1, self.layout.nodes):
            transfers = self._node0_transfers(files.manifest, node)
            batch += transfers
            batch_bytes += sum(2 * min(CHUNK, t.expected["size"]) for t in transfers)
            if batch_bytes >= FANOUT_BYTES or node == self.layout.nodes - 1:
                problems += exchange(batch, 0, self.pg, path, path, ALGORITHM, step)
                batch, batch_bytes = [], 0
        return problems

    def _node0_transfers(self, manifest: dict[str, dict], node: int) -> list[Transfer]:
        leader = self.layout.ranks_of(node)[0]
        return [Transfer(0, leader, name, manifest[name], tag)
                for tag, name in enumerate(from_node0(manifest, self.layout, self.replicas, node))]

    def _mark_problem(self, path: str, step: int, files: StepDigests, own_files: list[str]) -> str | None:
        """Step 4's marker on this rank, or why its node has none: said, not raised, so that every rank still
        joins the agreement after it (a raise on one node would leave the others waiting in it)."""
        try:
            self.mark(path, step, files, own_files)
        except SAVE_ERRORS as e:  # a fault point's error comes from outside mark's own try
            why = save_failure(e, self.dir, f"the marker of memory step {path}")
            return f"node {self.layout.node} ({socket.gethostname()}): {why}"
        return None

    @fault_at("before_commit")
    def mark(self, path: str, step: int, files: StepDigests, own_files: list[str]) -> None:
        """Step 4 on a leader: this node's marker, from the step's whole manifest (rank 0's, step 3)."""
        if not self.layout.leader:
            return
        held = held_here(files.manifest, self.layout, self.replicas, own_files)
        summary = types.SimpleNamespace(data_files=files.data_files)  # what commit_protocol.referenced_files reads
        try:
            commit_checkpoint(path, self.layout.world_size, files.manifest, summary, own_files, held=held,
                              node=self.layout.node, nodes=self.layout.nodes, replicas=self.replicas,
                              ranks_per_node=self.layout.ranks_per_node, ranks_per_bucket=ranks_per_bucket(),
                              host=socket.gethostname())
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

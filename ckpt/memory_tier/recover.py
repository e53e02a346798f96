"""Recovery from the memory tier: the ranks agree on the newest memory step the live nodes can rebuild, verify
what they hold of it, and fetch from each other what a rank reads but its node lacks.

    python -m pytest tests/test_memory_replicas.py tests/test_memory_tier.py -q

The protocol (docs/memory-tier.md), every rank taking part:
1. each node's leader reads the markers in its memory folder (`node_summary`): per step, the step's identity
   (a hash of every data file's checksum, so two saves of one step never mix), the saved world size, the saved
   ranks whose files it holds completely, and its held files' sizes and checksums. One gather shares them:
   a few hundred bytes per node and step.
2. newest step first: it is recoverable if the nodes of this job that marked it hold, between them, every saved
   rank's files and one verified set of the metadata index top (.metadata for a step saved before the index),
   meta.json and config.yaml. Each such node checks the sizes and checksums of what it holds and the resume
   reads, split over its local ranks (O(the node's bytes / L) per rank; never .metadata, which node 0 alone
   holds); a damaged copy is dropped, and if no other node holds that file the step is skipped with one line
   saying why, and the next older one is tried. Nothing found: the disk tier.
3. the chosen step's small files go to every node that lacks them, and every rank takes the index top as the
   step's Metadata (`trust_index`); then, inside the load (`PeerLoad`), each rank fetches the index buckets its
   shards meet where its node lacks them, and works out from them which data files its own load reads (DCP's
   planner, the same one dcp.load runs); the ones its node lacks come from a node that holds them (peers.py
   `exchange`: over gloo, checked against the holder's marker on arrival; each needed file once per node; the
   sending work spread over the holders' ranks by bytes). At the same world size on the same nodes nothing moves,
   and no rank opens .metadata. Then dcp.load reads the local folder.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from dataclasses import dataclass, field

import torch.distributed as dist
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.stateful import Stateful

from common.dist import first_problem
from common.words import plural
from ..checksum import new_hasher
from ..commit_protocol import METADATA_FILE, VerifyError, check_file, held_files, read_marker, shares
from ..errors import CheckpointError
from ..layout import list_step_dirs, step_dir
from ..metadata_index import (INDEX, IndexedMetadata, MetadataIndexError, add_bucket, bucket_of, needed_files,
                              read_index)
from ..metadata_index import uncovered as uncovered_keys
from ..resume import check_model_matches, load, saved_metadata, trust_metadata
from .peers import NodeLayout, Transfer, exchange, rank_of_file
from .replicate import SHARED, remove_step

DATA = ".distcp"


def _entry(path: str) -> dict:
    """What one marked step folder offers (raises VerifyError for a missing or unreadable marker)."""
    marker = read_marker(path)
    files, algorithm = marker["files"], marker["algorithm"]
    held = {n: files[n] for n in held_files(marker) if n in files}
    data = sorted((n, d[algorithm]) for n, d in files.items() if n.endswith(DATA))
    identity = new_hasher(algorithm)
    identity.update(json.dumps(data).encode())
    by_rank = defaultdict(set)
    for name, _ in data:
        by_rank[rank_of_file(name)].add(name)
    ranks = sorted(r for r, names in by_rank.items() if r is not None and names <= set(held))
    per_node = marker.get("ranks_per_node", marker["world_size"])
    own = [r for r in ranks if r // per_node == marker.get("node", 0)]  # written here, not copies
    return {"id": identity.hexdigest(), "world_size": marker["world_size"], "algorithm": algorithm, "ranks": ranks,
            "own": own, "files": held, "per_bucket": marker.get("ranks_per_bucket", per_node)}


def node_summary(folder: str) -> dict[int, dict]:
    """Every step folder in this node's memory folder: step -> `_entry`, or {"problem": why} without a marker."""
    out = {}
    for step, path in list_step_dirs(folder):
        try:
            out[step] = _entry(path)
        except VerifyError as e:
            out[step] = {"problem": str(e)}
    return out


@dataclass
class Candidate:
    """One saved step that nodes of this job hold: node -> {"ranks": the saved ranks whose files it holds, "own":
    those it wrote, "files": {name: manifest entry}, "small": its non-data files, "checked": files verified}."""
    step: int
    world_size: int
    algorithm: str
    holders: dict[int, dict]
    per_bucket: int = 1  # saving ranks per metadata index bucket (metadata_index.py)
    fetched: set = field(default_factory=set)  # files this node received during the resume

    @property
    def indexed(self) -> bool:
        """Saved with a metadata index: the resume reads it, never .metadata (which only node 0 holds)."""
        return any(INDEX in h["files"] for h in self.holders.values())

    def needs_everywhere(self, name: str) -> bool:
        """A small file every node reads: INDEX (or, before the index, .metadata), meta.json, config.yaml."""
        if self.indexed:
            return name != METADATA_FILE and bucket_of(name) is None
        return True

    def buckets_of(self, name: str, ranks) -> bool:
        """Index bucket file `name` holds the entries of some saved rank of `ranks`."""
        bucket = bucket_of(name)
        return bucket is not None and bucket in {r // self.per_bucket for r in ranks}

    def uncovered(self) -> str | None:
        held = set().union(*(h["ranks"] for h in self.holders.values()))
        missing = sorted(set(range(self.world_size)) - held)
        if missing:
            shown = ", ".join(map(str, missing[:4])) + (" ..." if len(missing) > 4 else "")
            return f"the files of saved {'rank' if len(missing) == 1 else 'ranks'} {shown} are on no node of this job"
        if not self.common():
            what = "metadata index" if self.indexed else ".metadata"
            return f"no node of this job holds a verified {what}, meta.json and config.yaml"
        return None

    def common(self) -> list[str]:
        """The small files every node needs (`needs_everywhere`), from a holder that has them all."""
        for holder in self.holders.values():
            names = [n for n in holder["small"] if self.needs_everywhere(n)]
            if all(n in holder["files"] for n in names):
                return sorted(names)
        return []

    def to_check(self, node: int, ranks) -> list[str]:
        """`node`'s files of saved `ranks` and their index buckets; with ranks None, what every node reads: its own
        ranks' files and buckets, rank 0's small file and the small files every node needs (never .metadata, which
        an indexed resume does not read: O(tensors x W))."""
        h = self.holders[node]
        want = h["own"] if ranks is None else ranks
        return sorted(n for n in h["files"] if n not in h["checked"] and (
            (rank_of_file(n) in want and n.endswith(DATA)) or self.buckets_of(n, want)
            or (ranks is None and (n == SHARED or (not n.endswith(DATA) and self.needs_everywhere(n))))))

    def missing(self) -> set:
        """Saved ranks no node holds checked: their copies are checked next."""
        done = {r for h in self.holders.values() for r in h["ranks"]
                if all(n in h["checked"] for n in h["files"] if rank_of_file(n) == r and n.endswith(DATA))}
        return set(range(self.world_size)) - done

    def keep_checked(self) -> None:
        """Only checked copies are offered, read or sent."""
        for h in self.holders.values():
            h["ranks"] = {r for r in h["ranks"] if all(n in h["checked"] for n in h["files"] if rank_of_file(n) == r)}
            h["files"] = {n: e for n, e in h["files"].items() if n in h["checked"]}

    def drop(self, node: int, name: str) -> None:
        """A damaged copy: `node` no longer offers `name`, nor the rank whose file it is."""
        self.holders[node]["files"].pop(name, None)
        self.holders[node]["ranks"].discard(rank_of_file(name))


def _gather(obj, pg) -> list:
    if pg is None:
        return [obj]
    out = [None] * dist.get_world_size(pg)
    dist.all_gather_object(out, obj, group=pg)
    return out


def files_read_by(state: dict, metadata) -> set[str]:
    """The data files this rank's load of `state` reads: the plan dcp.load would make, from `metadata`."""
    flat = {k: v.state_dict() if isinstance(v, Stateful) else v for k, v in state.items()}
    planner = DefaultLoadPlanner()
    planner.set_up_planner(flat, metadata, False)
    return {metadata.storage_data[item.storage_index].relative_path for item in planner.create_local_plan().items}


def plan_fetch(requests: list[list[str]], cand: Candidate, layout: NodeLayout) -> list[Transfer]:
    """Who sends what: each (node, file) once, to the node's lowest requesting rank, from the holder node with the
    fewest bytes to send so far, by its ranks in turn. The same list on every rank (the same inputs)."""
    load, count, seen, out = defaultdict(int), defaultdict(int), set(), []
    for rank, names in enumerate(requests):
        node = layout.node_of(rank)
        for name in names:
            holders = sorted(n for n, h in cand.holders.items() if name in h["files"] and n != node)
            if (node, name) in seen or not holders:
                continue  # a file no node holds: the load names it (resume.py) if a rank really reads it
            seen.add((node, name))
            src_node = min(holders, key=lambda n: (load[n], n))
            expected = cand.holders[src_node]["files"][name]
            load[src_node] += expected["size"]
            src = layout.ranks_of(src_node)[count[src_node] % layout.ranks_per_node]
            count[src_node] += 1
            out.append(Transfer(src, rank, name, expected, tag=len(out)))
    return out


class TierRecovery:
    """Steps 1-3 of the docstring for one resume. `log`: the memory tier's (info, event)."""

    def __init__(self, folder: str, layout: NodeLayout, pg, info, event):
        self.folder, self.layout, self.pg, self.info, self.event = folder, layout, pg, info, event
        self.moved: list[Transfer] = []

    def find(self) -> Candidate | None:
        """The newest recoverable step, verified; each newer one skipped with one line (and a resume_skip event)."""
        mine = node_summary(self.folder) if self.layout.leader else None
        nodes = {self.layout.node_of(r): s for r, s in enumerate(_gather(mine, self.pg)) if s is not None}
        for step in sorted({s for summary in nodes.values() for s in summary}, reverse=True):
            entries = {n: summary[step] for n, summary in nodes.items() if step in summary}
            marked = [e for e in entries.values() if "id" in e]
            unmarked = "; ".join(self._node(n) + e["problem"] for n, e in sorted(entries.items()) if "problem" in e)
            why = unmarked
            for identity in sorted({e["id"] for e in marked}, key=lambda i: -sum(e["id"] == i for e in marked)):
                cand = self._candidate(step, {n: e for n, e in entries.items() if e.get("id") == identity})
                why = cand.uncovered() or self._verify(cand)
                if why is None:
                    return cand
                why = "; ".join(filter(None, (why, unmarked)))
            path = step_dir(self.folder, step)
            self.info(f"resume: skipping {path}: {why}")
            self.event("resume_skip", step=step, path=path, reason=why)
        return None

    def _node(self, node: int) -> str:
        return f"node {node}: " if self.layout.nodes > 1 else ""

    @staticmethod
    def _candidate(step: int, entries: dict[int, dict]) -> Candidate:
        first = next(iter(entries.values()))
        holders = {n: {"ranks": set(e["ranks"]), "own": set(e["own"]), "files": dict(e["files"]), "checked": set(),
                       "small": [f for f in e["files"] if not f.endswith(DATA)]} for n, e in entries.items()}
        return Candidate(step, first["world_size"], first["algorithm"], holders, first["per_bucket"])

    def _verify(self, cand: Candidate) -> str | None:
        """Each node checks the copies of `cand` it will read: its own ranks' files and the small ones; then, if a
        saved rank has no checked copy (its node lost, or damaged), the other copies of its files. Its local ranks
        split the bytes; damaged copies are dropped. None if the step is still recoverable, else why not."""
        bad = self._check(cand, None)
        if cand.missing():
            bad += self._check(cand, cand.missing())
        cand.keep_checked()
        why = cand.uncovered()
        if why:
            return f"{why}; {self._node(bad[0][0])}{bad[0][2]}" if bad else why
        for node, name, problem in bad:
            self.info(f"resume: memory step {cand.step}: {self._node(node)}{problem}; another node's copy is used")
        return None

    def _check(self, cand: Candidate, ranks) -> list[tuple]:
        """One round (collective): every holder checks `cand.to_check(node, ranks)`; returns (node, name, problem)."""
        problems, mine = [], self.layout.node in cand.holders
        names = cand.to_check(self.layout.node, ranks) if mine else []
        local = self.layout.rank % self.layout.ranks_per_node
        files = cand.holders[self.layout.node]["files"] if mine else {}
        for name in shares({n: files[n] for n in names}, self.layout.ranks_per_node)[local]:
            problem = check_file(step_dir(self.folder, cand.step), name, files[name], cand.algorithm)
            if problem:
                problems.append((name, problem))
        found = first_problem("damaged" if problems else None, self.pg)
        bad = [(self.layout.node_of(r), *p) for r, ps in enumerate(_gather(problems, self.pg) if found else []) for p in ps]
        for node in cand.holders:
            cand.holders[node]["checked"] |= set(cand.to_check(node, ranks))
        for node, name, _ in bad:
            cand.drop(node, name)
            cand.holders[node]["checked"].discard(name)
        return bad

    def fetch(self, cand: Candidate, wanted) -> None:
        """Every rank: the files of `wanted` its node lacks, from nodes that hold them; raises on every rank if one
        did not arrive intact."""
        have = set(cand.holders.get(self.layout.node, {}).get("files", {})) | cand.fetched
        transfers = plan_fetch(_gather(sorted(set(wanted) - have), self.pg), cand, self.layout)
        path = step_dir(self.folder, cand.step)
        mine = [t for t in transfers if self.layout.rank in (t.src, t.dst)]
        problems = exchange(mine, self.layout.rank, self.pg, path, path, cand.algorithm, cand.step)
        problem = first_problem(problems[0] if problems else None, self.pg)
        if problem:
            raise CheckpointError(f"resume from memory step {cand.step}: a file from another node: {problem}")
        cand.fetched |= {t.name for t in transfers if self.layout.node_of(t.dst) == self.layout.node}
        self.moved += transfers

    def fetch_small_files(self, cand: Candidate) -> None:
        """Step 3's first half: a node that does not hold the step (a new node, or a leftover of another save
        there, which goes first) receives its metadata index top (.metadata before the index), meta.json and
        config.yaml; then every rank takes the index top as the step's Metadata (`trust_index`)."""
        if self.layout.leader and self.layout.node not in cand.holders:
            remove_step(step_dir(self.folder, cand.step))
        self.fetch(cand, cand.common())
        self.trust_index(cand)

    def trust_index(self, cand: Candidate) -> None:
        """Every rank, once the small files are on its node: the step's metadata index top (INDEX, checked on this
        node or on arrival) is the Metadata the resume reads (resume.py saved_metadata), its references checked
        against the manifest; never .metadata. A step saved before the index: nothing (the resume reads .metadata)."""
        if not cand.indexed:
            return
        path, problem = step_dir(self.folder, cand.step), None
        manifest = set().union(*(h["files"] for h in cand.holders.values()))
        try:
            trust_metadata(path, read_index(path, lambda name: _read(path, name), manifest))
        except (OSError, MetadataIndexError) as e:
            problem = str(e)
        problem = first_problem(problem, self.pg)  # a node that cannot read it: every rank stops here, none waits
        if problem:
            raise CheckpointError(f"resume from memory step {cand.step}: {problem}")

    def report(self, cand: Candidate) -> None:
        """One line (rank 0) and a `memory_fetch` event: what moved between nodes for this resume."""
        nbytes = sum(t.expected["size"] for t in self.moved)
        what = (f"{plural(len(self.moved), 'file')} ({nbytes / 2**20:.1f} MiB) fetched from other nodes over gloo, "
                "checked against the markers' checksums") if self.moved else "every file read is on its own node"
        self.info(f"resume: memory step {cand.step}: {what}")
        self.event("memory_fetch", step=cand.step, files=len(self.moved), bytes=nbytes)


class PeerLoad:
    """What resume.py's restore asks of a manager (rank, world_size, pg, load) for a memory step: the load
    first fetches the files this node lacks, then dcp.load reads the node's folder."""

    def __init__(self, mgr, recovery: TierRecovery, cand: Candidate):
        self.rank, self.world_size, self.pg = mgr.rank, mgr.world_size, mgr.pg
        self.recovery, self.cand = recovery, cand

    def load(self, path: str, state: dict, model_state: dict | None = None, prefix: str = "") -> None:
        metadata = saved_metadata(path)  # the index's top (trust_index), or .metadata read once (before the index)
        trust_metadata(path, metadata)  # the model check and dcp.load take this one
        if model_state is not None:
            check_model_matches(path, model_state, prefix)
        if isinstance(metadata, IndexedMetadata):
            self._complete(metadata, state)
        self.recovery.fetch(self.cand, files_read_by(state, metadata))
        self.recovery.report(self.cand)
        load(path, state, self.pg, model_state, prefix)

    def _complete(self, metadata: IndexedMetadata, state: dict) -> None:
        """The index buckets this rank's shards meet, fetched where its node lacks them, added to `metadata`: the
        entries dcp.load's plan reads, and no others. Two collectives on every rank."""
        flat = _flat(state)
        names = needed_files(metadata, flat)
        self.recovery.fetch(self.cand, names)
        for name in names:
            add_bucket(metadata, name)
        missing = uncovered_keys(metadata, flat)  # a layout the index does not describe: never FSDP's dim-0 shards
        problem = first_problem(f"{metadata.index_path}: the metadata index does not describe the shards of "
                                f"{', '.join(missing[:3])} (only node 0 holds .metadata)" if missing else None, self.pg)
        if problem:
            raise CheckpointError(f"resume from memory step {self.cand.step}: {problem}")


def _read(path: str, name: str) -> bytes:
    with open(os.path.join(path, name), "rb") as f:
        return f.read()


def _flat(state: dict) -> dict:
    """`state` as dcp.load's planner sees it: Stateful values' state dicts, flattened."""
    planner = DefaultLoadPlanner()
    planner.set_up_planner({k: v.state_dict() if isinstance(v, Stateful) else v for k, v in state.items()}, None, False)
    return planner.state_dict

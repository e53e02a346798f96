"""An index of DCP's global .metadata, written with the checkpoint, so that on resume each rank reads only the
entries it loads instead of the whole file (O(tensors x W): ~630 MB at 70B on 2,048 ranks).

    python -m pytest tests/test_ckpt_metadata.py -q -n 0
    python bench/scale_metadata.py --worlds 64,256 --out /tmp/m.json      # the bytes at the presets' shapes

The checkpoint stays a standard DCP checkpoint: .metadata is written whole, as DCP writes it, and dcp.load or
torch's format utilities read it unchanged. Beside it, the coordinator's finish (checksum.py) writes, from the same
object, small files that the commit marker lists and checksums like any other:
- `.metadata.index` (INDEX): every key's header (dtype, size), the whole entries of the keys saved as one chunk
  (a replicated tensor, a bytes item, a rank's own RNG), DCP's planner_data, storage_meta and version, and
  how the rest is bucketed. O(tensors) (+ one entry per rank for per-rank items), read by every rank.
- `.metadata.index-<g>-<b>`, one per `ranks_per_bucket` saving ranks (torchrun's ranks per node; ceil(W / 8)
  with 8) and per group g of keys of like dim-0 size (each distinct size its own group, up to GROUPS): the chunks,
  and their storage entries, of the group's keys saved in several chunks whose dim-0 rows meet bucket b. A key of
  n rows saved by W ranks has ceil(n / W) rows per rank, so bucket b holds rows [b x ranks_per_bucket x
  ceil(n / W), ...): at the same W, rank r's FSDP shard lies in bucket r // 8 of every group; at another W, the
  buckets its new shard's rows meet, which for keys of one size are the same one or two (keys of different sizes,
  e.g. 1,024 KV rows and 8,192 hidden rows over 1,536 ranks, map a rank to different saved ranks: hence the
  groups). A chunk goes into every bucket its rows meet, so any chunk overlapping a shard is in a bucket that
  shard meets, whatever the sharding. Llama: 4 sizes, so 4 x ceil(W / 8) + 1 files.
On resume (resume.py) every rank reads INDEX (verify checks its references against the manifest; the model check
and the train-state fit need only headers) and `IndexedLoadPlanner` adds, before DCP plans the load, the buckets
this rank's shards meet; then it checks that the chunks found cover every shard it loads, else it reads the global
.metadata (a layout this index does not describe: never the case for FSDP's dim-0 shards). No rank opens the
global .metadata on resume; `python -m ckpt verify` reads it and checks that the index says exactly what it says.
"""

from __future__ import annotations

import copyreg
import dataclasses
import io
import math
import os
import pickle
import re
from typing import Callable, Iterable

from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner_helpers import _create_chunk_list  # DCP's own: the shard a value holds

from .storage import join

INDEX = ".metadata.index"
FORMAT = 1
GROUPS = 8  # at most this many groups of key sizes: the file count is at most GROUPS x ceil(W / 8) + 1


def bucket_file(group: int, bucket: int) -> str:
    return f"{INDEX}-{group}-{bucket:05d}"


_BUCKET = re.compile(r"^" + re.escape(INDEX) + r"-\d+-(\d+)$")


def bucket_of(name: str) -> int | None:
    """The bucket number of index file `name`; None for INDEX and any other file."""
    m = _BUCKET.match(name)
    return int(m.group(1)) if m else None


def ranks_per_bucket() -> int:
    """Saving ranks per bucket file: torchrun's ranks per node (LOCAL_WORLD_SIZE), 8 without it."""
    return int(os.environ.get("LOCAL_WORLD_SIZE") or 8)


def index_files_of(names, ranks, per_bucket: int) -> list[str]:
    """Of the file names `names`, INDEX and the bucket files that hold the chunks saved by `ranks` (at the same
    world size, the entries those ranks load: rank r's dim-0 shard lies in bucket r // per_bucket of every group)."""
    buckets = {r // per_bucket for r in ranks}
    return sorted(n for n in names if n == INDEX or bucket_of(n) in buckets)


def size_groups(rows: Iterable[int]) -> dict[int, int]:
    """{dim-0 size: its group}: each distinct size its own group, or, past GROUPS sizes, neighbouring sizes share."""
    sizes = sorted(set(rows))
    return {n: i * min(GROUPS, len(sizes)) // len(sizes) for i, n in enumerate(sizes)}


def is_index_file(name: str) -> bool:
    return name == INDEX or name.startswith(f"{INDEX}-")


class MetadataIndexError(Exception):
    """An index file that does not agree with the checkpoint (its references, or .metadata itself)."""


class Bucketing:
    """Which bucket file holds which rows of a key: `world_size` saving ranks, `ranks_per_bucket` per file."""

    def __init__(self, world_size: int, ranks_per_bucket: int):
        self.world_size, self.ranks_per_bucket = world_size, max(1, ranks_per_bucket)
        self.buckets = math.ceil(world_size / self.ranks_per_bucket)

    def rows_per_bucket(self, rows: int) -> int:
        return max(1, self.ranks_per_bucket * math.ceil(rows / self.world_size))

    def of_rows(self, rows: int, start: int, stop: int) -> range:
        """The buckets rows [start, stop) of a key of `rows` rows meet (empty for no rows)."""
        if stop <= start:
            return range(0)
        per = self.rows_per_bucket(rows)
        last = self.buckets - 1
        return range(min(start // per, last), min((stop - 1) // per, last) + 1)


def _rows(size, offsets, sizes) -> tuple[int, int, int]:
    """(rows of the key, first row, row after the last) along dim 0; a 0-d value is one row."""
    if len(size) == 0:
        return 1, 0, 1
    return size[0], offsets[0], offsets[0] + sizes[0]


def _split(md: Metadata) -> tuple[dict, list[str]]:
    """INDEX's state_dict_metadata (headers; whole entries of one-chunk keys) and the keys whose chunks are bucketed."""
    headers, bucketed = {}, []
    for key, entry in md.state_dict_metadata.items():
        if isinstance(entry, TensorStorageMetadata) and len(entry.chunks) > 1:
            headers[key] = TensorStorageMetadata(entry.properties, entry.size, [])
            bucketed.append(key)
        else:
            headers[key] = entry
    return headers, bucketed


def build(md: Metadata, world_size: int, ranks_per_bucket: int) -> dict[str, bytes]:
    """{file name: pickled content} of the index of `md`, saved by `world_size` ranks: INDEX and every bucket file."""
    b = Bucketing(world_size, ranks_per_bucket)
    headers, bucketed = _split(md)
    storage, apart = md.storage_data or {}, set(bucketed)
    single = {idx: info for idx, info in storage.items() if idx.fqn not in apart}
    top = Metadata(headers, planner_data=md.planner_data, storage_data=single, storage_meta=md.storage_meta,
                   version=md.version)
    groups = size_groups(md.state_dict_metadata[key].size[0] for key in bucketed)
    buckets = {(g, n): {"chunks": {}, "storage_data": {}} for g in sorted(set(groups.values()))
               for n in range(b.buckets)}
    for key in bucketed:  # T x W chunks on the coordinator, at every save: the loop does no more than it must
        entry = md.state_dict_metadata[key]
        rows, group = entry.size[0], groups[entry.size[0]]
        per, last = b.rows_per_bucket(rows), b.buckets - 1
        for chunk in entry.chunks:
            off, sizes = chunk.offsets, chunk.sizes
            if 0 in sizes:
                continue  # an empty shard: nothing to read
            idx = _index(key, off)
            for n in range(min(off[0] // per, last), min((off[0] + sizes[0] - 1) // per, last) + 1):  # b.of_rows
                bucket = buckets[group, n]
                bucket["chunks"].setdefault(key, []).append(chunk)
                bucket["storage_data"][idx] = storage[idx]
    out = {INDEX: pickle.dumps({"format": FORMAT, "world_size": world_size, "ranks_per_bucket": b.ranks_per_bucket,
                                "groups": groups, "metadata": top})}
    out.update({bucket_file(*gn): _dumps(content) for gn, content in buckets.items()})
    return out


def _index(key: str, offsets) -> MetadataIndex:
    """MetadataIndex(key, offsets) sharing the chunk's offsets (one torch.Size, pickled once per chunk, not twice),
    without its __init__ copying them."""
    idx = object.__new__(MetadataIndex)
    idx.__dict__.update(fqn=key, offset=offsets, index=None)
    return idx


def _storage_info(info: _StorageInfo):
    """_StorageInfo pickled as its constructor call: the object read back is equal to what its own __getstate__
    (a dict comprehension per object, a third of build's time) gives."""
    return _StorageInfo, (info.relative_path, info.offset, info.length, info.transform_descriptors)


def _dumps(content) -> bytes:
    out = io.BytesIO()
    pickler = pickle.Pickler(out, pickle.DEFAULT_PROTOCOL)
    pickler.dispatch_table = {**copyreg.dispatch_table, _StorageInfo: _storage_info}
    pickler.dump(content)
    return out.getvalue()


class IndexedMetadata(Metadata):
    """INDEX's Metadata (every key's header, one-chunk entries whole), with what completes it: `index_path` (the
    checkpoint), `bucketing`, `read(name) -> bytes` and `manifest` (the names the commit marker lists; None: not
    checked). `buckets_read`: the bucket files read so far (the tests count them); `groups`: {dim-0 size: its
    group of bucket files}."""
    index_path: str
    bucketing: Bucketing
    groups: dict[int, int]
    read: Callable[[str], bytes]
    manifest: set[str] | None
    buckets_read: list[str]


def read_index(path: str, read: Callable[[str], bytes], manifest: Iterable[str] | None) -> IndexedMetadata:
    """INDEX of checkpoint `path` (`read(name)`: a file of it, whole); FileNotFoundError if it has none. Raises
    MetadataIndexError if it references a data file outside `manifest`."""
    content = pickle.loads(read(INDEX))
    md = content["metadata"]
    md.__class__ = IndexedMetadata
    md.index_path, md.read, md.buckets_read = path, read, []
    md.bucketing = Bucketing(content["world_size"], content["ranks_per_bucket"])
    md.groups = content["groups"]
    md.manifest = None if manifest is None else set(manifest)
    _check_references(md, md.storage_data)
    return md


def _check_references(md: IndexedMetadata, storage: dict) -> None:
    if md.manifest is None:
        return
    for name in sorted({info.relative_path for info in storage.values()} - md.manifest):
        # the index says what .metadata says (check_agrees): the same words as commit_protocol.check_references
        raise MetadataIndexError(f"{join(md.index_path, name)}: referenced by .metadata but not in the manifest")


def needed_files(md: IndexedMetadata, state: dict) -> list[str]:
    """The bucket files flat `state`'s shards need (`complete` reads them): what a rank must have before its load."""
    return [bucket_file(g, n) for g, n in sorted(_needed_buckets(md, state))]


def _needed_buckets(md: IndexedMetadata, state: dict) -> set[tuple[int, int]]:
    """The (group, bucket)s that hold the chunks of every bucketed key of flat `state` that this rank's shards meet."""
    needed: set[tuple[int, int]] = set()
    for key, value in state.items():
        entry = md.state_dict_metadata.get(key)
        if not isinstance(entry, TensorStorageMetadata) or entry.chunks:
            continue  # a one-chunk entry is in INDEX already
        group = md.groups[entry.size[0]]
        for chunk in _create_chunk_list(value):
            needed.update((group, n) for n in md.bucketing.of_rows(*_rows(entry.size, chunk.offsets, chunk.sizes)))
    return needed


def add_bucket(md: IndexedMetadata, name: str) -> None:
    content = pickle.loads(md.read(name))
    _check_references(md, content["storage_data"])
    for key, chunks in content["chunks"].items():
        have = md.state_dict_metadata[key].chunks
        known = {tuple(c.offsets) for c in have}
        have.extend(c for c in chunks if tuple(c.offsets) not in known)
    md.storage_data.update(content["storage_data"])
    md.buckets_read.append(name)


def _overlap(a_off, a_size, b_off, b_size) -> int:
    return math.prod(max(0, min(ao + asz, bo + bsz) - max(ao, bo)) for ao, asz, bo, bsz in
                     zip(a_off, a_size, b_off, b_size))


def uncovered(md: Metadata, state: dict) -> list[str]:
    """The keys of flat `state` whose shards the chunks `md` holds do not cover (DCP's saved chunks never overlap,
    so the volumes of their intersections add up to the shard's exactly when they cover it)."""
    out = []
    for key, value in state.items():
        entry = md.state_dict_metadata.get(key)
        if not isinstance(entry, TensorStorageMetadata):
            continue
        for chunk in _create_chunk_list(value):
            need = math.prod(chunk.sizes)
            if sum(_overlap(chunk.offsets, chunk.sizes, c.offsets, c.sizes) for c in entry.chunks) != need:
                out.append(key)
                break
    return out


def complete(md: Metadata, state: dict) -> None:
    """Add to `md`, in place, the bucket entries flat `state`'s shards need; where they do not cover a shard, take
    every entry of the global .metadata instead. A Metadata that is not an index's: nothing to do."""
    if not isinstance(md, IndexedMetadata):
        return
    for group, n in sorted(_needed_buckets(md, state)):
        add_bucket(md, bucket_file(group, n))
    if uncovered(md, state):
        whole = pickle.loads(md.read(".metadata"))
        md.buckets_read.append(".metadata")
        _check_references(md, whole.storage_data)
        md.state_dict_metadata, md.storage_data = whole.state_dict_metadata, whole.storage_data


class IndexedLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, which first completes an index's Metadata with what this rank's state needs
    (`complete`). DCP passes the same Metadata object to the reader's set_up_storage_reader right after
    set_up_planner (torch 2.13 state_dict_loader.py local_step), so the reader sees the completed storage entries."""

    def set_up_planner(self, state_dict, metadata: Metadata | None = None, is_coordinator: bool = False) -> None:
        super().set_up_planner(state_dict, metadata, is_coordinator)
        if metadata is not None:
            complete(metadata, self.state_dict)


def check_agrees(md: Metadata, read: Callable[[str], bytes], where: str) -> None:
    """The index files say exactly what .metadata `md` says (`python -m ckpt verify`); raises MetadataIndexError."""
    top = pickle.loads(read(INDEX))
    if md.storage_meta is not None:  # a reader stamps its load_id on what it read; the index was written without
        md = dataclasses.replace(md, storage_meta=dataclasses.replace(md.storage_meta, load_id=None))
    for name, data in build(md, top["world_size"], top["ranks_per_bucket"]).items():
        try:  # compared unpickled: MetadataIndex's equality leaves out its position hint
            same = pickle.loads(read(name)) == pickle.loads(data)
        except FileNotFoundError:
            same = False
        if not same:
            raise MetadataIndexError(f"{join(where, name)}: does not agree with .metadata")

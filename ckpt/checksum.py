"""Checksums of checkpoint files, computed by each rank on the bytes it writes, as it writes them.

    python bench/checksum_bench.py          # the measurement behind the choice (docs/checkpoint-integrity.md)

XXH3-128 (xxhash) is the algorithm: it guards against torn writes and bit rot, not adversaries, and
on this machine it hashes ~15x faster than SHA-256 (idle: ~30 vs ~2 GB/s in memory; loaded: ~5 vs ~0.4),
so hashing in line with the write costs a few percent of it. 128 bits make an accidental match of
damaged data impossible in practice (crc32c, half as fast here, has 32). Manifests written before it
say nothing and mean SHA-256.

`ChecksummingWriter` is DCP's FileSystemWriter with fsync on and a `HashingFileSystem`: every file a
rank writes is hashed on its way to disk, in the thread or process that uploads (never the training
thread of an async save), and the digests travel to rank 0 with DCP's own write results.

Only the coordinator keeps DCP's global Metadata after a save (`SavedMetadata`): DCP broadcasts the object its
finish step leaves to every rank (torch 2.13 state_dict_saver.py `finish_checkpoint` returns the planner's
global Metadata, and `_DistWrapper.all_reduce` broadcasts it): at 70B on 2,048 ranks, hundreds of MB each
(bench/scale_metadata.py).
"""

from __future__ import annotations

import hashlib
import io
import os
import pickle
from contextlib import contextmanager
from multiprocessing.reduction import ForkingPickler

import xxhash
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION, FileSystem
from torch.distributed.checkpoint.metadata import Metadata
from torch.futures import Future

from . import metadata_index
from .storage import storage_for

ALGORITHM = "xxh3_128"
LEGACY_ALGORITHM = "sha256"  # commit.json files without an "algorithm" field
_NEW = {"xxh3_128": xxhash.xxh3_128, "sha256": hashlib.sha256}  # both release the GIL on large buffers
_CHUNK = 8 << 20


def new_hasher(algorithm: str = ALGORITHM):
    return _NEW[algorithm]()


def file_digest(path: str, algorithm: str = ALGORITHM, opener=open) -> dict:
    """{"size": bytes, <algorithm>: hex digest} of a file, read in chunks. `opener(path)`: a binary read stream
    (an object store's streaming read: the backend's open_read, ckpt/storage/)."""
    h, size = new_hasher(algorithm), 0
    with (open(path, "rb") if opener is open else opener(path)) as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            size += len(chunk)
    return {"size": size, algorithm: h.hexdigest()}


class HashingFileSystem(FileSystem):
    """DCP's FileSystem whose write streams hash what passes through them. `digests` maps each written
    file's name to {"size", ALGORITHM}. DCP writes a file front to back (it only `tell()`s, never seeks),
    so the hash of the bytes written is the hash of the file. Module level: it pickles into the
    process-mode uploader with the storage writer."""

    def __init__(self, inner: FileSystem | None = None):
        super().__init__()
        self.inner = inner or FileSystem()
        self.digests: dict[str, dict] = {}

    # everything but the write streams is the inner file system's: the backend's (its writer_filesystem)
    def init_path(self, path):
        return self.inner.init_path(path)

    def concat_path(self, path, suffix):
        return self.inner.concat_path(path, suffix)

    def rename(self, path, new_path):
        self.inner.rename(path, new_path)

    def mkdir(self, path):
        self.inner.mkdir(path)

    def exists(self, path):
        return self.inner.exists(path)

    def rm_file(self, path):
        self.inner.rm_file(path)

    @contextmanager
    def create_stream(self, path, mode):
        with self.inner.create_stream(path, mode) as stream:
            if "w" not in mode:
                yield stream
                return
            hashing = _HashingStream(stream)
            yield hashing
        # reached only when the writer finished without error; one key per file, so threads don't collide
        self.digests[os.path.basename(str(path))] = {"size": hashing.size, ALGORITHM: hashing.hasher.hexdigest()}


class _HashingStream:
    def __init__(self, stream):
        self._stream, self.hasher, self.size = stream, new_hasher(), 0

    def write(self, data) -> int:
        n = self._stream.write(data)  # a buffered binary file writes all of it or raises
        self.hasher.update(data)
        self.size += memoryview(data).nbytes
        return n

    def __getattr__(self, name):  # tell, fileno, flush, close: the real file's
        return getattr(self._stream, name)


class SavedMetadata(Metadata):
    """DCP's global Metadata once the coordinator's finish has written it: whole in that process, with
    `file_digests` (every file's digest, for the commit marker) and `data_files` (the data files it references).

    DCP broadcasts this very object to every rank after finish and returns it from dcp.save (in the coordinator's
    process, the object itself). Pickled for that broadcast, it becomes a Metadata with no entries: no other rank
    receives or unpickles the O(tensors x W) entries, and none uses them (the commit is rank 0's, committer.py).
    Pickled by multiprocessing (the process-mode uploader handing its result to the training process of the
    same rank, which on rank 0 commits), it carries the commit's inputs, `file_digests` and `data_files`: O(W)
    names, on the coordinator only."""

    def __reduce__(self):
        return Metadata, ({}, None, None, self.storage_meta, self.version)


def _commit_summary(storage_meta, version, file_digests: dict, data_files: set) -> Metadata:
    summary = Metadata({}, storage_meta=storage_meta, version=version)
    summary.file_digests, summary.data_files = file_digests, data_files
    return summary


ForkingPickler.register(SavedMetadata, lambda m: (_commit_summary, (m.storage_meta, m.version, m.file_digests,
                                                                    m.data_files)))


def data_files(metadata) -> set[str]:
    """The data files a DCP Metadata reads from (a commit summary names them itself)."""
    named = getattr(metadata, "data_files", None)
    if named is not None:
        return set(named)
    return {info.relative_path for info in (metadata.storage_data or {}).values()}


class ChecksummingWriter(FileSystemWriter):
    """FileSystemWriter that fsyncs and checksums every file it writes.

    Each rank's digests ride to rank 0 on its write results, which DCP gathers there for .metadata;
    rank 0's finish writes .metadata (unchanged: the plain Metadata), then puts the digests, as
    `metadata.file_digests`, on the Metadata that DCP returns from dcp.save / the async upload future, in the
    training process whichever thread or process uploaded, and makes it a `SavedMetadata`: the other ranks
    receive an empty one (the memory tier's too: its rank 0 hands each rank the digests it needs,
    memory_tier/replicate.py)."""

    def __init__(self, path: str, inner_fs: FileSystem | None = None, **writer_options):
        # The backend says whether DCP must fsync each file: an object is durable once its PUT (the stream's
        # close) returns, so there is nothing to fsync (DCP would fall back to a machine-wide os.sync() per file).
        store = storage_for(path)
        self.renames = store.atomic_rename  # picklable: the process-mode uploader gets this writer
        super().__init__(path, sync_files=store.sync_files, **writer_options)
        self.fs = HashingFileSystem(inner_fs or store.writer_filesystem())
        self.path = self.fs.init_path(path)

    def write_data(self, plan, planner) -> Future:
        results = _ResultsWithDigests(super().write_data(plan, planner).value())  # written synchronously
        results.digests = dict(self.fs.digests)
        done: Future = Future()
        done.set_result(results)
        return done

    def finish(self, metadata, results) -> None:
        # DCP's save-plan cache hands the same object to every save: what the last finish added comes off first
        metadata.__class__ = Metadata
        for added in ("file_digests", "data_files"):
            vars(metadata).pop(added, None)
        if self.renames:
            super().finish(metadata, results)
        else:
            self._finish_without_rename(metadata, results)
        metadata.file_digests = {name: d for r in results for name, d in getattr(r, "digests", {}).items()}
        metadata.file_digests.update(self._write_index(metadata, len(results)))
        metadata.data_files = data_files(metadata)
        metadata.__class__ = SavedMetadata

    def _write_index(self, metadata, world_size: int) -> dict[str, dict]:
        """The coordinator: the index of .metadata (metadata_index.py), one bucket per node's ranks (torchrun's
        LOCAL_WORLD_SIZE; 8 without it), durable like .metadata. Returns the index files' digests."""
        for name, data in metadata_index.build(metadata, world_size, metadata_index.ranks_per_bucket()).items():
            with self.fs.create_stream(self.fs.concat_path(self.path, name), "wb") as f:
                f.write(data)
                if self.sync_files:
                    try:
                        os.fsync(f.fileno())
                    except (AttributeError, io.UnsupportedOperation):
                        os.sync()
        return {name: d for name, d in self.fs.digests.items() if metadata_index.is_index_file(name)}


    def _finish_without_rename(self, metadata, results) -> None:
        """FileSystemWriter.finish on a store without an atomic rename (an object store): .metadata in one PUT, never DCP's `.metadata.tmp` ->
        `.metadata` rename (a copy plus a delete on S3). A PUT is atomic, and .metadata is trusted only
        through the digest the commit marker holds, so a crash can leave nothing a reader believes."""
        metadata.version = CURRENT_DCP_VERSION
        metadata.storage_data = {wr.index: wr.storage_data for rank_results in results for wr in rank_results}
        metadata.storage_meta = self.storage_meta()
        with self.fs.create_stream(self.fs.concat_path(self.path, ".metadata"), "wb") as f:
            pickle.dump(metadata, f)


class _ResultsWithDigests(list):
    """One rank's list of DCP WriteResults, plus {file name: digest} of the files it wrote."""
    digests: dict[str, dict]

"""The contract every storage backend keeps: the operations the checkpoint code asks of a place where bytes go, what
"atomic" means there, and the rules for the streams DCP writes through. Read this before writing a backend.

    python -m pytest tests/test_storage_backends.py -q     # every backend against this contract

A backend is one class derived from `Storage`, registered by its URL scheme in ckpt/storage/__init__.py
(`BACKENDS`), and one entry in tests/test_storage_backends.py's `BACKENDS`. Nothing outside ckpt/storage/ asks
which scheme a path has: it calls `storage_for(path)` and the methods below. All methods take full paths.

Operations:
- `create(path, data)`: a small file, create-only and atomic: a second create of the same path raises
  FileExistsError (a commit marker is never overwritten or written twice); a reader sees no file or all of it.
- `publish(path, data)`: a small file a reader sees whole or not at all, written once per path by its writer (the
  commit marker). A store with create-only writes makes it a `create`.
- `replace(path, data, etag)` / `etag(path)`: compare-and-swap, offered where `compare_and_swap` is True: the
  overwrite happens only if the file still has `etag` (else FileExistsError); returns the new one.
- `read`, `open_read` (a stream, front to back), `size`, `exists` (a file, not a folder/prefix), `listdir` (names
  right under a folder/prefix, [] if none), `list_folders` (the names of folders/prefixes right under it), `sizes`
  ({name: bytes} of the files right under it), `is_folder` (a folder, or a prefix with something under it);
  `has_folders` says whether a folder exists apart from its files (False on an object store).
- `delete(path)`, `delete_many(paths)` (files already gone are fine), `delete_tree(path)` (everything under it;
  nothing there is fine); `list_objects(path)` (every file under it, full paths: the default sweep's list).
- `put_folder(local, url)`: where there is no atomic rename, a folder built locally goes up whole, config.json
  last (export's HF folder, ckpt/hf/export.py); written here once, through `upload_stream(path)`, the backend's
  write-only stream into one object (the bytes visible at close, none after a failed write).
- `occupied(path)`: anything stands there; `prepare_folder(path)`: make the folder a step's files go into (a store
  of objects has none to make).
- Retention (ckpt/retention.py says when): `retire(path, marker)` takes a checkpoint out of the listing at once
  (its marker first, so no crash leaves a marked checkpoint with files missing) and raises OSError if it cannot;
  `retire_failed(path, error, on_log)` makes sure an unmarked one that could not be retired goes anyway;
  `sweep_list(root, retired)`, `sweep_share(root, files)`, `sweep_finish(root, retired, on_log)` delete the
  bytes of what was retired, spread over the ranks; `clear_stale(path, marker, on_log)` gets a leftover out of the
  way of a save.
- The lock: `lock_class`, the class ckpt/lock.py instantiates for `<ckpt.dir>/.lock` (one job per folder).
- Shared visibility: what one process writes, every process of the job reads, on every node: rank 0 writes the
  marker from the files every rank wrote, and a resume on other nodes reads them. `visible_to` says who sees a
  process's writes: "all" (the contract: an object store; a folder, on a filesystem every node mounts, which the
  trainer proves at start, common/shared_paths.py), "node" (a node-local folder) or "process" (an in-memory
  store). `sharing_problem` refuses a backend that sees less than a job spans (ckpt/lock.py asks it before the
  lock, on every rank); and before the marker, the committing rank lists the folder (sizes only, no reads) and
  commits only if it sees every file the manifest names (commit_protocol.py).
- The guarantees checked on the store (`check_guarantees`, written here once in terms of create/replace/etag/
  delete, so every backend with compare_and_swap gets it): a probe object proves that a second create is refused
  and that a swap with a stale tag is refused; `location(path)` names the store in its error line (the endpoint and
  the bucket), and `create_words` / `swap_words` how the backend asks for the two conditions.
- What atomic means: `create` and `publish` are; `atomic_rename` says whether a rename is too (a folder: yes; an
  object store: no, a rename there is a copy plus a delete), so DCP's `.metadata.tmp` -> `.metadata` rename is used
  only where it is (ckpt/checksum.py).
- DCP: `writer_filesystem(folder_fs=None)` (the FileSystem ChecksummingWriter writes through; `folder_fs`, the
  FileSystem class a writer prefers for a folder, writeback.py's, is used by backends that write through a file
  descriptor); `sync_files` (whether DCP must fsync each file); `reader_class` (DCP's StorageReader, built as
  `reader_class(path)`, an `ItemLoader`: its read_data hands each item to `load_item`, which the reader variants
  of resume and export override on every backend at once, `ckpt.storage.reader_with`); `partial_writes` (whether
  a reader can ever see a file half written: the fault tests tear files only where it can).

The DCP write-stream contract (`writer_filesystem().create_stream(path, "wb")`), which DCP relies on and a backend
must keep:
1. DCP writes the whole file, then CLOSES THE STREAM ITSELF while still inside `create_stream`'s context (torch's
   `_write_files_from_queue`). So `close()` must commit the bytes (or keep them for the context's exit to commit);
   a stream that discards its buffer on close loses the file.
2. The bytes become visible at the latest when the context exits without an exception; `tell()` counts the bytes
   written (DCP records offsets with it).
3. A write that fails (an exception inside the context) leaves no visible partial file: an object store aborts
   the upload; a folder may keep a torn file under the step's name only because the step folder is never
   committed (no marker), and the next save clears it.
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import socket
from typing import Callable

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.planner import LoadItemType


class GuaranteeError(RuntimeError):
    """The store does not enforce create-only writes or compare-and-swap (Storage.check_guarantees); the message
    names the store, what it fails to enforce, and the key that runs at one's own risk."""


_VERDICTS: dict[str, list[tuple[str, tuple]]] = {}  # Storage.location -> its probe's verdict; kept per process
# what a missing guarantee costs, for the error and warning lines (the lock is created create-only, then swapped)
_BOTH_RUN = "two jobs on one prefix may both run"
_NO_CREATE_ONLY = ("a commit marker can be written twice", _BOTH_RUN)
_NO_SWAP = (_BOTH_RUN,)


def _accepted(write: Callable[[], object]) -> bool:
    """True if the conditional write `write` went through, False if the store refused it (FileExistsError)."""
    try:
        write()
    except FileExistsError:
        return False
    return True


def _probe(store: "Storage", probe: str) -> list[tuple[str, tuple]]:
    """Six requests on one small object, whatever the model size or world size: create, create again
    (refused?), read its tag, swap with that tag (accepted?), swap with the now stale tag (refused?), delete. The
    probe is deleted whatever happens; an unreachable store raises OSError, as any other request would."""
    missing = []
    try:
        store.create(probe, b"1")
        if _accepted(lambda: store.create(probe, b"2")):  # distinct bytes: an ETag may be the content's hash
            missing.append((f"create-only writes are not enforced: {store.create_words} overwrote the object",
                            _NO_CREATE_ONLY))
        tag = store.etag(probe)
        if not _accepted(lambda: store.replace(probe, b"3", tag)):
            missing.append(("compare-and-swap does not work: a swap with the object's current tag was refused",
                            _NO_SWAP))
        elif _accepted(lambda: store.replace(probe, b"4", tag)):
            missing.append((f"compare-and-swap is not enforced: {store.swap_words} overwrote the object", _NO_SWAP))
    finally:
        with contextlib.suppress(OSError):
            store.delete(probe)
    return missing


class Storage:
    """The operations shared by every backend, in terms of the others; a backend overrides what differs."""

    compare_and_swap = False  # offers replace/etag
    visible_to = "all"  # who sees what one process writes: "all" (every node), "node" or "process" (see above)
    sync_files = False  # DCP must fsync each file it writes
    atomic_rename = False  # a rename is atomic (a folder); on S3 it is a copy plus a delete
    partial_writes = False  # a reader can see a file half written
    reader_class: type  # DCP's StorageReader here, an ItemLoader; set by each backend
    lock_class: type  # set by each backend
    has_folders = False  # a folder exists apart from the files in it (an object store has prefixes only)
    missing = "nothing stored under this prefix"  # what a path that holds nothing is, for error lines
    bucket_word = "bucket"  # what the store calls the first part of its URLs (Azure: container), for error lines
    create_words = "a second create-only write"  # how `create` asks for create-only, for the probe's error line
    swap_words = "a compare-and-swap with a stale tag"  # how `replace` asks for its condition, likewise

    @staticmethod
    def join(path: str, *names: str) -> str:
        """'/' between the parts, whatever the OS (a URL)."""
        return "/".join([path.rstrip("/"), *names])

    @staticmethod
    def spelling(path: str) -> str:
        """`path` as one spelling (the URL without a trailing /)."""
        return path.rstrip("/")

    def sharing_problem(self, path: str, processes: int, nodes: int) -> str | None:
        """Why a checkpoint that `processes` processes on `nodes` nodes write cannot go to `path`, or None: a store
        that one process or one node sees alone holds a job's checkpoints only where that is the whole job."""
        spans = {"all": 0, "node": nodes, "process": processes}[self.visible_to]
        if spans <= 1:
            return None
        return (f"{path}: its storage ({type(self).__name__}) shows what a process writes to that {self.visible_to} "
                f"alone, but {processes} processes on {nodes} node(s) write each checkpoint, and the committing rank "
                "must see every file: use a folder every node mounts, or an object store (s3://, az://)")

    def publish(self, path: str, data: bytes) -> None:
        self.create(path, data)

    def dcp_reader(self, path: str):
        return self.reader_class(path)

    def is_folder(self, path: str) -> bool:
        """Something is stored under `path` (an object store has no empty folders)."""
        return bool(self.listdir(path))

    def occupied(self, path: str) -> bool:
        """Anything stands at `path` (a file, a folder, objects under the prefix)."""
        return bool(self.listdir(path))

    def prepare_folder(self, path: str) -> None:
        """An object store has no folders: nothing to make."""

    def location(self, path: str) -> str:
        """The store holding `path`, as an error line names it (here scheme://bucket; a backend with an endpoint
        adds it). The probe's verdict is kept per location."""
        scheme, _, rest = path.partition("://")
        return f"{scheme}://{rest.split('/')[0]}"

    def missing_guarantees(self, path: str) -> list[tuple[str, tuple]]:
        """What the store holding `path` fails to enforce of create-only writes and compare-and-swap, each as
        (what the probe saw, what that costs); [] if both hold. Proven on a probe object under `path`, and kept for
        the process: a run, or a `python -m ckpt` command, asks a store once. A backend without compare_and_swap (a
        folder: the OS keeps O_EXCL and flock) is not probed."""
        if not self.compare_and_swap:
            return []
        where = self.location(path)
        if where not in _VERDICTS:
            name = f".probe-{socket.gethostname()}-{os.getpid()}-{os.urandom(4).hex()}"  # no two probes share one
            _VERDICTS[where] = _probe(self, self.join(path, name))
        return _VERDICTS[where]

    def check_guarantees(self, path: str, unchecked: bool, risk_key: str, warn: Callable[[str], None]) -> None:
        """Raise GuaranteeError if the store holding `path` fails the probe (missing_guarantees), unless
        `unchecked`: then `warn` one line saying what no longer holds. `risk_key`: how the user sets `unchecked`
        (a config key, a flag), named in the error line."""
        missing = self.missing_guarantees(path)
        if not missing:
            return
        head = (f"the object store at {self.location(path)} does not keep the checkpoint guarantees: "
                + "; ".join(seen for seen, _ in missing))
        risk = " and ".join(dict.fromkeys(cost for _, costs in missing for cost in costs))
        if unchecked:
            warn(f"warning: {head}; running anyway ({risk_key}), so {risk}")
            return
        raise GuaranteeError(f"{head}. Use a store that enforces them, or set {risk_key} to run at your own risk: "
                             f"{risk}")

    def upload_stream(self, path: str):
        """A write-only stream into the object `path` (an object store's backend supplies it; put_folder uses it)."""
        raise NotImplementedError(f"{type(self).__name__} has no upload_stream")

    def put_folder(self, local: str, url: str) -> None:
        """Upload every file under the folder `local` to `url`/ (each through the backend's `upload_stream`, in
        parallel parts), config.json last; on failure delete what went up, then raise."""
        names = sorted(os.path.relpath(os.path.join(d, f), local) for d, _, fs in os.walk(local) for f in fs)
        names.sort(key=lambda n: n == "config.json")
        sent: list[str] = []
        try:
            for name in names:
                target = self.join(url, *name.split(os.sep))
                with open(os.path.join(local, name), "rb") as src, self.upload_stream(target) as out:
                    shutil.copyfileobj(src, out, 8 << 20)
                sent.append(target)
        except BaseException:
            with contextlib.suppress(OSError):
                self.delete_many(sent)
            raise

    def retire(self, path: str, marker: str) -> None:
        """The marker goes (the objects follow in the sweep, every rank a share)."""
        try:
            self.delete(self.join(path, marker))
        except FileNotFoundError:
            pass

    def retire_failed(self, path: str, error: OSError, on_log: Callable[[str], None]) -> None:
        """After `retire` raised `error` and `path` is unmarked: see that its bytes go. Here a marker already gone:
        the sweep deletes the objects."""

    def sweep_list(self, root: str, retired: list[str]) -> list[str] | None:
        """Every object under the prefixes `retired` (full paths), None if there are none."""
        return [obj for path in retired for obj in self.list_objects(path)] if retired else None

    def sweep_share(self, root: str, files: list[str]) -> None:
        self.delete_many(files)

    def sweep_finish(self, root: str, retired: list[str], on_log: Callable[[str], None]) -> None:
        for path in retired:
            try:
                self.delete_tree(path)
            except OSError as e:
                on_log(f"warning: retention: could not delete everything under {path} ({e}); the next retention "
                       "tries again")

    def clear_stale(self, path: str, marker: str, on_log: Callable[[str], None]) -> bool:
        """A leftover in the way of a save (rare: after a crash): its marker first, then every object under it, on
        rank 0 (a crash in between leaves an unmarked prefix, which a later retention deletes). True if its bytes
        still wait for a sweep (never here)."""
        self.retire(path, marker)
        self.delete_tree(path)
        on_log(f"checkpoint: deleted {path} (a leftover of an earlier attempt)")
        return False


class ItemLoader:
    """What every backend's DCP reader does with one item its read_data fetched: `load_item(req, stream, planner)`.
    A reader variant that changes how items are handed over (export's single copy, ckpt/hf/export.py) overrides this
    one method, as a mixin over any backend's `reader_class` (ckpt.storage.reader_with)."""

    def load_item(self, req, stream, planner) -> None:
        """One item, as FileSystemReader.read_data hands it to the planner (torch 2.13)."""
        if req.type == LoadItemType.BYTE_IO:
            planner.load_bytes(req, io.BytesIO(stream.read()))
            return
        seekable = stream if stream.seekable() else io.BytesIO(stream.read())
        tensor = torch.load(seekable, map_location="cpu", weights_only=True)
        tensor = narrow_tensor_by_index(tensor, req.storage_offsets, req.lengths)
        target = planner.resolve_tensor(req).detach()
        if target.size() != tensor.size():
            raise AssertionError(f"req {req.storage_index} mismatch sizes {target.size()} vs {tensor.size()}")
        target.copy_(tensor)
        planner.commit_tensor(req, target)

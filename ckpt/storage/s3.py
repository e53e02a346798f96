"""S3 (s3://bucket/prefix) as a storage backend (the contract: ckpt/storage/base.py), through s3fs (fsspec), and
DCP's writer file system and reader on it. The transfers themselves (parallel multipart uploads, ranged GETs, the
retry policy) are in s3_transfer.py.

    python -m pytest tests/test_storage_backends.py tests/test_s3.py -q   # against an S3-compatible test server

Atomic on S3: an object appears whole or not at all when its PUT (or multipart completion) returns. `create` is a
PUT with If-None-Match: * (the server refuses a second one with 412 PreconditionFailed, raised as
FileExistsError); `replace` a PUT with If-Match: <etag> (compare-and-swap, for the run lock: ObjectLock). No rename
anywhere: a rename on S3 is a copy plus a delete, not atomic. So retention deletes a checkpoint's marker first
(`retire`), and the sweep deletes its objects, every rank a share, in DeleteObjects requests of up to 1,000 keys;
a crash after the marker leaves an unmarked prefix older than the newest checkpoint, which the next sweep dooms
like any dead partial save.

s3fs takes credentials and endpoint the standard way: AWS_* environment variables or the AWS config files,
AWS_ENDPOINT_URL for an S3-compatible store; never the training config.
"""

from __future__ import annotations

import io
import os
from contextlib import contextmanager

from torch.distributed.checkpoint._fsspec_filesystem import FileSystem as FsspecFileSystem
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
from torch.futures import Future

from .base import ItemLoader, Storage
from .lock import ObjectLock
from .s3_transfer import PartUploadStream, RangeStream, as_oserror, read_ranges, s3_filesystem, s3_options

DELETE_BATCH = 1000  # keys per DeleteObjects request, S3's maximum


class S3WriterFileSystem(FsspecFileSystem):
    """DCP's fsspec FileSystem on S3, writing through PartUploadStream. An exception while DCP writes a file aborts
    its upload: no torn object is ever left (the stock one commits what was written, then deletes it). DCP closes
    the stream before the context exits: PartUploadStream.close() is the upload's completion (base.py's contract)."""

    def init_path(self, path, **kwargs):
        self.fs = s3_filesystem()
        return path

    @contextmanager
    def create_stream(self, path, mode: str):
        if "w" not in mode:
            with self.fs.open(str(path), mode) as stream:
                yield stream
            return
        with PartUploadStream(self.fs, str(path)) as stream:
            yield stream


class S3Reader(ItemLoader, FsspecReader):
    """DCP's reader on S3: a rank reads only the byte ranges of the items its load plan names (its share, at any
    world size), as parallel ranged GETs (read_ranges), not file by file with one request in flight."""

    def __init__(self, path: str):
        super().__init__(path, **s3_options())

    def read_data(self, plan, planner) -> Future:
        info = self.storage_data
        items = sorted(plan.items, key=lambda r: (info[r.storage_index].relative_path, info[r.storage_index].offset))
        ranges = [(self.fs.concat_path(self.path, info[r.storage_index].relative_path), info[r.storage_index].offset,
                   info[r.storage_index].offset + info[r.storage_index].length) for r in items]
        for req, data in zip(items, read_ranges(self.fs.fs, ranges)):
            stream = self.transforms.transform_load_stream(req, info[req.storage_index].transform_descriptors or (),
                                                           io.BytesIO(data))
            self.load_item(req, stream, planner)
        done: Future = Future()
        done.set_result(None)
        return done


def _http_status(error: OSError) -> int | None:
    """The HTTP status of the S3 answer s3fs translated into `error` (it keeps botocore's error as the cause)."""
    return getattr(error.__cause__, "response", {}).get("ResponseMetadata", {}).get("HTTPStatusCode")


class S3Storage(Storage):
    """An S3 bucket through s3fs. `create` is a PUT with If-None-Match: * (the server refuses a second one with
    412 PreconditionFailed, raised here as FileExistsError); `replace` a PUT with If-Match: <etag>."""

    compare_and_swap = True
    lock_class = ObjectLock
    reader_class = S3Reader  # DCP's reader on S3: this rank's items only, as parallel ranged GETs
    create_words = "a second PUT with If-None-Match: *"
    swap_words = "a PUT with If-Match on a stale ETag"

    def __init__(self):
        self.fs = s3_filesystem()  # no listing cache, the retry policy, the endpoint (s3_transfer.s3_options)

    def location(self, path: str) -> str:
        """The endpoint and the bucket, e.g. http://127.0.0.1:9000 (s3://bucket)."""
        endpoint = s3_options().get("endpoint_url") or "the default AWS S3 endpoint"
        return f"{endpoint} ({super().location(path)})"

    def _put(self, path: str, data: bytes, condition: dict) -> str:
        bucket, key, _ = self.fs.split_path(path)
        try:
            out = self.fs.call_s3("put_object", Bucket=bucket, Key=key, Body=data, **condition)
        except OSError as e:
            if isinstance(e, FileExistsError) or _http_status(e) == 412:
                raise FileExistsError(f"{path}: changed or created by someone else (conditional PUT refused)") from None
            raise
        self.fs.invalidate_cache(path)
        return out["ETag"]

    @as_oserror
    def create(self, path: str, data: bytes) -> str:
        """Create-only; returns the new object's ETag."""
        return self._put(path, data, {"IfNoneMatch": "*"})

    @as_oserror
    def replace(self, path: str, data: bytes, etag: str) -> str:
        """Overwrite only if the object still has `etag`; returns the new ETag, FileExistsError otherwise."""
        return self._put(path, data, {"IfMatch": etag})

    @as_oserror
    def etag(self, path: str) -> str:
        bucket, key, _ = self.fs.split_path(path)
        return self.fs.call_s3("head_object", Bucket=bucket, Key=key)["ETag"]

    @as_oserror
    def read(self, path: str) -> bytes:
        return self.fs.cat_file(path)

    @as_oserror
    def open_read(self, path: str):
        """A streaming read: ranged GETs of PART_BYTES, PARALLEL_PARTS in flight ahead of the reader
        (s3_transfer.RangeStream)."""
        return RangeStream(self.fs, path, self.fs.size(path))

    @as_oserror
    def size(self, path: str) -> int:
        return self.fs.size(path)

    def writer_filesystem(self, folder_fs=None):
        """`folder_fs` is for folders (files written through a descriptor); an object is written by its PUT."""
        return S3WriterFileSystem()

    @as_oserror
    def exists(self, path: str) -> bool:
        """An object (not a prefix) is there."""
        return self.fs.isfile(path)

    @as_oserror
    def listdir(self, path: str) -> list[str]:
        try:
            return sorted(os.path.basename(p.rstrip("/")) for p in self.fs.ls(path, detail=False, refresh=True))
        except FileNotFoundError:
            return []

    list_folders = listdir  # a prefix is a folder

    @as_oserror
    def sizes(self, path: str) -> dict[str, int]:
        """{name: bytes} of the objects right under `path`/ (one listing)."""
        try:
            found = self.fs.ls(path, detail=True, refresh=True)
        except FileNotFoundError:
            return {}
        return {os.path.basename(d["name"]): d["size"] for d in found if d["type"] == "file"}

    @as_oserror
    def delete(self, path: str) -> None:
        self.fs.rm_file(path)

    @as_oserror
    def list_objects(self, path: str) -> list[str]:
        """Every object under `path`/, as full s3:// paths (one paginated listing: 1,000 keys a request)."""
        prefix = path.rstrip("/") + "/"
        return sorted(f"s3://{p}" for p in self.fs.find(prefix) if f"s3://{p}".startswith(prefix))

    @as_oserror
    def delete_many(self, paths: list[str]) -> None:
        """Delete `paths` (objects of one bucket), DELETE_BATCH keys per DeleteObjects request; an object already gone
        is fine. Raises OSError naming the first key the server refused."""
        for i in range(0, len(paths), DELETE_BATCH):
            keys = [self.fs.split_path(p) for p in paths[i:i + DELETE_BATCH]]
            out = self.fs.call_s3("delete_objects", Bucket=keys[0][0],
                                  Delete={"Objects": [{"Key": key} for _, key, _ in keys], "Quiet": True})
            for refused in out.get("Errors", [])[:1]:
                raise OSError(f"s3://{keys[0][0]}/{refused['Key']}: not deleted ({refused.get('Code')}: "
                              f"{refused.get('Message')})")

    @as_oserror
    def delete_tree(self, path: str) -> None:
        """Every object under `path`/ (DeleteObjects: up to 1000 keys per request, the server does the work)."""
        if self.listdir(path):  # nothing there is fine (ls raises FileNotFoundError for an empty prefix)
            self.fs.rm(path, recursive=True)

    def upload_stream(self, path: str) -> PartUploadStream:
        return PartUploadStream(self.fs, path)

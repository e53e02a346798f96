"""Where checkpoint bytes go: a local folder or an object store (s3://bucket/prefix), behind the few operations
the commit protocol needs.

    python -m pytest tests/test_s3.py -q      # against a real S3-compatible server on 127.0.0.1

`storage_for(path)` picks the backend from the path. Both backends offer the same operations on full paths:
`create` (a small file, create-only: a second create of the same path raises FileExistsError, so a commit
marker is never overwritten or written twice), `read`, `exists`, `listdir` (names under a folder/prefix),
`delete`. The object store adds `etag` and `replace` (compare-and-swap on the ETag, If-Match) for the run lock.
No rename anywhere on S3: a rename there is a copy plus a delete, not atomic.

S3 goes through s3fs (fsspec), which takes credentials and endpoint the standard way: AWS_* environment
variables or the AWS config files, AWS_ENDPOINT_URL for an S3-compatible store; never the training config.
Only s3:// is known; any other scheme, or s3:// without s3fs installed, is refused by `unsupported`.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil

from torch.distributed.checkpoint import FileSystemReader

from .s3_io import ObjectStoreReader, PartUploadStream, RangeStream, as_oserror, s3_filesystem

DELETE_BATCH = 1000  # keys per DeleteObjects request, S3's maximum
_SCHEME = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*)://")
SUPPORTED_SCHEMES = ("s3",)


def scheme_of(path: str) -> str | None:
    """The URL scheme of `path` ("s3" for s3://bucket/key), None for a local path."""
    m = _SCHEME.match(str(path))
    return m.group(1).lower() if m else None


def unsupported(path: str, what: str, local_only: str = "") -> str | None:
    """Why `path` (named `what`, e.g. "config key 'ckpt.dir'") cannot be used, or None. `local_only`: this path
    must be local, and why (run.dir, the data cache). A URL is never taken for a local folder named `s3:`."""
    scheme = scheme_of(path)
    if scheme is None:
        return None
    if local_only:
        return f"{what} must be a local path, got {path!r}: {local_only}"
    if scheme not in SUPPORTED_SCHEMES:
        return f"{what}: {scheme}:// is not supported, got {path!r} (object storage: s3://bucket/prefix)"
    if not path[len("s3://"):].strip("/"):
        return f"{what}: {path!r} names no bucket (s3://bucket/prefix)"
    try:
        import s3fs  # noqa: F401 - optional third-party package, only for s3:// paths
    except ImportError:
        return f"{what}={path} needs the s3fs package, which is not installed: pip install s3fs (pinned in requirements.txt)"
    return None


def storage_for(path: str):
    """The backend holding `path`: S3Storage for s3://, else LocalStorage."""
    return S3Storage() if scheme_of(path) == "s3" else LocalStorage()


def join(path: str, *names: str) -> str:
    """os.path.join for local paths; '/' for URLs, whatever the OS."""
    if scheme_of(path) is None:
        return os.path.join(path, *names)
    return "/".join([path.rstrip("/"), *names])


class LocalStorage:
    """A POSIX folder. `create` writes a temporary file, fsyncs it and hard-links it into place: the link fails if
    the name exists (create-only) and is atomic, so a reader sees no file or the whole one."""

    def create(self, path: str, data: bytes) -> None:
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)
        finally:
            os.unlink(tmp)
        fd = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def read(self, path: str) -> bytes:
        with open(path, "rb") as f:
            return f.read()

    def open_read(self, path: str):
        return open(path, "rb")

    def size(self, path: str) -> int:
        return os.path.getsize(path)

    def dcp_reader(self, path: str):
        return FileSystemReader(path)

    def exists(self, path: str) -> bool:
        """A file (not a folder) is there."""
        return os.path.isfile(path)

    def listdir(self, path: str) -> list[str]:
        return sorted(os.listdir(path)) if os.path.isdir(path) else []

    def sizes(self, path: str) -> dict[str, int]:
        """{name: bytes} of the files (not folders) in `path`."""
        return {n: os.path.getsize(os.path.join(path, n)) for n in self.listdir(path)
                if os.path.isfile(os.path.join(path, n))}

    def delete(self, path: str) -> None:
        os.unlink(path)


def _http_status(error: OSError) -> int | None:
    """The HTTP status of the S3 answer s3fs translated into `error` (it keeps botocore's error as the cause)."""
    return getattr(error.__cause__, "response", {}).get("ResponseMetadata", {}).get("HTTPStatusCode")


class S3Storage:
    """An S3 bucket through s3fs. `create` is a PUT with If-None-Match: * (the server refuses a second one with
    412 PreconditionFailed, raised here as FileExistsError); `replace` a PUT with If-Match: <etag>."""

    def __init__(self):
        self.fs = s3_filesystem()  # no listing cache, the retry policy, the endpoint (s3_io.s3_options)

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
        """A streaming read: ranged GETs of PART_BYTES, PARALLEL_PARTS in flight ahead of the reader (s3_io.RangeStream)."""
        return RangeStream(self.fs, path, self.fs.size(path))

    @as_oserror
    def size(self, path: str) -> int:
        return self.fs.size(path)

    def dcp_reader(self, path: str):
        """DCP's reader on S3: this rank's items only, as parallel ranged GETs (s3_io.ObjectStoreReader)."""
        return ObjectStoreReader(path)

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
    def delete_prefix(self, path: str) -> None:
        """Every object under `path`/ (DeleteObjects: up to 1000 keys per request, the server does the work)."""
        if self.fs.ls(path, detail=False, refresh=True):
            self.fs.rm(path, recursive=True)

    def put_folder(self, local: str, url: str) -> None:
        """Upload every file under the folder `local` to `url`/ (each in parallel parts, s3_io.PartUploadStream),
        config.json last; on failure delete what went up, then raise."""
        names = sorted(os.path.relpath(os.path.join(d, f), local) for d, _, fs in os.walk(local) for f in fs)
        names.sort(key=lambda n: n == "config.json")
        sent: list[str] = []
        try:
            for name in names:
                target = join(url, *name.split(os.sep))
                with open(os.path.join(local, name), "rb") as src, PartUploadStream(self.fs, target) as out:
                    shutil.copyfileobj(src, out, 8 << 20)
                sent.append(target)
        except BaseException:
            with contextlib.suppress(OSError):
                self.delete_many(sent)
            raise

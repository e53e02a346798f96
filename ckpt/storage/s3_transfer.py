"""Moving checkpoint bytes to and from an object store: S3's multipart uploads with parallel parts (Azure's block
uploads reuse the buffering: ckpt/storage/azure.py), parallel ranged GETs (both stores), S3's retry policy. Below
ckpt/storage/s3.py and azure.py; s3fs is imported only when an s3:// path is used.

    python -m pytest tests/test_s3_transfer.py -q

Uploads (`PartUploadStream`, the stream DCP writes a rank's shard into): the bytes are cut into parts of
PART_BYTES and up to PARALLEL_PARTS of them go up at once from a thread pool while the next part fills, so a rank
holds at most (PARALLEL_PARTS + 1) parts of upload buffers. A file smaller than one part is one PUT. S3's limits
(parts of 5 MiB to 5 GiB, at most 10,000 per object): the part size doubles every 2,000 parts, so an object of up
to 62,000 x PART_BYTES (1.9 TiB) fits. A failed upload aborts its multipart upload: no object appears and no
parts are left to bill.
Reads (`read_ranges`): byte ranges, neighbours less than MAX_GAP apart merged, cut into pieces of at most
PART_BYTES, fetched PARALLEL_PARTS at a time ahead of the consumer: `S3Reader` (ckpt/storage/s3.py: DCP's load of
this rank's items only) and `RangeStream` (one whole file front to back, for hashing).
Retries: every request goes through botocore's standard retry mode, MAX_ATTEMPTS attempts per request (a part,
not a file), exponential backoff with jitter (up to 20 s when S3 throttles with SlowDown), unless the standard
AWS_MAX_ATTEMPTS / AWS_RETRY_MODE variables say otherwise; s3fs also retries a GET whose body is cut off. When the
attempts are spent the error goes up as one OSError naming the object, and the save fails like any other
(errors.py): committed checkpoints are untouched.
"""

from __future__ import annotations

import functools
import io
import os
from collections import deque
from concurrent.futures import ThreadPoolExecutor


try:
    from botocore.exceptions import BotoCoreError, ClientError  # come with s3fs
except ImportError:  # no s3fs: s3:// paths are refused (ckpt.storage.unsupported), so nothing raises them
    BotoCoreError = ClientError = ()

PART_BYTES = 32 << 20  # the first 2,000 parts of an object; S3: >= 5 MiB (but the last), <= 5 GiB
PARALLEL_PARTS = 8  # requests in flight per stream: upload parts of one file, or GETs of one rank's reads
MAX_ATTEMPTS = 5  # per request, botocore's standard retry mode (its default is 3)
MAX_GAP = 1 << 20  # read the bytes between two wanted ranges of one file rather than make two requests
_PARTS_PER_SIZE = 2_000  # then the part size doubles: 5 sizes x 2,000 parts = S3's 10,000


def s3_options() -> dict:
    """The S3FileSystem arguments every s3:// access here uses: no listing cache (a listing must show what another
    rank or job just wrote or deleted), the retry policy above, enough connections for PARALLEL_PARTS per stream,
    and the endpoint passed on (s3fs reads AWS_ENDPOINT_URL too, but fsspec caches instances by their arguments,
    so one made for another endpoint would come back)."""
    config = {"max_pool_connections": 4 * PARALLEL_PARTS}
    if not {"AWS_MAX_ATTEMPTS", "AWS_RETRY_MODE"} & set(os.environ):
        config["retries"] = {"mode": "standard", "total_max_attempts": MAX_ATTEMPTS}
    endpoint = {"endpoint_url": os.environ["AWS_ENDPOINT_URL"]} if os.environ.get("AWS_ENDPOINT_URL") else {}
    return {"use_listings_cache": False, "config_kwargs": config, **endpoint}


def s3_filesystem():
    import s3fs  # optional third-party package, only for s3:// paths

    return s3fs.S3FileSystem(**s3_options())


def as_oserror(method):
    """botocore's own errors (endpoint unreachable, no credentials) raised as ConnectionError, an OSError, so every
    caller's `except OSError` (one-line errors, save failures) covers an object store as it covers a disk."""
    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        try:
            return method(*args, **kwargs)
        except BotoCoreError as e:
            raise ConnectionError(str(e)) from e
    return wrapper


def call_once(fs, method: str, what: str, **kwargs) -> dict:
    """One S3 request on `fs`'s client, with botocore's retries only (not s3fs's loop on top, which would multiply
    the attempts). Errors as OSError naming `what`: PermissionError, FileNotFoundError (s3fs's mapping of the
    codes), ConnectionError, else OSError with botocore's words (code, operation, retries spent, message)."""
    from fsspec.asyn import sync
    from s3fs.errors import translate_boto_error

    async def request():
        await fs.set_session()
        return await getattr(await fs.get_s3(kwargs.get("Bucket")), method)(**kwargs)
    try:
        return sync(fs.loop, request)
    except ClientError as e:
        raise type(translate_boto_error(e, set_cause=False))(f"{what}: {e}") from e
    except BotoCoreError as e:
        raise ConnectionError(f"{what}: {e}") from e


def part_size(number: int, base: int = PART_BYTES) -> int:
    """Bytes of part `number` (1-based): `base`, doubled every 2,000 parts."""
    return base << min(4, (number - 1) // _PARTS_PER_SIZE)


class PartUploadStream:
    """A write-only stream into one S3 object (a subclass: one Azure block blob). `tell()` counts the bytes written (DCP records offsets with it).
    close() completes the upload; abort() (or an exception inside `with`) cancels it, leaving no object."""

    def __init__(self, fs, path: str, part_bytes: int = 0, parallel: int = 0):
        self.fs, self.path = fs, path
        self.bucket, self.key, _ = fs.split_path(path)
        self.part_bytes, self.parallel = part_bytes or PART_BYTES, parallel or PARALLEL_PARTS
        self._buf, self._written, self._closed = bytearray(), 0, False
        self._upload_id: str | None = None
        self._parts: list = []  # one future (the part's ETag) per part sent, in part order
        self._inflight: deque = deque()
        self._pool: ThreadPoolExecutor | None = None

    def write(self, data) -> int:
        view = memoryview(data)
        view = view if view.format == "B" and view.ndim == 1 else view.cast("B")
        n = len(view)
        while view:
            room = part_size(len(self._parts) + 1, self.part_bytes) - len(self._buf)
            self._buf += view[:room]
            view = view[room:]
            if len(self._buf) == part_size(len(self._parts) + 1, self.part_bytes):
                self._send_part()
        self._written += n
        return n

    def tell(self) -> int:
        return self._written

    def flush(self) -> None:
        pass  # parts go up when full; the rest at close()

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def _send_part(self) -> None:
        if self._pool is None:
            self._begin()
            self._pool = ThreadPoolExecutor(self.parallel, thread_name_prefix="ckpt-upload-part")
        while len(self._inflight) >= self.parallel:  # bounded memory: wait for the oldest part in flight
            self._inflight.popleft().result()
        body, self._buf = self._buf, bytearray()
        number = len(self._parts) + 1
        future = self._pool.submit(self._upload_part, number, body)
        self._parts.append(future)
        self._inflight.append(future)

    # The five requests of an upload; a store with another protocol (Azure's blocks: azure.py) overrides them.
    def _begin(self) -> None:
        self._upload_id = call_once(self.fs, "create_multipart_upload", self.path, Bucket=self.bucket,
                                    Key=self.key)["UploadId"]

    def _upload_part(self, number: int, body: bytearray) -> str:
        return call_once(self.fs, "upload_part", f"{self.path} part {number}", Bucket=self.bucket, Key=self.key,
                         PartNumber=number, UploadId=self._upload_id, Body=body)["ETag"]

    def _put_whole(self, body: bytes) -> None:
        call_once(self.fs, "put_object", self.path, Bucket=self.bucket, Key=self.key, Body=body)

    def _complete(self, tags: list[str]) -> None:
        parts = [{"PartNumber": i + 1, "ETag": tag} for i, tag in enumerate(tags)]
        call_once(self.fs, "complete_multipart_upload", self.path, Bucket=self.bucket, Key=self.key,
                  UploadId=self._upload_id, MultipartUpload={"Parts": parts})

    def _cancel(self) -> None:
        call_once(self.fs, "abort_multipart_upload", self.path, Bucket=self.bucket, Key=self.key,
                  UploadId=self._upload_id)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._pool is None:  # smaller than one part (or empty): one PUT
            self._put_whole(bytes(self._buf))
            return
        try:
            if self._buf:
                self._send_part()  # the last part may be smaller than 5 MiB
            self._complete([f.result() for f in self._parts])
        except BaseException:
            self._closed = False
            self.abort()
            raise
        self._pool.shutdown()

    def abort(self) -> None:
        """Stop sending parts and abort the multipart upload (best effort: S3's lifecycle rule for incomplete
        multipart uploads, if the bucket has one, removes what an unreachable server kept)."""
        if self._closed:
            return
        self._closed = True
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            try:
                self._cancel()
            except OSError:
                pass  # the save's own error is the one to report

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


# ---------------------------------------------------------------- reads

def _pieces(path: str, start: int, end: int, part: int) -> list[tuple[str, int, int]]:
    return [(path, a, min(a + part, end)) for a in range(start, end, part)]


def merge_spans(ranges: list[tuple[str, int, int]], max_gap: int = MAX_GAP) -> list[tuple[str, int, int]]:
    """(path, start, end) ranges sorted by path and start -> the spans to fetch: neighbours in one file less than
    `max_gap` apart (or overlapping) joined."""
    spans: list[list] = []
    for path, start, end in ranges:
        if spans and spans[-1][0] == path and start - spans[-1][2] <= max_gap:
            spans[-1][2] = max(spans[-1][2], end)
        else:
            spans.append([path, start, end])
    return [tuple(s) for s in spans]


@as_oserror
def _get(fs, path: str, start: int, end: int) -> bytes:
    return fs.cat_file(path, start=start, end=end)


def fetch_in_order(fs, pieces: list[tuple[str, int, int]], parallel: int = PARALLEL_PARTS):
    """The bytes of each (path, start, end) of `pieces`, in order, `parallel` ranged GETs in flight ahead."""
    todo = iter(pieces)
    with ThreadPoolExecutor(parallel, thread_name_prefix="ckpt-get") as pool:
        inflight = deque(pool.submit(_get, fs, *p) for _, p in zip(range(parallel), todo))
        while inflight:
            data = inflight.popleft().result()
            nxt = next(todo, None)
            if nxt is not None:
                inflight.append(pool.submit(_get, fs, *nxt))
            yield data


def read_ranges(fs, ranges: list[tuple[str, int, int]], part: int = PART_BYTES, parallel: int = PARALLEL_PARTS):
    """The bytes of each (path, start, end) of `ranges` (sorted by path and start), in order: fetched as merged
    spans cut into pieces of at most `part` bytes, `parallel` at a time. Holds the pieces of the range being
    assembled plus those in flight, never a whole file."""
    pieces = [p for span in merge_spans(ranges) for p in _pieces(*span, part)]
    fetched = zip(pieces, fetch_in_order(fs, pieces, parallel))
    held: deque = deque()  # ((path, start, end), bytes) fetched and still needed
    for path, start, end in ranges:
        while held and (held[0][0][0] != path or held[0][0][2] <= start):
            held.popleft()  # pieces of earlier files, or before this range: no later range needs them
        while end > start and not (held and held[-1][0][0] == path and held[-1][0][2] >= end):
            held.append(next(fetched))
        yield b"".join(memoryview(data)[max(s, start) - s: min(e, end) - s]
                       for (p, s, e), data in held if p == path and s < end and e > start)


class RangeStream(io.RawIOBase):
    """One object read front to back (hashing: checksum.file_digest) through read_ranges: PARALLEL_PARTS GETs
    ahead of the reader."""

    def __init__(self, fs, path: str, size: int, part: int = PART_BYTES):
        super().__init__()
        self._chunks = read_ranges(fs, _pieces(path, 0, size, part), part)
        self._left = b""

    def readable(self) -> bool:
        return True

    def read(self, n: int = -1) -> bytes:
        while not self._left:
            self._left = next(self._chunks, b"")
            if not self._left:
                return b""
        out = self._left if n < 0 else self._left[:n]
        self._left = self._left[len(out):]
        return out

    def close(self) -> None:
        self._chunks.close()
        super().close()

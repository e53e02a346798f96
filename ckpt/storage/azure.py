"""Azure Blob Storage (az://container/prefix) as a storage backend (the contract: ckpt/storage/base.py), through the
Azure SDK (azure-storage-blob), and DCP's writer file system and reader on it.

    python -m pytest tests/test_storage_backends.py tests/test_s3.py -q -k az   # against Azurite, the emulator

Atomic on Blob Storage: a block blob appears whole or not at all when its Put Blob, or the Put Block List that
commits its staged blocks, returns. `create` is a Put Blob with If-None-Match: * (the service refuses a second one
with 409 BlobAlreadyExists, raised as FileExistsError); `replace` one with If-Match: <etag> (412
ConditionNotMet: FileExistsError; compare-and-swap, for the run lock: ObjectLock). A file DCP writes goes up as
blocks (Put Block, the part sizes of s3_transfer.py, PARALLEL_PARTS in flight), made visible by one Put Block List
at close; a failed write never commits its list, so no blob appears (the service drops uncommitted blocks after
seven days). No rename: retention as on S3 (the marker first, then the sweep deletes the blobs, every rank a share,
in batch requests of DELETE_BATCH); reads as on S3 (s3_transfer.read_ranges: parallel ranged GETs).

Credentials the standard way, from the environment (never the training config): AZURE_STORAGE_CONNECTION_STRING
(Azurite's too), or AZURE_STORAGE_ACCOUNT_NAME with AZURE_STORAGE_ACCOUNT_KEY or AZURE_STORAGE_SAS_TOKEN, the
variables adlfs (fsspec's Azure file system) reads. Retries: MAX_ATTEMPTS attempts per request (4 for a refused
connection), about 3, 5 and 9 s apart (an unreachable endpoint is reported after about 20 s); the SDK's own
default (waits from 15 s, growing by powers of 3) would hold that error line for about a minute per request.
CKPT_AZURE_MAX_ATTEMPTS=n sets the attempts (the SDK has no variable for it; AWS_MAX_ATTEMPTS is S3's): the tests
set 1 where an unreachable endpoint is the point, so they do not wait out the retries.
"""

from __future__ import annotations

import functools
import io
import os
import re
import urllib.parse
import uuid
from contextlib import contextmanager

from torch.distributed.checkpoint.filesystem import FileSystemBase, FileSystemReader

from .base import ItemLoader, Storage
from .lock import ObjectLock
from .s3 import S3Reader
from .s3_transfer import MAX_ATTEMPTS, PARALLEL_PARTS, PartUploadStream, RangeStream

try:  # the SDK comes with azure-storage-blob; without it az:// paths are refused (ckpt.storage.unsupported)
    import requests
    from azure.core import MatchConditions
    from azure.core.exceptions import (AzureError, ClientAuthenticationError, ResourceExistsError,
                                       ResourceModifiedError, ResourceNotFoundError, ServiceRequestError,
                                       ServiceResponseError)
    from azure.core.pipeline.transport import RequestsTransport
    from azure.storage.blob import BlobPrefix, BlobServiceClient, ExponentialRetry
except ImportError:
    AzureError = ()

DELETE_BATCH = 256  # blobs per batch delete request, Blob Storage's maximum
CREDENTIALS = ("set AZURE_STORAGE_CONNECTION_STRING, or AZURE_STORAGE_ACCOUNT_NAME with AZURE_STORAGE_ACCOUNT_KEY "
               "or AZURE_STORAGE_SAS_TOKEN")
_ENV = ("AZURE_STORAGE_CONNECTION_STRING", "AZURE_STORAGE_ACCOUNT_NAME", "AZURE_STORAGE_ACCOUNT_KEY",
        "AZURE_STORAGE_SAS_TOKEN")
ATTEMPTS_ENV = "CKPT_AZURE_MAX_ATTEMPTS"  # attempts per request instead of MAX_ATTEMPTS (tests: 1)


def blob_service() -> BlobServiceClient:
    """The account's client, from the environment; one per process and environment (a forked uploader makes its
    own: a client holds sockets)."""
    attempts = int(os.environ.get(ATTEMPTS_ENV) or MAX_ATTEMPTS)
    return _client(os.getpid(), attempts, *(os.environ.get(k) or None for k in _ENV))


@functools.cache
def _client(pid: int, attempts: int, connection: str | None, account: str | None, key: str | None,
            sas: str | None):
    session = requests.Session()  # enough pooled connections for PARALLEL_PARTS per stream, as on S3
    for scheme in ("http://", "https://"):
        session.mount(scheme, requests.adapters.HTTPAdapter(pool_maxsize=4 * PARALLEL_PARTS))
    options = {"retry_policy": ExponentialRetry(initial_backoff=1, increment_base=2, retry_total=attempts - 1),
               "connection_timeout": 20, "transport": RequestsTransport(session=session, session_owner=False)}
    if connection:
        try:
            return BlobServiceClient.from_connection_string(connection, **options)
        except ValueError as e:
            raise PermissionError(f"AZURE_STORAGE_CONNECTION_STRING: {e}") from None
    if not (account and (key or sas)):
        raise PermissionError(f"no Azure credentials in the environment: {CREDENTIALS}")
    credential = {"account_name": account, "account_key": key} if key else sas
    return BlobServiceClient(f"https://{account}.blob.core.windows.net", credential=credential, **options)


def _oserror(e: Exception, what: str, endpoint: str) -> OSError:
    """An SDK error as the OSError a disk would raise, on one line: FileNotFoundError, FileExistsError (a
    condition refused), PermissionError, ConnectionError naming the endpoint."""
    line = str(getattr(e, "message", None) or e).splitlines()[0]
    if isinstance(e, (ServiceRequestError, ServiceResponseError)):  # no connection, or one cut off
        reason = re.search(r"\[Errno -?\d+\][^\"')]*", line)
        return ConnectionError(f"Could not connect to the endpoint URL {endpoint} ({reason[0] if reason else line})")
    if isinstance(e, ResourceNotFoundError):
        return FileNotFoundError(f"{what}: {line}")
    if isinstance(e, (ResourceExistsError, ResourceModifiedError)):
        return FileExistsError(f"{what}: changed or created by someone else (conditional write refused)")
    if isinstance(e, ClientAuthenticationError) or getattr(e, "status_code", None) == 403:  # 403: e.g. read-only SAS
        return PermissionError(f"{what}: {line} (credentials: {CREDENTIALS})")
    return OSError(f"{what}: {line}")


def as_oserror(method):
    """The SDK's errors raised as OSError (_oserror), so every caller's `except OSError` (one-line errors, save
    failures) covers Blob Storage as it covers a disk."""
    @functools.wraps(method)
    def wrapper(self, path, *args, **kwargs):
        try:
            return method(self, path, *args, **kwargs)
        except AzureError as e:
            raise _oserror(e, path if isinstance(path, str) else f"{len(path)} blobs", self.endpoint) from e
    return wrapper


class BlockUploadStream(PartUploadStream):
    """A write-only stream into one block blob: PartUploadStream's buffering and parallel parts, each part a block
    (Put Block), all made visible by one Put Block List at close(). A failed or aborted upload commits no list: no
    blob appears. Blob limits (a block <= 4,000 MiB, <= 50,000 blocks) hold for s3_transfer's part sizes."""

    def _begin(self) -> None:
        self._upload = uuid.uuid4().hex  # block ids of one blob have one length

    def _upload_part(self, number: int, body: bytearray) -> str:
        block = f"{self._upload}-{number:06d}"
        self.fs.stage_block(self.path, block, body)
        return block

    def _put_whole(self, body: bytes) -> None:
        self.fs.put(self.path, body)

    def _complete(self, tags: list[str]) -> None:
        self.fs.commit_blocks(self.path, tags)

    def _cancel(self) -> None:
        """Nothing to abort: staged blocks are invisible, and the service drops them."""


class AzureFileSystem(FileSystemBase):
    """DCP's FileSystem on Blob Storage: each file it writes a BlockUploadStream (DCP closes it inside the context:
    close() commits the block list, base.py's contract; an exception inside aborts it), and .metadata read whole."""

    def init_path(self, path, **kwargs):
        self.fs = AzureStorage()
        return str(path).rstrip("/")

    @contextmanager
    def create_stream(self, path, mode: str):
        if "w" not in mode:
            yield io.BytesIO(self.fs.read(str(path)))
            return
        with BlockUploadStream(self.fs, str(path)) as stream:
            yield stream

    def concat_path(self, path, suffix: str) -> str:
        return f"{str(path).rstrip('/')}/{suffix}"

    def rename(self, path, new_path) -> None:
        raise OSError(f"{path}: Blob Storage has no rename (a copy plus a delete, not atomic)")

    def mkdir(self, path) -> None:
        pass  # a prefix is no folder: nothing to make

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return str(checkpoint_id).startswith("az://")

    def exists(self, path) -> bool:
        return self.fs.exists(str(path))

    def rm_file(self, path) -> None:
        self.fs.delete(str(path))


class AzureReader(ItemLoader, FileSystemReader):
    """DCP's reader on Blob Storage: a rank reads only the byte ranges of its items, as parallel ranged GETs, the
    same way as on S3 (S3Reader.read_data, through AzureStorage.cat_file)."""

    def __init__(self, path: str):
        super().__init__(path)
        self.fs = AzureFileSystem()
        self.path = self.fs.init_path(path)

    read_data = S3Reader.read_data


class AzureStorage(Storage):
    """A Blob Storage container through the Azure SDK. `create` is a Put Blob with If-None-Match: * (refused:
    FileExistsError); `replace` one with If-Match: <etag>."""

    compare_and_swap = True
    lock_class = ObjectLock
    reader_class = AzureReader
    bucket_word = "container"
    create_words = "a second Put Blob with If-None-Match: *"
    swap_words = "a Put Blob with If-Match on a stale ETag"

    @property
    def endpoint(self) -> str:
        """The account's URL for error lines, without its query: the SDK's url carries a SAS token (a secret)."""
        return urllib.parse.urlsplit(blob_service().url)._replace(query="").geturl()

    def location(self, path: str) -> str:
        """The account's endpoint and the container, e.g. http://127.0.0.1:10000/devstoreaccount1 (az://ckpt)."""
        return f"{self.endpoint.rstrip('/')} ({super().location(path)})"

    @staticmethod
    def split_path(path: str) -> tuple[str, str, None]:
        """(container, blob name, no version) of az://container/name."""
        container, _, name = path.removeprefix("az://").partition("/")
        return container, name, None

    def _blob(self, path: str):
        container, name, _ = self.split_path(path)
        return blob_service().get_blob_client(container, name)

    def _container(self, path: str):
        return blob_service().get_container_client(self.split_path(path)[0])

    @as_oserror
    def create(self, path: str, data: bytes) -> str:
        """Create-only; returns the new blob's ETag."""
        return self._blob(path).upload_blob(data, overwrite=False)["etag"]

    @as_oserror
    def replace(self, path: str, data: bytes, etag: str) -> str:
        """Overwrite only if the blob still has `etag`; returns the new ETag, FileExistsError otherwise."""
        return self._blob(path).upload_blob(data, overwrite=True, etag=etag,
                                            match_condition=MatchConditions.IfNotModified)["etag"]

    @as_oserror
    def put(self, path: str, data: bytes) -> None:
        self._blob(path).upload_blob(data, overwrite=True)

    @as_oserror
    def stage_block(self, path: str, block: str, data: bytes) -> None:
        self._blob(path).stage_block(block, bytes(data))

    @as_oserror
    def commit_blocks(self, path: str, blocks: list[str]) -> None:
        self._blob(path).commit_block_list(blocks)

    @as_oserror
    def etag(self, path: str) -> str:
        return self._blob(path).get_blob_properties().etag

    @as_oserror
    def read(self, path: str) -> bytes:
        return self._blob(path).download_blob().readall()

    @as_oserror
    def cat_file(self, path: str, start: int | None = None, end: int | None = None) -> bytes:
        """Bytes [start, end) of a blob (fsspec's name: s3_transfer.read_ranges calls it)."""
        start = start or 0
        length = None if end is None else end - start
        return self._blob(path).download_blob(offset=start, length=length).readall()

    def open_read(self, path: str):
        """A streaming read: ranged GETs of PART_BYTES, PARALLEL_PARTS in flight (s3_transfer.RangeStream)."""
        return RangeStream(self, path, self.size(path))

    @as_oserror
    def size(self, path: str) -> int:
        return self._blob(path).get_blob_properties().size

    def writer_filesystem(self, folder_fs=None):
        """`folder_fs` is for folders (files written through a descriptor); a blob is written by its block list."""
        return AzureFileSystem()

    def upload_stream(self, path: str) -> BlockUploadStream:
        return BlockUploadStream(self, path)

    @as_oserror
    def exists(self, path: str) -> bool:
        """A blob (not a prefix) is there."""
        return self._blob(path).exists()

    def _walk(self, path: str):
        """What is right under `path`/: blobs and prefixes (one listing; nothing if the container is missing)."""
        container, name, _ = self.split_path(path.rstrip("/"))
        try:
            return list(self._container(path).walk_blobs(name_starts_with=f"{name}/" if name else "", delimiter="/"))
        except ResourceNotFoundError:
            return []

    @as_oserror
    def listdir(self, path: str) -> list[str]:
        return sorted(item.name.rstrip("/").rsplit("/", 1)[-1] for item in self._walk(path))

    list_folders = listdir  # a prefix is a folder

    @as_oserror
    def sizes(self, path: str) -> dict[str, int]:
        """{name: bytes} of the blobs right under `path`/ (one listing)."""
        return {b.name.rsplit("/", 1)[-1]: b.size for b in self._walk(path) if not isinstance(b, BlobPrefix)}

    @as_oserror
    def delete(self, path: str) -> None:
        self._blob(path).delete_blob()

    @as_oserror
    def list_objects(self, path: str) -> list[str]:
        """Every blob under `path`/, as full az:// paths (one paginated listing)."""
        container, name, _ = self.split_path(path.rstrip("/"))
        try:
            names = self._container(path).list_blob_names(name_starts_with=f"{name}/" if name else "")
            return sorted(f"az://{container}/{n}" for n in names)
        except ResourceNotFoundError:
            return []

    @as_oserror
    def delete_many(self, paths: list[str]) -> None:
        """Delete `paths` (blobs of one container), DELETE_BATCH per batch request; a blob already gone is fine.
        Raises OSError naming the first blob the service refused."""
        for i in range(0, len(paths), DELETE_BATCH):
            names = [self.split_path(p)[1] for p in paths[i:i + DELETE_BATCH]]
            answers = self._container(paths[i]).delete_blobs(*names, raise_on_any_failure=False)
            for name, answer in zip(names, answers):
                if answer.status_code >= 300 and answer.status_code != 404:
                    raise OSError(f"az://{self.split_path(paths[i])[0]}/{name}: not deleted "
                                  f"(HTTP {answer.status_code}: {answer.reason})")

    def delete_tree(self, path: str) -> None:
        """Every blob under `path`/ (nothing there is fine)."""
        self.delete_many(self.list_objects(path))


"""A local (POSIX) folder as a storage backend (the contract: ckpt/storage/base.py). Atomic here means a rename or
a hard link in one folder, made durable with fsync of the file and then of its folder.

    python -m pytest tests/test_storage_backends.py tests/test_retention.py -q

Retention moves a retired checkpoint into <ckpt.dir>/.trash (`retire`): the commit marker is removed first and
made durable, then the folder is renamed (O(1) on one filesystem), so a crash at any moment leaves an unmarked
folder or one in .trash, never a marked partial one; .trash is never listed as a checkpoint. The sweep lists
.trash, names only (`sweep_list`), each rank deletes every W-th file (`sweep_share`), and rank 0 removes what is
left (`sweep_finish`). A sweep killed halfway leaves files in .trash for the next one.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from typing import Callable

from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.futures import Future

from .base import ItemLoader, Storage
from .lock import DirLock

TRASH_DIR = ".trash"


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_tmp(path: str, data: bytes) -> str:
    """`data` in a durable temporary file beside `path`; returns its name. A failed write (a full disk) leaves none."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return tmp


def trash_dir(ckpt_dir: str) -> str:
    return os.path.join(ckpt_dir, TRASH_DIR)


def trash_slot(path: str) -> str:
    """A fresh place in its ckpt.dir's .trash for `path`: not a step-NNNNNN name, and not taken (a rename onto
    an empty folder would replace it silently)."""
    parent, name = os.path.split(os.path.normpath(path))
    return os.path.join(trash_dir(parent), f"{name}.{os.getpid()}-{time.time_ns()}")


class LocalReader(ItemLoader, FileSystemReader):
    """DCP's FileSystemReader: the same file walk, slices and transforms as its read_data (torch 2.13), each item
    handed over by `load_item` (base.ItemLoader), so a reader variant overrides that one method on every backend."""

    def read_data(self, plan, planner) -> Future:
        per_file: dict[str, list] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for relative_path, items in per_file.items():
            with self.fs.create_stream(self.fs.concat_path(self.path, relative_path), "rb") as stream:
                for item in items:
                    info = self.storage_data[item.storage_index]
                    self.load_item(item, self.transforms.transform_load_stream(
                        item, info.transform_descriptors or (), self._slice_file(stream, info)), planner)
        done: Future = Future()
        done.set_result(None)
        return done


class LocalStorage(Storage):
    """A POSIX folder. `create` writes a temporary file, fsyncs it and hard-links it into place: the link fails if
    the name exists (create-only) and is atomic, so a reader sees no file or the whole one."""

    atomic_rename = True
    sync_files = True  # DCP fsyncs each file, then the marker's folder is fsynced before the marker is written
    partial_writes = True  # a file is visible while it is written; only the marker makes a checkpoint
    reader_class = LocalReader
    lock_class = DirLock
    has_folders = True
    missing = "not a directory"

    join = staticmethod(os.path.join)
    spelling = staticmethod(os.path.abspath)

    def create(self, path: str, data: bytes) -> None:
        tmp = _write_tmp(path, data)
        try:
            os.link(tmp, path)
        finally:
            os.unlink(tmp)
        fsync_dir(os.path.dirname(path) or ".")

    def publish(self, path: str, data: bytes) -> None:
        """The files' directory entries are made durable before the marker can be; then tmp + fsync + rename +
        fsync(dir): readers see the old file or the whole new one, never half."""
        fsync_dir(os.path.dirname(path) or ".")
        os.replace(_write_tmp(path, data), path)
        fsync_dir(os.path.dirname(path) or ".")

    def read(self, path: str) -> bytes:
        with open(path, "rb") as f:
            return f.read()

    def open_read(self, path: str):
        return open(path, "rb")

    def size(self, path: str) -> int:
        return os.path.getsize(path)

    def exists(self, path: str) -> bool:
        """A file (not a folder) is there."""
        return os.path.isfile(path)

    def is_folder(self, path: str) -> bool:
        return os.path.isdir(path)

    def occupied(self, path: str) -> bool:
        return os.path.lexists(path)

    def listdir(self, path: str) -> list[str]:
        return sorted(os.listdir(path)) if os.path.isdir(path) else []

    def list_folders(self, path: str) -> list[str]:
        """Names of the folders right under `path`."""
        return [n for n in self.listdir(path) if os.path.isdir(os.path.join(path, n))]

    def sizes(self, path: str) -> dict[str, int]:
        """{name: bytes} of the files (not folders) in `path`: one listing and one stat per file ({} if no folder)."""
        try:
            with os.scandir(path) as entries:
                return {e.name: e.stat().st_size for e in entries if e.is_file()}
        except (FileNotFoundError, NotADirectoryError):
            return {}

    def delete(self, path: str) -> None:
        os.unlink(path)

    def delete_many(self, paths: list[str]) -> None:
        """Never raises: a file already gone is fine, one that cannot be deleted is left to `delete_tree`."""
        for path in paths:
            with contextlib.suppress(OSError):
                os.remove(path)

    def delete_tree(self, path: str) -> None:
        if os.path.lexists(path):  # nothing there is fine
            shutil.rmtree(path)

    def prepare_folder(self, path: str) -> None:
        os.makedirs(path)

    def writer_filesystem(self, folder_fs: type[FileSystem] | None = None) -> FileSystem:
        return (folder_fs or FileSystem)()

    def retire(self, path: str, marker: str) -> None:
        """Marker first, made durable, then the rename into .trash: no crash leaves a marked folder with files
        missing. Anything may stand where a file or folder belongs (a folder named commit.json, a file named
        step-N); a folder named commit.json is no marker, so it just moves along."""
        marker_path = os.path.join(path, marker)
        if os.path.isdir(path) and not os.path.islink(path) and (os.path.islink(marker_path)
                                                                  or not os.path.isdir(marker_path)):
            with contextlib.suppress(FileNotFoundError):
                os.remove(marker_path)
            with contextlib.suppress(OSError):
                fsync_dir(path)
        os.makedirs(trash_dir(os.path.dirname(os.path.normpath(path))), exist_ok=True)
        os.rename(path, trash_slot(path))

    def retire_failed(self, path: str, error: OSError, on_log: Callable[[str], None]) -> None:
        """A folder that cannot be renamed is deleted here instead (correct, but rank 0 alone pays for it)."""
        on_log(f"retention: cannot move {path} into .trash ({error.strerror}); deleting it in place")
        shutil.rmtree(path, ignore_errors=True)

    def sweep_list(self, root: str, retired: list[str]) -> list[str] | None:
        """Every file (and link) under .trash, full paths, sorted; None when there is no .trash. Names only:
        scandir's entry type says file or folder without a stat per file (on Lustre, no metadata-server load per
        file). All of .trash, not just `retired`: what a killed sweep left goes too."""
        top = trash_dir(root)
        if not os.path.isdir(top):
            return None
        files, todo = [], [top]
        while todo:
            folder = todo.pop()
            try:
                with os.scandir(folder) as entries:
                    for e in entries:
                        (todo if e.is_dir(follow_symlinks=False) else files).append(os.path.join(folder, e.name))
            except OSError:
                continue  # an unreadable folder: rank 0's last pass tries it and says what it could not delete
        return sorted(files)

    def sweep_finish(self, root: str, retired: list[str], on_log: Callable[[str], None]) -> None:
        top = trash_dir(root)
        shutil.rmtree(top, ignore_errors=True)
        if os.path.lexists(top):
            on_log(f"warning: retention: could not delete everything in {top}; delete it by hand to free the space")

    def clear_stale(self, path: str, marker: str, on_log: Callable[[str], None]) -> bool:
        """Into .trash; True if it went there (the caller sweeps it before writing, to free the space). If even the
        rename fails (a directory without write permission cannot change its parent), it is moved aside in place."""
        try:
            self.retire(path, marker)
            on_log(f"checkpoint: moved {path} (a leftover of an earlier attempt) into .trash")
            return True
        except OSError:
            aside = f"{path}.damaged-{os.getpid()}-{int(time.time())}"
            os.replace(path, aside)
            on_log(f"checkpoint: moved damaged {path} aside to {aside}")
            return False

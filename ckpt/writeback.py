"""Checkpoint files written to a local disk at the disk's speed: bounded writes, and writeback started as they go.

    python bench/ckpt_bench.py --hidden 256 --layers 2 --saves 3 --train-steps 0   # disk rate vs each save method

DCP writes a rank's file tensor by tensor (torch.save hands each tensor's bytes over in one piece) and fsyncs it
at the end. On this project's VM (2 cores, virtio disk), in interleaved side-by-side rounds:
- one huge write (a 272 MB Qwen2.5-0.5B embedding shard) followed by fsync ran at about a third of the rate of the
  same bytes in 8 MiB writes; so no write here is larger than WRITE_BYTES;
- the page cache holds what was written until the fsync, which then flushes it all while nothing else is written:
  copying and flushing take turns (dd with conv=fdatasync does the same). Asking the kernel to start writing back
  every WRITEBACK_BYTES (posix_fadvise DONTNEED on the bytes just written: writeback starts, nothing waits for
  it) overlaps the two, and plain 8 MiB writes went from below dd's rate to about it.
bench/ckpt_bench.py measures each save method against the disk's own rate in the same run (its `disk` rows).
Used for local files only (an object store's stream has no file descriptor; its PUT is the write).

InPlaceFileSystem writes over a file that is already there instead of replacing it: the memory tier's steps go to
tmpfs, where allocating a new file's pages (and freeing the old one's) costs more than copying the bytes into
pages already there, so the next step reuses a superseded step's files (ckpt/memory_tier/replicate.py, the spare folder).
"""

from __future__ import annotations

import os
from contextlib import contextmanager

from torch.distributed.checkpoint.filesystem import FileSystem

WRITE_BYTES = 8 << 20
WRITEBACK_BYTES = 64 << 20


class WritebackFileSystem(FileSystem):
    """DCP's local FileSystem whose write streams write in pieces of at most WRITE_BYTES and start the writeback of
    every WRITEBACK_BYTES written. Module level: it pickles into the process-mode uploader with the writer."""

    @contextmanager
    def create_stream(self, path, mode):
        with super().create_stream(path, mode) as stream:
            yield _WritebackStream(stream) if "w" in mode else stream


class _WritebackStream:
    def __init__(self, stream):
        self._stream, self._written, self._flushed_to = stream, 0, 0

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        for start in range(0, view.nbytes, WRITE_BYTES):
            self._written += self._stream.write(view[start:start + WRITE_BYTES])  # a buffered file writes it all
            if self._written - self._flushed_to >= WRITEBACK_BYTES:
                self._start_writeback()
        return view.nbytes

    def _start_writeback(self) -> None:
        self._stream.flush()  # the file object's buffer into the page cache, so the range is the kernel's
        os.posix_fadvise(self._stream.fileno(), self._flushed_to, self._written - self._flushed_to,
                         os.POSIX_FADV_DONTNEED)
        self._flushed_to = self._written

    def __getattr__(self, name):  # tell, fileno, flush, close: the real file's
        return getattr(self._stream, name)


def open_in_place(path: str):
    """`path` for writing from its start, over the pages it already has if it exists (then the caller truncates it
    where the writing ended)."""
    return open(path, "r+b" if os.path.isfile(path) else "wb")


class InPlaceFileSystem(WritebackFileSystem):
    """WritebackFileSystem whose written files overwrite an existing file's pages, cut to the bytes written."""

    @contextmanager
    def create_stream(self, path, mode):
        if mode != "wb":
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with open_in_place(path) as f:
            stream = _InPlaceStream(f)
            yield stream
            stream.close()


class _InPlaceStream(_WritebackStream):
    def close(self) -> None:
        """Cut the file where the writing ended (the file written over may have been longer), then close it.
        DCP's writer closes the stream itself, before the stream's context exits."""
        if not self._stream.closed:
            self._stream.truncate()
        self._stream.close()

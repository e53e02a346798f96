"""One job per ckpt.dir: an flock on <ckpt.dir>/.lock, and a record in it of who holds it and since when.

    python -m pytest tests/test_ckpt_unit.py -q -k lock

`lock_for_job` is what a job calls: rank 0 takes the lock, and every rank raises rank 0's refusal.

The record is one JSON line, {"host", "pid", "started", "heartbeat"}, rewritten in place every
HEARTBEAT_S by a thread of the holder (in place: a rename would make a new file and drop the flock).
- flock works (local disks, most parallel file systems): it dies with its holder, so a held lock means
  a live job. If the holder's heartbeat is older than STALE_S anyway (a dead host whose lock the
  file server keeps), the refusal says so and what to do.
- flock unsupported (ENOSYS / ENOLCK / EOPNOTSUPP: Lustre mounted `noflock`, some NFS): one warning
  line, and the record decides: a fresh heartbeat refuses; a stale one, or a dead pid on this host,
  is a dead job's lock and is taken over with a warning naming it.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
import threading
import time
from typing import Callable

from finetune.dist import on_rank0_then_share
from .errors import CheckpointError
from .layout import LOCK_FILE

HEARTBEAT_S = 60.0
STALE_S = 10 * HEARTBEAT_S  # a live holder has rewritten its heartbeat ten times by then
_NO_FLOCK = (errno.ENOSYS, errno.ENOLCK, errno.EOPNOTSUPP)


class LockError(RuntimeError):
    """Another job holds the directory, or the lock file cannot be written; the message says what to do."""


def _read_record(f) -> dict:
    f.seek(0)
    try:
        record = json.loads(f.read().strip() or "{}")
        return record if isinstance(record, dict) else {}
    except ValueError:
        return {}  # an old text record or garbage: no one we can name


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, someone else's
    return True


def describe(record: dict, now: float) -> str:
    if not record.get("pid"):
        return "holder unknown"
    age = now - float(record.get("heartbeat", 0))
    return (f"pid {record['pid']} on {record.get('host', '?')}, started {record.get('started', '?')}, "
            f"last heartbeat {age:.0f}s ago")


def is_stale(record: dict, now: float) -> bool:
    """A record no live job can have written: none at all, a heartbeat older than STALE_S, or a pid
    that is gone on this very host."""
    if not record.get("pid"):
        return True
    if now - float(record.get("heartbeat", 0)) > STALE_S:
        return True
    return record.get("host") == socket.gethostname() and not _pid_alive(int(record["pid"]))


def _warn(line: str) -> None:
    print(line, file=sys.stderr, flush=True)  # the lock comes before the run's log exists


class DirLock:
    """Held by rank 0 of the job for its whole life; `release()` (or process exit) lets go."""

    def __init__(self, ckpt_dir: str, warn: Callable[[str], None] = _warn):
        self.path = os.path.join(ckpt_dir, LOCK_FILE)
        self.warn = warn
        self._file = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def acquire(self) -> None:
        try:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            f = open(self.path, "a+")
        except OSError as e:
            raise LockError(f"ckpt.dir {os.path.dirname(self.path)} is not writable: {e.strerror}") from None
        try:
            self._take(f)
        except BaseException:
            f.close()
            raise
        self._file = f
        self._started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        self._beat()
        self._thread = threading.Thread(target=self._heartbeat, name="ckpt-lock-heartbeat", daemon=True)
        self._thread.start()

    def _take(self, f) -> None:
        now, where = time.time(), os.path.dirname(self.path)
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            record = _read_record(f)
            hint = "stop it or point ckpt.dir elsewhere"
            if record.get("pid") and is_stale(record, now):
                hint = (f"its heartbeat stopped over {STALE_S / 60:.0f} min ago, so the job is probably dead and the "
                        f"file system kept its lock: if `ps -p {record['pid']}` on {record.get('host', '?')} shows "
                        f"nothing, delete {self.path} and start again")
            raise LockError(f"ckpt.dir {where} is in use by another job ({describe(record, now)}); {hint}") from None
        except OSError as e:
            if e.errno not in _NO_FLOCK:
                raise LockError(f"cannot lock {self.path}: {e.strerror}") from None
            self.warn(f"warning: flock is not supported on {where} ({e.strerror}); the heartbeat in "
                        f"{self.path} guards it instead")
        record = _read_record(f)
        if not is_stale(record, now):
            raise LockError(f"ckpt.dir {where} is in use by another job ({describe(record, now)}); stop it or point "
                            f"ckpt.dir elsewhere (a dead job's lock is taken over {STALE_S / 60:.0f} min after its "
                            f"last heartbeat, or delete {self.path})")
        if record.get("pid"):
            self.warn(f"warning: taking over {self.path} from a dead job ({describe(record, now)})")

    def _beat(self) -> None:
        record = {"host": socket.gethostname(), "pid": os.getpid(), "started": self._started, "heartbeat": time.time()}
        self._file.seek(0)
        self._file.truncate()
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                self._beat()
            except (OSError, ValueError):  # a full or vanished disk: the save path reports that, not this thread
                pass

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._file is not None:
            self._file.close()
            self._file = None


def lock_for_job(ckpt_dir: str, group) -> DirLock | None:
    """Rank 0 takes <ckpt_dir>/.lock and returns it, held until `release()`; the other ranks return None. If
    another live job holds it, every rank raises CheckpointError with rank 0's message."""
    held: list[DirLock] = []

    def take() -> None:  # returns nothing: the lock (an open file, a heartbeat thread) stays on rank 0
        lock = DirLock(ckpt_dir)
        try:
            lock.acquire()
        except LockError as e:
            raise CheckpointError(str(e)) from None
        held.append(lock)
    on_rank0_then_share(take, group, CheckpointError)
    return held[0] if held else None

"""The two lock protocols a backend picks from (its `lock_class`): one job per ckpt.dir, an flock on
<ckpt.dir>/.lock (`DirLock`, a folder) or a compare-and-swap object (`ObjectLock`, any backend that offers
compare_and_swap), and a record in it of who holds it and since when.

    python -m pytest tests/test_ckpt_unit.py -q -k lock

ckpt/lock.py's `lock_for_job` is what a job calls: rank 0 takes the lock, and every rank raises rank 0's refusal.

The record is one JSON line, {"host", "pid", "started", "heartbeat"}, rewritten in place every
HEARTBEAT_S by a thread of the holder (in place: a rename would make a new file and drop the flock).
- flock works (local disks, most parallel file systems): it dies with its holder's process, but a file
  server may keep a dead host's lock. So a refusal that names another host says how to tell whether that
  job is dead (its host down, or its pid gone there) and then to delete the lock file; past STALE_S
  without a heartbeat it also says that the job is probably dead.
- flock unsupported (ENOSYS / ENOLCK / EOPNOTSUPP: Lustre mounted `noflock`, some NFS): one warning
  line, and the record decides: a fresh heartbeat refuses; a stale one, or a dead pid on this host,
  is a dead job's lock and is taken over with a warning naming it.
- an object store (s3://): `ObjectLock`, the same record and rules as without flock, kept with conditional PUTs.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import sys
import threading
import time
from typing import Callable

LOCK_FILE = ".lock"
HEARTBEAT_S = 60.0
STALE_S = 10 * HEARTBEAT_S  # a live holder has rewritten its heartbeat ten times by then
RECORD_WIDTH = 511  # bytes of JSON (space-padded) per lock record, so each heartbeat rewrites the same bytes
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


def refusal(path: str, record: dict, now: float, flock: bool) -> str:
    """The one-line refusal: who holds the lock at `path`, and, when that is another host, how to tell
    whether its job is dead and what to do then. A host that died keeps its flock on a file server for a
    while (NFS: until the lease ends or the client reboots), so "held" alone does not mean "alive"."""
    head = f"ckpt.dir {os.path.dirname(path)} is in use by another job ({describe(record, now)})"
    pid, host = record.get("pid"), record.get("host", "?")
    if not pid:
        return f"{head}; if no job writes there, delete {path} and start again, else point ckpt.dir elsewhere"
    if host == socket.gethostname():
        return f"{head}; stop it or point ckpt.dir elsewhere"
    if now - float(record.get("heartbeat", 0)) > STALE_S:
        pulse = f"its heartbeat stopped over {STALE_S / 60:.0f} min ago, so the job is probably dead"
        pulse += " and the file system kept its lock" if flock else ""
    else:
        pulse = f"a live job rewrites its heartbeat every {HEARTBEAT_S:.0f} s"
    takeover = "" if flock else f" (without flock it is taken over {STALE_S / 60:.0f} min after its last heartbeat)"
    return (f"{head}; {pulse}: if {host} is down or `ps -p {pid}` on {host} shows nothing, that job is dead: "
            f"delete {path} and start again; else stop it or point ckpt.dir elsewhere{takeover}")


def not_writable(ckpt_dir: str, reason) -> LockError:
    """The refusal when <ckpt_dir> cannot be written at all (no lock taken, nothing probed)."""
    return LockError(f"ckpt.dir {ckpt_dir} is not writable: {reason}")


def _warn(line: str) -> None:
    print(line, file=sys.stderr, flush=True)  # the lock comes before the run's log exists


class _Heartbeat:
    """A daemon thread of the holder that calls `beat()` every HEARTBEAT_S until stop(), or until beat() returns
    False (the lock is no longer ours)."""

    def __init__(self, beat: Callable[[], bool | None]):
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(beat,), name="ckpt-lock-heartbeat", daemon=True)
        self._thread.start()

    def _run(self, beat) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            if beat() is False:
                return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


class DirLock:
    """Held by rank 0 of the job for its whole life; `release()` (or process exit) lets go."""

    def __init__(self, ckpt_dir: str, store=None, warn: Callable[[str], None] = _warn):
        """`store`: unused (a folder's lock is the file system's flock)."""
        self.path = os.path.join(ckpt_dir, LOCK_FILE)
        self.warn = warn
        self._file = None
        self._heart: _Heartbeat | None = None

    def acquire(self) -> None:
        try:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            # read-write, created if missing, never truncated; not append mode, so each heartbeat rewrites in place
            f = os.fdopen(os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644), "r+")
        except OSError as e:
            raise not_writable(os.path.dirname(self.path), e.strerror) from None
        try:
            self._take(f)
        except BaseException:
            f.close()
            raise
        self._file = f
        self._started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        self._beat()
        self._heart = _Heartbeat(self._heartbeat)

    def _take(self, f) -> None:
        now, where = time.time(), os.path.dirname(self.path)
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            raise LockError(refusal(self.path, _read_record(f), now, flock=True)) from None
        except OSError as e:
            if e.errno not in _NO_FLOCK:
                raise LockError(f"cannot lock {self.path}: {e.strerror}") from None
            self.warn(f"warning: flock is not supported on {where} ({e.strerror}); the heartbeat in "
                        f"{self.path} guards it instead")
        record = _read_record(f)
        if not is_stale(record, now):
            raise LockError(refusal(self.path, record, now, flock=False))
        if record.get("pid"):
            self.warn(f"warning: taking over {self.path} from a dead job ({describe(record, now)})")

    def _beat(self) -> None:
        record = {"host": socket.gethostname(), "pid": os.getpid(), "started": self._started, "heartbeat": time.time()}
        # overwritten in place at a fixed width, then cut after it: a reader never sees an empty record (which
        # reads as "no one", so a job starting then would take over a live job's lock without flock)
        self._file.seek(0)
        self._file.write(json.dumps(record).ljust(RECORD_WIDTH) + "\n")
        self._file.truncate()
        self._file.flush()
        os.fsync(self._file.fileno())

    def _heartbeat(self) -> None:
        try:
            self._beat()
        except (OSError, ValueError):  # a full or vanished disk: the save path reports that, not this thread
            pass

    def release(self) -> None:
        if self._heart is not None:
            self._heart.stop()
            self._heart = None
        if self._file is not None:
            self._file.close()
            self._file = None


class ObjectLock:
    """The lock of a ckpt.dir on an object store (`store`, which offers compare_and_swap): an object
    <ckpt.dir>/.lock holding the same record, created create-only (S3: If-None-Match: *: of two jobs starting
    together, one gets it) and rewritten by the heartbeat thread with a compare-and-swap on its ETag (If-Match).
    An object store has no flock, so the record decides, as on a file system without flock: a fresh heartbeat refuses, a stale one is taken over (again by If-Match on
    the ETag read, so two jobs cannot both take over) with a warning naming the dead job."""

    def __init__(self, ckpt_dir: str, store, warn: Callable[[str], None] = _warn):
        self.path, self.warn, self.store = store.join(ckpt_dir, LOCK_FILE), warn, store
        self._etag: str | None = None
        self._heart: _Heartbeat | None = None

    def _record(self) -> bytes:
        return json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "started": self._started,
                           "heartbeat": time.time()}).encode()

    def acquire(self) -> None:
        self._started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        try:
            self._etag = self._take()
        except FileExistsError:  # another job created or took it over between our read and our write
            raise LockError(refusal(self.path, self._read()[0], time.time(), flock=False)) from None
        except OSError as e:
            raise not_writable(self.path.rsplit('/', 1)[0], e) from None
        self._heart = _Heartbeat(self._heartbeat)

    def _read(self) -> tuple[dict, str | None]:
        """The record and the ETag it was read at ({} and None: no lock object)."""
        try:
            etag = self.store.etag(self.path)
            record = json.loads(self.store.read(self.path) or b"{}")
            return (record if isinstance(record, dict) else {}), etag
        except FileNotFoundError:
            return {}, None
        except ValueError:
            return {}, etag

    def _take(self) -> str:
        record, etag = self._read()
        if etag is None:
            return self.store.create(self.path, self._record())
        now = time.time()
        if not is_stale(record, now):
            raise LockError(refusal(self.path, record, now, flock=False))
        if record.get("pid"):
            self.warn(f"warning: taking over {self.path} from a dead job ({describe(record, now)})")
        return self.store.replace(self.path, self._record(), etag)

    def _heartbeat(self) -> bool:
        try:
            self._etag = self.store.replace(self.path, self._record(), self._etag)
        except FileExistsError:  # someone took it over: only a job that judged ours dead does that
            self.warn(f"warning: {self.path} was taken over by another job; this job no longer holds ckpt.dir")
            return False
        except OSError:  # the store unreachable for a while: the save path reports that, not this thread
            pass
        return True

    def release(self) -> None:
        if self._heart is not None:
            self._heart.stop()
            self._heart = None
        if self._etag is not None:
            with contextlib.suppress(OSError):
                if self.store.etag(self.path) == self._etag:  # still ours: a job that took it over keeps it
                    self.store.delete(self.path)
            self._etag = None

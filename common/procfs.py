"""One reader of Linux's `Key:   123 kB` files (/proc/meminfo, /proc/self/status): the memory tier's preflight
reads MemAvailable, the per-rank report VmHWM. One reader of /proc/PID/stat: a process's state, parent and start,
and whether it still runs.

    python -c "from common.procfs import kib_field; print(kib_field('/proc/meminfo', 'MemAvailable'))"
"""

from __future__ import annotations


def kib_field(path: str, key: str) -> int:
    """`key`'s value in bytes (the file says kB), 0 where the file lacks it."""
    with open(path) as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def stat_fields(pid: int | str = "self") -> list[str]:
    """/proc/PID/stat's fields after "(comm)" (which may hold spaces): [0] is field 3, the state (R, S, Z, ...),
    [1] the parent pid, [19] the start time in clock ticks since boot. OSError if there is no such process."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()


def running(pid: int) -> bool:
    """`pid` exists and has not ended: a child that ended and that its parent has not reaped yet is a zombie (Z),
    which signal 0 still reaches, so /proc tells."""
    try:
        return stat_fields(pid)[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False

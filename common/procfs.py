"""One reader of Linux's `Key:   123 kB` files (/proc/meminfo, /proc/self/status): the memory tier's preflight
reads MemAvailable, the per-rank report VmHWM.

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

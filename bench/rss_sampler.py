"""Sample the resident memory (VmRSS, as /proc reports it) of a job's training ranks while it runs.

    python bench/rss_sampler.py -- torchrun --nproc_per_node 2 train_fsdp.py --config configs/tiny.yaml

A background thread walks the process tree under one pid every `interval` seconds and records, per training
rank (RANK from its environment; DCP's uploader processes, which multiprocessing spawns below a rank, are
kept apart), VmRSS and its peak, with time stamps, so a caller can attribute a peak to what the job was
doing then. Shared-memory pages a rank touched (process-mode staging) count in that rank's VmRSS. It also
records the machine's smallest MemAvailable (/proc/meminfo) over the run: whether the job fits the machine, with
shared pages counted once.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import threading
import time


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(c) for c in f.read().split()]
    except OSError:
        return []


def _field_kib(pid: int, field: str) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next((int(line.split()[1]) for line in f if line.startswith(field)), None)
    except OSError:
        return None


def _mem_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            return next((int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:")), None)
    except OSError:
        return None


def _rank_of(pid: int) -> int | None:
    """RANK of a torchrun worker; -1 for DCP's spawned uploader; None for anything else (torchrun itself)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"multiprocessing" in f.read():
                return -1
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
    except OSError:
        return None
    return int(env[b"RANK"]) if b"RANK" in env else None


class RSSSampler:
    """`samples[rank]`: [(time.time(), VmRSS bytes)], on the clock metrics.jsonl records; `peak(rank)`: the largest VmRSS sampled,
    or the kernel's own high-water mark (VmHWM) where that was read and is larger; `min_available`: the machine's
    smallest MemAvailable, bytes."""

    def __init__(self, root_pid: int, interval: float = 0.05):
        self.root, self.interval = root_pid, interval
        self.samples: dict[int, list[tuple[float, int]]] = {}
        self.hwm: dict[int, int] = {}
        self.uploader_peak = 0
        self.min_available: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def __enter__(self) -> "RSSSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        ranks: dict[int, int | None] = {}
        while not self._stop.is_set():
            stack, now, available = [self.root], time.time(), _mem_available()
            if available is not None:
                self.min_available = min(available, self.min_available or available)
            while stack:
                pid = stack.pop()
                stack += _children(pid)
                if ranks.get(pid) is None:  # again until known: read between fork and exec, a worker has no RANK yet
                    ranks[pid] = _rank_of(pid)
                rss = _field_kib(pid, "VmRSS:")
                if rss is None:
                    continue
                if ranks[pid] is None:
                    continue
                if ranks[pid] == -1:
                    self.uploader_peak = max(self.uploader_peak, rss * 1024)
                    continue
                self.samples.setdefault(ranks[pid], []).append((now, rss * 1024))
                hwm = _field_kib(pid, "VmHWM:")
                if hwm is not None:
                    self.hwm[ranks[pid]] = max(self.hwm.get(ranks[pid], 0), hwm * 1024)
            self._stop.wait(self.interval)

    def peak(self, rank: int) -> int:
        return max([b for _, b in self.samples.get(rank, [])] + [self.hwm.get(rank, 0)])

    def peak_between(self, rank: int, t0: float, t1: float) -> int:
        """The largest VmRSS sampled between the times t0 and t1 (time.time()): one phase's peak. A phase shorter
        than the sampling interval (a toy size, a busy machine) may hold no sample: then the last one before t1."""
        inside = [b for t, b in self.samples.get(rank, []) if t0 <= t <= t1]
        return max(inside) if inside else self.at(rank, t1)

    def at(self, rank: int, when: float) -> int:
        """VmRSS of `rank` at the time `when`: the last sample before it (0 before the first)."""
        return max(((t, b) for t, b in self.samples.get(rank, []) if t <= when), default=(0, 0))[1]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--interval", type=float, default=0.05, help="seconds between samples (default 0.05)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="the job to run and sample, after --")
    args = p.parse_args(argv)
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not cmd:
        p.error("no command to run: python bench/rss_sampler.py -- torchrun ... train_fsdp.py ...")
    proc = subprocess.Popen(cmd)
    with RSSSampler(proc.pid, args.interval) as sampler:
        code = proc.wait()
    for r in sorted(sampler.samples):
        print(f"rank {r}: peak VmRSS {sampler.peak(r) / 2 ** 30:.2f} GiB ({len(sampler.samples[r])} samples)")
    print(f"uploader processes: peak VmRSS {sampler.uploader_peak / 2 ** 30:.2f} GiB")
    if sampler.min_available is not None:
        print(f"machine: smallest MemAvailable {sampler.min_available / 2 ** 30:.2f} GiB")
    return code


if __name__ == "__main__":
    sys.exit(main())

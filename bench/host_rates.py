"""This machine's own rates, measured beside a benchmark in the same run: the disk's sequential write (dd with
conv=fdatasync) and a bare memory copy (the memcpy floor of staging), each by `procs` processes at once, as the
ranks of a save write and copy at once.

    python bench/host_rates.py --dir /tmp --mib 512 --procs 2     # prints both, in GB/s and seconds

dd writes zeros from /dev/zero in 8 MiB blocks and syncs the file before it exits: the rate a plain sequential
writer gets from this filesystem, the reference each checkpoint method's write rate is compared with
(bench/ckpt_bench.py, bench/realsize_bench.py). The floor: each process copies its bytes between two preallocated,
already touched buffers (one thread, as a training rank here runs with OMP_NUM_THREADS=1); they start together.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

_COPY = """
import sys, time, torch
torch.set_num_threads(1)
src = torch.ones({n} // 4); dst = torch.empty({n} // 4); dst.copy_(src)
print("ready", flush=True); sys.stdin.readline()
times = []
for _ in range(5):
    t0 = time.perf_counter(); dst.copy_(src); times.append(time.perf_counter() - t0)
print(min(times), flush=True)
"""


def dd_command(path: str, nbytes: int) -> list[str]:
    return ["dd", "if=/dev/zero", f"of={path}", "bs=8M", f"count={max(1, nbytes >> 23)}", "conv=fdatasync"]


def disk_write_s(folder: str, nbytes: int, procs: int = 1) -> float:
    """Seconds until `procs` dd processes, started together, have each written and synced `nbytes` (rounded down
    to 8 MiB) to a new file in `folder`; the files are removed after."""
    paths = [os.path.join(folder, f"disk-probe-{os.getpid()}-{i}") for i in range(procs)]
    t0 = time.perf_counter()
    running = [subprocess.Popen(dd_command(p, nbytes), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
               for p in paths]
    for proc in running:
        if proc.wait():
            raise RuntimeError(f"dd failed: {proc.stderr.read().decode().strip()}")
    seconds = time.perf_counter() - t0
    for p in paths:
        os.remove(p)
    return seconds


def probe_bytes(nbytes: int) -> int:
    """What dd_command writes for `nbytes`: whole 8 MiB blocks."""
    return max(1, nbytes >> 23) << 23


def memcpy_floor_s(nbytes: int, procs: int = 1) -> float:
    """The median over `procs` processes (copying at the same time) of their fastest of 5 copies of `nbytes`."""
    running = [subprocess.Popen([sys.executable, "-c", _COPY.format(n=nbytes)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True) for _ in range(procs)]
    for proc in running:
        if proc.stdout.readline().strip() != "ready":
            raise RuntimeError("memcpy probe failed to start")
    for proc in running:
        proc.stdin.write("go\n")
        proc.stdin.flush()
    times = [float(proc.stdout.readline()) for proc in running]
    for proc in running:
        proc.wait()
    return statistics.median(times)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default=".", help="the filesystem to probe (default: here)")
    p.add_argument("--mib", type=int, default=512, help="MiB per process")
    p.add_argument("--procs", type=int, default=2, help="processes at once")
    a = p.parse_args(argv)
    n = a.mib << 20
    disk = disk_write_s(a.dir, n, a.procs)
    floor = memcpy_floor_s(n, a.procs)
    print(f"disk: {a.procs} x {probe_bytes(n) / 1e9:.2f} GB in {disk:.2f} s = {a.procs * probe_bytes(n) / disk / 1e9:.2f} "
          f"GB/s; memcpy floor: {n / 1e9:.2f} GB in {floor:.3f} s per process")


if __name__ == "__main__":
    main()

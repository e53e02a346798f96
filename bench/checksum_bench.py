"""Checksum throughput on this machine: SHA-256 vs XXH3-128 vs CRC32C vs BLAKE3, in memory and from a file.

    python bench/checksum_bench.py                 # 256 MiB, 5 interleaved rounds, ~30 s on 2 busy cores
    python bench/checksum_bench.py --mib 64 --rounds 3

Each round runs every algorithm once, in a rotated order, so load from other processes spreads over
all of them; the table gives the median GB/s and the min-max spread. "file" hashes a file in the
page cache through ckpt.checksum's reader (8 MiB reads), as resume verification does with warm data.
Writes bench/results/checksum_bench.{json,md} and keeps the run under bench/results/runs/ (bench/provenance.py);
docs/checkpoint-integrity.md explains the choice.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import sys
import tempfile
import time

import xxhash

import provenance  # bench/provenance.py, beside this script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HASHERS = {"sha256": hashlib.sha256, "xxh3_128": xxhash.xxh3_128}
try:  # the two candidates we did not choose: compared when installed (pip install crc32c blake3), not required
    import crc32c
    HASHERS["crc32c"] = crc32c.CRC32CHash
except ImportError:
    pass
try:
    import blake3
    HASHERS["blake3"] = blake3.blake3
except ImportError:
    pass
CHUNK = 8 << 20


def hash_buffer(make, buf: memoryview) -> float:
    t0 = time.perf_counter()
    h = make()
    for i in range(0, len(buf), CHUNK):
        h.update(buf[i:i + CHUNK])
    h.digest()
    return time.perf_counter() - t0


def hash_file(make, path: str) -> float:
    t0 = time.perf_counter()
    h = make()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    h.digest()
    return time.perf_counter() - t0


def read_file(path: str) -> float:
    t0 = time.perf_counter()
    with open(path, "rb") as f:
        while f.read(CHUNK):
            pass
    return time.perf_counter() - t0


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=256)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    args = p.parse_args(argv)
    started = provenance.start(argv)
    nbytes = args.mib << 20
    buf = memoryview(os.urandom(nbytes))
    with tempfile.NamedTemporaryFile(delete=False) as f:
        f.write(buf)
        path = f.name
    names = list(HASHERS)
    secs = {f"{n}/{where}": [] for n in names for where in ("memory", "file")}
    secs["read only/file"] = []
    try:
        read_file(path)  # into the page cache
        for r in range(args.rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            for n in order:
                secs[f"{n}/memory"].append(hash_buffer(HASHERS[n], buf))
                secs[f"{n}/file"].append(hash_file(HASHERS[n], path))
            secs["read only/file"].append(read_file(path))
    finally:
        os.remove(path)
    rows = {}
    for key, s in secs.items():
        rates = [nbytes / 1e9 / x for x in s]
        rows[key] = {"median_GBps": statistics.median(rates), "min_GBps": min(rates), "max_GBps": max(rates)}
    result = provenance.record({"bytes": nbytes, "rounds": args.rounds, "rates": rows}, "checksum_bench", args.out,
                               started)
    lines = [f"{args.mib} MiB, {args.rounds} interleaved rounds. " + provenance.markdown_line(result), "", "| algorithm | memory GB/s (median, min-max) | file in page cache GB/s |",
             "|---|---|---|"]
    for n in [*names, "read only"]:
        m, fl = rows.get(f"{n}/memory"), rows[f"{n}/file"]
        mem = f"{m['median_GBps']:.2f} ({m['min_GBps']:.2f}-{m['max_GBps']:.2f})" if m else ""
        lines.append(f"| {n} | {mem} | {fl['median_GBps']:.2f} ({fl['min_GBps']:.2f}-{fl['max_GBps']:.2f}) |")
    md = "\n".join(lines) + "\n"
    with open(os.path.join(args.out, "checksum_bench.md"), "w") as f:
        f.write(md)
    print(md)


if __name__ == "__main__":
    sys.exit(main())

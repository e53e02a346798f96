"""Checkpoint commit and resume-verify time at 7B / 70B x W = 8, 64, 512, from per-byte rates measured here.

    python bench/checksum_bench.py && python bench/ckpt_bench.py --hidden 768 --layers 6 --saves 4 --train-steps 0
    python bench/ckpt_scale.py            # reads bench/results/{checksum,ckpt}_bench.json, prints the table

Bytes: 12 per parameter (fp32 weights + AdamW exp_avg and exp_avg_sq), so 84 GB for 7B, 840 GB for 70B.
Old scheme (before issue 11): after the upload, rank 0 alone reads and SHA-256s every file, and again on
every resume while all other ranks wait. New: each rank hashes its own bytes with XXH3-128 as it writes
them (at most B/W / rate, overlapped with the write) and rank 0 writes the manifest from the gathered
digests (the measured fixed commit cost); on resume each rank hashes its share, B/W. Rates are this
machine's page-cache rates (hashing a warm file), so they are lower bounds for the old scheme: its rank 0
must in reality read the whole checkpoint over the network, which is slower still.
"""

from __future__ import annotations

import argparse
import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = {"7B": 7e9, "70B": 70e9}
WORLDS = (8, 64, 512)
BYTES_PER_PARAM = 12


def rates(results: str) -> dict:
    with open(os.path.join(results, "checksum_bench.json")) as f:
        c = json.load(f)["rates"]
    with open(os.path.join(results, "ckpt_bench.json")) as f:
        b = json.load(f)
    sync = b["methods"]["dcp_sync"]
    return {"sha256_file_GBps": c["sha256/file"]["median_GBps"], "xxh3_file_GBps": c["xxh3_128/file"]["median_GBps"],
            "xxh3_memory_GBps": c["xxh3_128/memory"]["median_GBps"],
            "commit_fixed_s": sync["commit_overhead_s"]["median"],
            "write_GBps_per_rank": b["rank_state_GB"] / sync["upload_s"]["median"]}


def fmt(secs: float) -> str:
    return f"{secs:.1f} s" if secs < 120 else f"{secs / 60:.1f} min"


def table(r: dict) -> str:
    lines = ["| model | checkpoint | W | upload per rank | commit, old (rank 0 SHA-256s all) | commit, new | "
             "resume verify, old | resume verify, new |", "|---|---|---|---|---|---|---|---|"]
    for name, params in MODELS.items():
        total = params * BYTES_PER_PARAM / 1e9
        for w in WORLDS:
            per_rank = total / w
            old = total / r["sha256_file_GBps"]
            new_commit = r["commit_fixed_s"] + per_rank / r["xxh3_memory_GBps"]
            lines.append(f"| {name} | {total:.0f} GB | {w} | {fmt(per_rank / r['write_GBps_per_rank'])} | {fmt(old)} | "
                         f"{fmt(new_commit)} | {fmt(old)} | {fmt(per_rank / r['xxh3_file_GBps'])} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--results", default=os.path.join(ROOT, "bench", "results"))
    args = p.parse_args(argv)
    r = rates(args.results)
    print("rates: " + ", ".join(f"{k} {v:.3g}" for k, v in r.items()) + "\n")
    print(table(r))


if __name__ == "__main__":
    main()

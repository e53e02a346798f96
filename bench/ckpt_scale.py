"""Checkpoint commit and resume-verify time at 7B / 70B x W = 8, 64, 512, from per-byte rates measured here.

    python bench/checksum_bench.py && python bench/ckpt_bench.py --hidden 768 --layers 6 --saves 8 --train-steps 0
    python bench/ckpt_scale.py            # reads bench/results/{checksum,ckpt}_bench.json, measures the
                                          # manifest costs, writes bench/results/ckpt_scale.{json,md}
    python bench/ckpt_scale.py --models 7B --worlds 2 --out /tmp/s   # seconds, for a smoke test

Bytes B: 12 per parameter (fp32 weights + AdamW exp_avg and exp_avg_sq), so 84 GB for 7B, 840 GB for 70B.

Old scheme (before issue 11): after the upload, rank 0 alone reads and SHA-256s every file (B at the
SHA-256 file rate) before the marker exists, and again on every resume while all other ranks wait.
New: each rank hashes its own bytes with XXH3-128 as it writes them (B/W at the in-memory XXH3 rate,
inside the upload, in the uploader); after the upload only rank 0's commit remains: hash .metadata,
write commit.json with W entries, fsync. On resume rank 0 checks the manifest against .metadata
(unpickles it) and every rank hashes its share, B/W at the XXH3 file rate.

The manifest costs are measured, not assumed: for each (model, W) this script writes a DCP .metadata
with the model's real tensor count (Llama: 9 tensors per layer + 3, each x3 with the two AdamW
moments, plus one `step` per tensor), every sharded tensor in W chunks as FSDP2 saves it, and times
ckpt.commit_protocol's commit_checkpoint (hash .metadata + manifest of W digests + fsyncs) and check_manifest,
up to --measure-max; above it they are extrapolated (scaled by W from the largest measured W), and the JSON
(`manifest_costs`) and the table say so. The run is also kept under bench/results/runs/ (bench/provenance.py).
Rates are this machine's page-cache rates, so the old scheme's figures are lower bounds: its rank 0
must really read the whole checkpoint over the network, which is slower still.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import shutil
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import provenance  # noqa: E402 - bench/provenance.py, beside this script
# name: (parameters, layers), Llama-2 shapes
MODELS = {"7B": (7e9, 32), "70B": (70e9, 80)}
BYTES_PER_PARAM = 12
TENSORS_PER_LAYER = 9  # q, k, v, o, gate, up, down, two norms


def rates(results: str) -> dict:
    """Per-byte rates from the two benchmarks' JSON (this machine, page cache, under the shared load)."""
    with open(os.path.join(results, "checksum_bench.json")) as f:
        checksum = json.load(f)
    with open(os.path.join(results, "ckpt_bench.json")) as f:
        b = json.load(f)
    c, sync = checksum["rates"], b["methods"]["dcp_sync"]
    # which runs the rates come from (older results files carry no provenance)
    source = {name: {k: r.get("provenance", {}).get(k) for k in ("git_commit", "finished_utc")}
              for name, r in (("checksum_bench", checksum), ("ckpt_bench", b))}
    return {"source": source, "sha256_file_GBps": c["sha256/file"]["median_GBps"], "xxh3_file_GBps": c["xxh3_128/file"]["median_GBps"],
            "xxh3_memory_GBps": c["xxh3_128/memory"]["median_GBps"],
            "write_GBps_per_rank": b["rank_state_GB"] / sync["upload_s"]["median"]}


def synthetic_metadata(layers: int, world: int, digest_of: dict):
    """A DCP Metadata as FSDP2 + AdamW would save it: every tensor in `world` dim-0 chunks, one file per rank."""
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex,
                                                       TensorProperties, TensorStorageMetadata)
    props = TensorProperties(dtype=torch.float32)
    state, storage = {}, {}
    names = [f"model.layers.{i}.t{j}" for i in range(layers) for j in range(TENSORS_PER_LAYER)] + ["embed", "norm", "lm_head"]
    for name in names:
        for key in (f"app.model.{name}", f"app.optim.state.{name}.exp_avg", f"app.optim.state.{name}.exp_avg_sq"):
            chunks = [ChunkStorageMetadata(offsets=torch.Size([r * 8, 0]), sizes=torch.Size([8, 4096]))
                      for r in range(world)]
            state[key] = TensorStorageMetadata(props, torch.Size([8 * world, 4096]), chunks)
            for r in range(world):
                storage[MetadataIndex(key, torch.Size([r * 8, 0]), 0)] = _StorageInfo(f"__{r}_0.distcp", r * 1024, 1024)
        state[f"app.optim.state.{name}.step"] = TensorStorageMetadata(
            props, torch.Size([]), [ChunkStorageMetadata(offsets=torch.Size([]), sizes=torch.Size([]))])
        storage[MetadataIndex(f"app.optim.state.{name}.step", torch.Size([]), 0)] = _StorageInfo("__0_0.distcp", 0, 8)
    return Metadata(state_dict_metadata=state, storage_data=storage)


def manifest_costs(layers: int, world: int, work: str) -> dict:
    """Seconds for rank 0's commit (after the upload) and its manifest check on resume, measured."""
    from ckpt.commit_protocol import check_manifest, commit_checkpoint
    path = os.path.join(work, "step-000001")
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)
    digests = {f"__{r}_0.distcp": {"size": 1024, "xxh3_128": f"{r:032x}"} for r in range(world)}
    metadata = synthetic_metadata(layers, world, digests)
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(metadata, f)
    with open(os.path.join(path, "meta.json"), "w") as f:
        json.dump({"step": 1, "world_size": world}, f)
    for name in digests:  # sparse stand-ins of the manifest's size: the commit checks each file's size, reads none
        with open(os.path.join(path, name), "wb") as f:
            f.truncate(digests[name]["size"])
    t0 = time.perf_counter()
    commit_checkpoint(path, world, digests, metadata, ["meta.json"])
    commit_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    check_manifest(path)
    check_s = time.perf_counter() - t0
    size = os.path.getsize(os.path.join(path, ".metadata"))
    shutil.rmtree(path)
    return {"commit_s": commit_s, "check_manifest_s": check_s, "metadata_MB": size / 1e6}


def measured_or_scaled(layers: int, args, work: str):
    """(W, costs) per world size: measured up to --measure-max; above it the costs of the largest measured W,
    scaled by W (every cost here is proportional to the number of chunks, tensors x W), marked `scaled_from`."""
    measured = {w: manifest_costs(layers, w, work) for w in args.worlds if w <= args.measure_max}
    for w in args.worlds:
        if w in measured:
            yield w, dict(measured[w], scaled_from=None)
        else:
            base = max(measured)
            yield w, {k: v * w / base for k, v in measured[base].items()} | {"scaled_from": base}


def row(name: str, params: float, world: int, r: dict, m: dict) -> dict:
    total = params * BYTES_PER_PARAM / 1e9
    per_rank = total / world
    old = total / r["sha256_file_GBps"]
    return {"model": name, "checkpoint_GB": total, "world_size": world, "per_rank_GB": per_rank,
            "upload_per_rank_s": per_rank / r["write_GBps_per_rank"],
            "old_commit_s": old, "old_verify_s": old,
            "new_hash_in_upload_s": per_rank / r["xxh3_memory_GBps"],
            "new_commit_s": m["commit_s"], "new_verify_s": m["check_manifest_s"] + per_rank / r["xxh3_file_GBps"],
            "metadata_MB": m["metadata_MB"], "check_manifest_s": m["check_manifest_s"],
            "manifest_costs_scaled_from_W": m["scaled_from"],
            # new_commit_s, check_manifest_s (so new_verify_s in part) and metadata_MB: timed here, or not
            "manifest_costs": "measured" if m["scaled_from"] is None else
                              f"extrapolated: W={m['scaled_from']} measured x {world // m['scaled_from']}"}


def fmt(secs: float) -> str:
    if secs < 1:
        return f"{secs * 1000:.0f} ms"
    return f"{secs:.1f} s" if secs < 120 else f"{secs / 60:.1f} min"


def star(x: dict) -> str:
    """The mark on a cell that holds a manifest cost: nothing if measured, else how it was extrapolated."""
    w = x["manifest_costs_scaled_from_W"]
    return "" if w is None else f" (extrapolated: W={w} x {x['world_size'] // w})"


def to_markdown(res: dict) -> str:
    r, measure_max = res["rates"], res["measure_max"]
    lines = [f"Rates measured here: SHA-256 {r['sha256_file_GBps']:.2f} GB/s and XXH3-128 {r['xxh3_file_GBps']:.2f} "
             f"GB/s from a file in page cache, XXH3-128 {r['xxh3_memory_GBps']:.2f} GB/s in memory, DCP write "
             f"{r['write_GBps_per_rank']:.2f} GB/s per rank (sync upload). Manifest costs (rank 0's commit, "
             f"resume's manifest check, .metadata size) timed per row up to W={measure_max}; rows above it are "
             "that W's figures scaled by W, marked extrapolated. " + provenance.markdown_line(res), "",
             "| model | checkpoint | W | upload per rank | commit after upload, old: rank 0 SHA-256s all | "
             "new: rank 0 manifest | new: XXH3 inside each rank's upload | resume verify, old | "
             "resume verify, new | .metadata |", "|---|---|---|---|---|---|---|---|---|---|"]
    for x in res["rows"]:
        lines.append(f"| {x['model']} | {x['checkpoint_GB']:.0f} GB | {x['world_size']} | {fmt(x['upload_per_rank_s'])} "
                     f"| {fmt(x['old_commit_s'])} | {fmt(x['new_commit_s'])}{star(x)} | {fmt(x['new_hash_in_upload_s'])} | "
                     f"{fmt(x['old_verify_s'])} | {fmt(x['new_verify_s'])}{star(x)} | {x['metadata_MB']:.1f} MB{star(x)} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--results", default=os.path.join(ROOT, "bench", "results"), help="where the rate JSONs are")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--worlds", nargs="+", type=int, default=[8, 64, 512])
    p.add_argument("--measure-max", type=int, default=64,
                   help="largest W whose .metadata is built and timed (W=512 of 70B is 1.1M chunks: minutes here)")
    args = p.parse_args(argv)
    started = provenance.start(argv)
    r = rates(args.results)
    work = tempfile.mkdtemp(prefix="ckpt-scale-")
    try:
        rows = [row(name, MODELS[name][0], w, r, costs)
                for name in args.models for w, costs in measured_or_scaled(MODELS[name][1], args, work)]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    res = provenance.record({"rates": r, "bytes_per_param": BYTES_PER_PARAM, "measure_max": args.measure_max,
                             "rows": rows}, "ckpt_scale", args.out, started)
    md = to_markdown(res)
    with open(os.path.join(args.out, "ckpt_scale.md"), "w") as f:
        f.write(md)
    print(md)


if __name__ == "__main__":
    main()

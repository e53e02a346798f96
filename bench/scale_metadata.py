"""DCP metadata at scale: the global .metadata, what every rank receives after a save and reads on resume, before
and after ckpt/checksum.py's SavedMetadata and ckpt/metadata_index.py, at the 8B and 70B presets' shapes.

    python bench/scale_metadata.py --worlds 64,256,1024,2048 --out bench/results/scale_metadata.json
    python bench/scale_metadata.py --worlds 64 --models 8B --out /tmp/m.json     # seconds, a smoke test

Built from torch's own classes (Metadata, TensorStorageMetadata, ChunkStorageMetadata, MetadataIndex, _StorageInfo)
as FSDP2 + AdamW save them: every parameter of the preset's architecture (its config.json in assets/) and its two
AdamW moments in W dim-0 chunks of ceil(rows / W) rows, one replicated `step` per parameter, one RNG item per rank.
T below is the number of sharded tensors (parameters x 3). The index is the one the writer writes
(metadata_index.build), measured as pickled bytes; what each rank reads on resume is computed from its FSDP shard
rows with the index's own bucketing (metadata_index.Bucketing), for every rank, and the busiest rank's files are
built and timed. The global Metadata is built and timed up to --max-chunks chunks; above that its bytes and
unpickle seconds are extrapolated linearly in chunks (T x W) from the largest built W, and the row's note says so.
Output: {"rows": [...]}, one row per (path, model, W): path, when, formula (in W, N = nodes, T), W, N (8 ranks per
node), requests_per_rank, requests_total, bytes_per_rank, bytes_total, busiest_share, seconds, note.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import pickle
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import provenance  # noqa: E402 - bench/provenance.py, beside this script
import torch  # noqa: E402
from torch.distributed.checkpoint.filesystem import _StorageInfo  # noqa: E402
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,  # noqa: E402
                                                   MetadataIndex, StorageMeta, TensorProperties,
                                                   TensorStorageMetadata)

from ckpt import metadata_index  # noqa: E402
from ckpt.checksum import SavedMetadata  # noqa: E402

MODELS = {"8B": "assets/llama3.1-8b", "70B": "assets/llama3.1-70b"}
RANKS_PER_NODE = 8


def parameters(config_dir: str) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every parameter of a Llama config.json, as transformers names them."""
    with open(os.path.join(ROOT, config_dir, "config.json")) as f:
        c = json.load(f)
    h, inter, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    kv = c["num_key_value_heads"] * (c.get("head_dim") or h // c["num_attention_heads"])
    layer = {"self_attn.q_proj.weight": (h, h), "self_attn.k_proj.weight": (kv, h), "self_attn.v_proj.weight": (kv, h),
             "self_attn.o_proj.weight": (h, h), "mlp.gate_proj.weight": (inter, h), "mlp.up_proj.weight": (inter, h),
             "mlp.down_proj.weight": (h, inter), "input_layernorm.weight": (h,),
             "post_attention_layernorm.weight": (h,)}
    out = [(f"model.layers.{i}.{n}", s) for i in range(c["num_hidden_layers"]) for n, s in layer.items()]
    out += [("model.embed_tokens.weight", (v, h)), ("model.norm.weight", (h,))]
    return out + ([] if c.get("tie_word_embeddings") else [("lm_head.weight", (v, h))])


def sharded(params) -> list[tuple[str, tuple[int, ...]]]:
    """The sharded tensors a save holds: each parameter and its two AdamW moments (T of them)."""
    return [(k, s) for n, s in params for k in (f"app.model.{n}", f"app.optim.state.{n}.exp_avg",
                                                 f"app.optim.state.{n}.exp_avg_sq")]


def metadata(params, world: int, ranks=None) -> Metadata:
    """The global Metadata of a save by `world` ranks; `ranks`: only their chunks (the rest of it, whole)."""
    props = TensorProperties(dtype=torch.float32)
    state, storage = {}, {}
    ranks = range(world) if ranks is None else ranks
    for key, shape in sharded(params):
        rows, per = shape[0], math.ceil(shape[0] / world)
        chunks = []
        for r in ranks:
            start, stop = r * per, min((r + 1) * per, rows)
            if stop <= start:
                continue
            off, size = torch.Size([start] + [0] * (len(shape) - 1)), torch.Size([stop - start, *shape[1:]])
            chunks.append(ChunkStorageMetadata(offsets=off, sizes=size))
            storage[MetadataIndex(key, off, len(chunks) - 1)] = _StorageInfo(f"__{r}_0.distcp", r * 4096,
                                                                              4 * math.prod(size))
        state[key] = TensorStorageMetadata(props, torch.Size(shape), chunks)
    for name, _ in params:  # AdamW's step: a replicated scalar, written once (DCP spreads them over the ranks)
        key = f"app.optim.state.{name}.step"
        state[key] = TensorStorageMetadata(props, torch.Size([]), [ChunkStorageMetadata(torch.Size([]), torch.Size([]))])
        storage[MetadataIndex(key, torch.Size([]), 0)] = _StorageInfo("__0_0.distcp", 0, 8)
    for r in range(world):  # each rank's own RNG state: a bytes item only it loads
        state[f"rng_rank{r}"] = BytesStorageMetadata()
        storage[MetadataIndex(f"rng_rank{r}")] = _StorageInfo(f"__{r}_0.distcp", 0, 5000)
    return Metadata(state, planner_data={k: tuple(k.split(".")) for k in state}, storage_data=storage,
                    storage_meta=StorageMeta(checkpoint_id="/ckpt/step-000100", save_id="0" * 36), version="1.0.0")


def timed_loads(blob: bytes) -> float:
    gc.collect()
    t0 = time.perf_counter()
    pickle.loads(blob)
    return time.perf_counter() - t0


def shard_rows(rows: int, world: int, rank: int) -> tuple[int, int]:
    per = math.ceil(rows / world)
    return min(rank * per, rows), min((rank + 1) * per, rows)


def buckets_read(params, saved: int, loading: int) -> list[list[tuple[int, int]]]:
    """For each of `loading` ranks, the index's (group, bucket)s (of a save by `saved` ranks) its FSDP shards meet."""
    b = metadata_index.Bucketing(saved, RANKS_PER_NODE)
    groups = metadata_index.size_groups(s[0] for _, s in sharded(params))
    out = []
    for r in range(loading):
        need: set[tuple[int, int]] = set()
        for rows, group in groups.items():
            need.update((group, n) for n in b.of_rows(rows, *shard_rows(rows, loading, r)))
        out.append(sorted(need))
    return out


def global_costs(params, world: int, max_chunks: int, cache: dict) -> dict:
    """The global .metadata's bytes and unpickle seconds: measured, or extrapolated in chunks from the largest
    measured W."""
    chunks = len(sharded(params)) * world
    if chunks <= max_chunks:
        md = metadata(params, world)
        blob = pickle.dumps(md)
        t0 = time.perf_counter()
        metadata_index.build(md, world, RANKS_PER_NODE)  # the coordinator's extra work at each save
        build_s = time.perf_counter() - t0
        del md
        cache[world] = {"bytes": len(blob), "seconds": timed_loads(blob), "chunks": chunks, "from": None,
                        "index_build_s": build_s}
        return cache[world]
    base = cache[max(cache)]
    scale = chunks / base["chunks"]
    return {"bytes": int(base["bytes"] * scale), "seconds": base["seconds"] * scale, "chunks": chunks,
            "from": max(cache), "index_build_s": base["index_build_s"] * scale}


def index_costs(params, saved: int, loading: int) -> dict:
    """What the resuming ranks read of the index: the busiest rank's files built and timed, the total from the
    bucket files' mean size."""
    need = buckets_read(params, saved, loading)
    busiest = max(range(loading), key=lambda r: len(need[r]))
    per = math.ceil(saved / RANKS_PER_NODE) * len(set(metadata_index.size_groups(s[0] for _, s in
                                                                                  sharded(params)).values()))
    lo, hi = min(n for _, n in need[busiest]), max(n for _, n in need[busiest])
    ranks = range(max(0, lo * RANKS_PER_NODE - 1), min(saved, (hi + 1) * RANKS_PER_NODE + 1))
    files = metadata_index.build(metadata(params, saved, ranks), saved, RANKS_PER_NODE)
    top = files[metadata_index.INDEX]
    mine = [files[metadata_index.bucket_file(*gn)] for gn in need[busiest]]
    seconds = timed_loads(top) + sum(timed_loads(b) for b in mine)
    mean_bucket = sum(map(len, mine)) / len(mine)
    reads = sum(len(n) for n in need)
    return {"busiest_bytes": len(top) + sum(map(len, mine)), "busiest_files": 1 + len(need[busiest]),
            "total_bytes": int(loading * len(top) + reads * mean_bucket), "total_files": loading + reads,
            "seconds": seconds, "top_bytes": len(top), "bucket_bytes": mean_bucket, "buckets": per,
            "written_bytes": int(len(top) + per * mean_bucket)}


def rows_for(model: str, params, world: int, g: dict, after: dict, other: dict, other_world: int) -> list[dict]:
    n, t = math.ceil(world / RANKS_PER_NODE), len(sharded(params))
    m = g["bytes"]
    measured = "measured" if g["from"] is None else (f"extrapolated linearly in chunks (T x W) from W={g['from']}, "
                                                     "where it was built and timed")
    stripped = pickle.dumps(_stripped())
    common = {"W": world, "N": n}

    def row(path, when, formula, rpr, rt, bpr, bt, busiest, seconds, note):
        return {"path": f"{path} ({model})", "when": when, "formula": formula, **common, "requests_per_rank": rpr,
                "requests_total": rt, "bytes_per_rank": bpr, "bytes_total": bt, "busiest_share": busiest,
                "seconds": seconds, "note": note}
    rounds = max(1, math.ceil(math.log2(world)))
    return [
        row("dcp global .metadata", "every checkpoint (written once by the coordinator)", "~b x T x W bytes",
            0, 1, 0, m, 1.0, None, f"T={t}; {m / (t * world):.0f} B per chunk; bytes {measured}"),
        row("save: Metadata every rank receives, before", "after every checkpoint",
            "broadcast of M = b x T x W to W-1 ranks: (W-1) x M", 1, world - 1, m, (world - 1) * m,
            rounds / max(1, world - 1), g["seconds"],
            f"seconds: one rank's pickle.loads of M, {measured}; busiest: the root sends ceil(log2 W) copies"),
        row("save: Metadata every rank receives, after", "after every checkpoint",
            "broadcast of an empty Metadata: (W-1) x ~300 B", 1, world - 1, len(stripped),
            (world - 1) * len(stripped), rounds / max(1, world - 1), timed_loads(stripped),
            "measured: checksum.SavedMetadata pickled as DCP's broadcast pickles it; the coordinator keeps the whole"),
        row("save: metadata index written", "every checkpoint (the coordinator)",
            "1 + G x ceil(W/8) files (G: groups of dim-0 sizes, 4 for Llama), ~b x T x W (+ T headers) bytes", 0, 1 + after["buckets"], 0,
            after["written_bytes"], 1.0, g["index_build_s"],
            "bytes: the index's top measured, bucket files at the mean of those built (the busiest resuming rank's); "
            f"seconds: metadata_index.build on the coordinator (uploader), {measured}"),
        row("resume: metadata read per rank, before", "on resume",
            "every rank reads and unpickles M: W x b x T x W", 1, world, m, world * m, 1 / world, g["seconds"],
            f"bytes and seconds {measured}"),
        row("resume: metadata read per rank, after (same W)", "on resume",
            "index top (~T headers + W per-rank items) + 1-2 buckets per size group (~8 x b x T in all) per rank",
            after["busiest_files"], after["total_files"], after["busiest_bytes"], after["total_bytes"],
            after["busiest_bytes"] / max(1, after["total_bytes"]), after["seconds"],
            f"busiest rank's files built and timed (measured); {after['busiest_bytes'] / m:.2%} of the global "
            f"file; total from the bucket files' mean size; no rank opens .metadata"),
        row(f"resume: metadata read per rank, after (saved at W, loaded at {other_world})", "on resume at another W",
            "index top + the buckets each new shard's rows meet (1-2 per size group)", other["busiest_files"], other["total_files"],
            other["busiest_bytes"], other["total_bytes"], other["busiest_bytes"] / max(1, other["total_bytes"]),
            other["seconds"], f"loading W={other_world}; {other['busiest_bytes'] / m:.2%} of the global file; "
                              "busiest rank's files built and timed (measured)"),
    ]


def _stripped() -> Metadata:
    md = Metadata({}, storage_meta=StorageMeta(checkpoint_id="/ckpt/step-000100", save_id="0" * 36), version="1.0.0")
    md.__class__ = SavedMetadata
    return md


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worlds", default="64,256,1024,2048", help="comma-separated world sizes")
    p.add_argument("--models", default="8B,70B")
    p.add_argument("--max-chunks", type=int, default=600_000,
                   help="largest T x W whose global Metadata is built and timed (memory and minutes above it)")
    p.add_argument("--out", required=True, help="the JSON file to write")
    args = p.parse_args(argv)
    started = provenance.start(argv)
    worlds = [int(w) for w in args.worlds.split(",")]
    rows = []
    for model in args.models.split(","):
        params, cache = parameters(MODELS[model]), {}
        for world in worlds:
            g = global_costs(params, world, args.max_chunks, cache)
            other_world = max(1, world * 3 // 4)
            rows += rows_for(model, params, world, g, index_costs(params, world, world),
                             index_costs(params, world, other_world), other_world)
            print(f"{model} W={world}: global {g['bytes'] / 1e6:.1f} MB; resume reads {rows[-2]['bytes_per_rank'] / 1e6:.2f}"
                  f" MB per rank (busiest), {rows[-1]['bytes_per_rank'] / 1e6:.2f} MB at W={other_world}", flush=True)
    result = {"rows": rows, "ranks_per_node": RANKS_PER_NODE, "max_chunks": args.max_chunks,
              "provenance": provenance.provenance(started)}  # commit, date, load before and after, command
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()

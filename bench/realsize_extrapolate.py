"""The 7B and 70B presets' save, load and staging times, extrapolated from the per-byte rates bench/realsize_bench.py
measured at the Qwen2.5-0.5B shape on this machine: arithmetic on a results file, written as one, so the docs quote
a file and not hand arithmetic.

    python bench/realsize_bench.py && python bench/realsize_extrapolate.py     # writes realsize_extrapolate.{json,md}
    python bench/realsize_extrapolate.py --results /tmp/rs --out /tmp/rs       # from a smoke run's results

Rates taken from the results file (each named in the output with the file's commit and date):
- staging: a rank's checkpoint bytes / the steady async save's blocking seconds (a CPU copy into host buffers;
  on GPUs staging is a device-to-host copy at `--copy-gbps`, which this machine cannot measure);
- write: the checkpoint's bytes / the final (sync) save's seconds, every rank of the node writing at once: the
  node's rate to its disk; a node of the presets is taken to write its ranks' bytes at that rate (a shared
  filesystem's aggregate bandwidth is what decides at scale: `--plan --write-gbps`);
- load: the checkpoint's bytes / the resume's load phase at the same world size, per node likewise.
Bytes per rank and per node are exact (finetune/plan.py from each preset's config.json). Nothing here was run at
7B or 70B: every row says "extrapolated".
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from finetune.config import load_config  # noqa: E402 - after the path insert
from finetune.optim import optimizer_kind  # noqa: E402
from finetune.plan import checkpoint_bytes, model_shapes  # noqa: E402
import provenance  # noqa: E402 - bench/provenance.py, beside this script

# (preset, nodes, ranks per node): the presets' own hardware, and 70B at 512 GPUs
PRESETS = [("configs/llama3-8b-sft.yaml", 1, 8), ("configs/llama3-70b-multinode.yaml", 8, 8),
           ("configs/llama3-70b-multinode.yaml", 64, 8)]


def measured_rates(r: dict) -> dict:
    """GB/s per rank (staging) and per node (write, load) from a realsize_bench result."""
    main = next(iter(r["upload_nice"].values()))
    load = next(p for p in r["loads"][f"W={r['nproc']}"]["phases"] if p["phase"] == "load (in build)")
    return {"staging_GBps_per_rank": r["rank_bytes"] / main["steady_blocking_s"] / 1e9,
            "write_GBps_per_node": main["sync_write_GBps"], "write_over_disk": main["sync_write_over_disk"],
            "load_GBps_per_node": main["checkpoint_GB"] / load["seconds"],
            "upload_overlap_ratio": main["overlap"]["ratio"], "ranks": r["nproc"], "params": r["params"]}


def row(rates: dict, preset: str, nodes: int, per_node: int) -> dict:
    """`preset` on `nodes` x `per_node` ranks: its checkpoint's bytes (exact) and times (at `rates`)."""
    cfg = load_config(os.path.join(ROOT, preset), [])
    shapes, world = model_shapes(cfg.model), nodes * per_node
    total, rank = checkpoint_bytes(shapes, world, optimizer_kind(cfg.train).state_bytes)
    node = rank * per_node
    return {"preset": preset, "params": shapes.trainable, "nodes": nodes, "world": world,
            "checkpoint_GB": total / 1e9, "rank_GB": rank / 1e9, "node_GB": node / 1e9,
            "async_blocking_s": rank / 1e9 / rates["staging_GBps_per_rank"],
            "sync_save_s": node / 1e9 / rates["write_GBps_per_node"],
            "load_s": node / 1e9 / rates["load_GBps_per_node"], "how": "extrapolated"}


def rows(rates: dict) -> list[dict]:
    return [row(rates, preset, nodes, per_node) for preset, nodes, per_node in PRESETS]


def to_markdown(res: dict) -> list[str]:
    src, ra = res["source"], res["rates"]
    head = (f"Extrapolated from {src['file']} (commit {str(src['git_commit'])[:9]}, {src['finished_utc']}; "
            f"{ra['params'] / 1e6:.0f}M params on {ra['ranks']} CPU ranks), not measured at these sizes. Rates: "
            f"staging {ra['staging_GBps_per_rank']:.2f} GB/s per rank (a CPU copy), write "
            f"{ra['write_GBps_per_node']:.2f} GB/s per node ({ra['write_over_disk']:.0%} of dd's), load "
            f"{ra['load_GBps_per_node']:.2f} GB/s per node; a step overlapping an upload took "
            f"{ra['upload_overlap_ratio']:.2f}x a quiet one there. " + provenance.markdown_line(res))
    lines = [head, "", "| preset | params | GPUs | checkpoint GB | per rank GB | per node GB | async blocking (s) | "
             "sync save (s) | load (s) |", "|---|---|---|---|---|---|---|---|---|"]
    for x in res["rows"]:
        lines.append(f"| {os.path.basename(x['preset'])} | {x['params'] / 1e9:.2f}B | {x['world']} | "
                     f"{x['checkpoint_GB']:.0f} | {x['rank_GB']:.2f} | {x['node_GB']:.1f} | {x['async_blocking_s']:.1f} "
                     f"(extrapolated) | {x['sync_save_s']:.0f} (extrapolated) | {x['load_s']:.0f} (extrapolated) |")
    return lines


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--results", default=os.path.join(ROOT, "bench", "results"), help="folder of realsize_bench.json")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    a = p.parse_args(argv)
    started = provenance.start(argv)
    path = os.path.join(a.results, "realsize_bench.json")
    with open(path) as f:
        measured = json.load(f)
    rates = measured_rates(measured)
    res = {"source": {"file": os.path.relpath(path, ROOT) if path.startswith(ROOT) else path,
                      **{k: measured.get("provenance", {}).get(k) for k in ("git_commit", "finished_utc")}},
           "rates": rates, "rows": rows(rates)}
    provenance.record(res, "realsize_extrapolate", a.out, started)
    provenance.write_markdown(a.out, "realsize_extrapolate", to_markdown(res))


if __name__ == "__main__":
    main()

"""The job's store paths and DCP's plan steps, run with the project's own code at W = 64..2048 on one machine.

    python bench/scale_coord.py --worlds 64,256,1024,2048 --out /tmp/scale_coord.json   # bench/scale_sim.py runs it
    python bench/scale_coord.py --worlds 8 --plan-worlds 2,4 --layer-worlds 8 --handoff-s 2 --out /tmp/c.json  # smoke
    python bench/scale_coord.py --plan-only --out /tmp/plans.json   # the DCP plan rows alone

One section of bench/scale_sim.py (its row contract). Store paths: a real TCPStore server in this process (libuv,
as torchrun's agent hosts it) and W clients, threads over --procs worker processes (8), each with its own TCPStore
connection wrapped in bench/store_count.py's CountingStore. Every rank runs the project's functions, not a model of
them; all start together (a barrier through the store, not counted):
- bad-input report (finetune/launch.py): every rank `_count_in`; rank 0 `_wait_for_every_rank` then `_tell`; the
  others `_seen_within` (polling every 0.1 s) until they see it. Seconds: until the last rank saw it.
- job failure key (finetune/hang.py HangWatchdog): rank 0 `failed()` publishes the failure (add + set); then every
  rank's watchdog makes one `_failure()` check, as it does once a second (CHECK_S). Seconds: that round.
- data-cache handoff (common/handoff.py): rank 0 `_build_and_tell` around a build of --handoff-s seconds, every
  other rank one_rank_builds' waiter (`_Waiting`) at the defaults (poll 2 s, heartbeat check every 40 s). Seconds:
  the build until the last waiter returned; requests scale with the build's length (the formula gives them per
  second).
The seconds to connect the W clients are recorded (`connect_s`) but make no row: here each TCPStore connection
waits ~0.16 s on this sandbox's resolver (c10d looks up the client socket's hostname, and the lookup times out), which
says nothing about torchrun's store.

DCP plans, in this process, at the Llama 3.1 8B and 70B shapes (assets/<model>/config.json; every weight and its
two AdamW moments sharded on dim 0 over W, as FSDP2 saves them): W local SavePlans of WriteItems, and the global plan
rank 0 builds with the save planner the project configures (ckpt/uploader.py save_planner: ckpt/save_plan.py's
SweepSavePlanner, plan caching on, a first save); W local LoadPlans of ReadItems and torch's
DefaultLoadPlanner.create_global_plan. Rank 0's bytes are the pickled local plans it gathers (gloo gather_object
pads each to the largest) plus the global plans it scatters; its seconds: unpickling them, planning, pickling the
result. Measured at --plan-worlds for the whole model, and at --layer-worlds (larger W) for one layer's 27 tensors,
with the project's planner and, for comparison, torch's DefaultSavePlanner (whose overlap check compares W^2/2
chunk pairs of k/v/down_proj); other W fitted (bytes x W, as plans hold T x W items; seconds a W + b W^2 by least
squares on the whole-model points and the one-layer points scaled by T / 27), and the row says so.
Paths that make no store requests (shared-path check: gloo collectives and files, bench/shared_paths_bench.py) are
not simulated here.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import pickle
import subprocess
import shutil
import sys
import tempfile
import threading
import time
from datetime import timedelta

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import provenance  # noqa: E402 - bench/provenance.py, beside this script

STORE_PATHS = ("bad_input", "failure_key", "handoff")
RANKS_PER_NODE = 8
MODELS = {"8B": "llama3.1-8b", "70B": "llama3.1-70b"}


# ---------------------------------------------------------------- store paths, in the worker processes

def _barrier(raw, name: str, count: int, world: int) -> None:
    """All W ranks (this process's `count` threads at once) start the next path together; not counted."""
    if raw.add(f"sync/{name}", count) == world:
        raw.set(f"sync/{name}/go", "1")
    raw.wait([f"sync/{name}/go"], timedelta(seconds=600))


def _run_path(name: str, rank: int, world: int, store, handoff_s: float, run_dir: str) -> None:
    """One rank's part of a store path, through the project's own functions; `run_dir` gets the failure's files."""
    import finetune.launch as launch
    from common import handoff
    from finetune.hang import CHECK_S, HangWatchdog
    if name == "bad_input":
        reached = launch._count_in(store)
        if rank == 0:
            launch._wait_for_every_rank(store, reached, launch.BAD_INPUT_WAIT_S)
            launch._tell(store, launch._reported_key())
        else:
            assert launch._seen_within(store, launch._reported_key(), launch.BAD_INPUT_WAIT_S)
    elif name == "failure_key":
        dog = HangWatchdog(60.0, rank, world, run_dir, None, store)
        if rank == 0:
            dog.failed(RuntimeError("simulated failure"))
            dog._failure()  # its own failure: None, one check
        else:
            while dog._failure() is None:  # the watchdog's check, at its cadence
                time.sleep(CHECK_S)
    elif name == "handoff":
        keys = {k: f"one_rank_builds/sim/1/{k}" for k in ("done", "beat", "who")}
        if rank == 0:
            handoff._build_and_tell(lambda: (time.sleep(handoff_s), "built")[1], store, keys, 120.0 / 6, RuntimeError)
        else:
            # one_rank_builds' waiter (its per-process key count would give each thread here its own keys)
            waiting = handoff._Waiting(store, keys["beat"], "the simulated cache", RuntimeError, 2.0, 120.0, 60.0,
                                       lambda line: None, rank)
            waiting.until(lambda: store.check([keys["done"]]), lambda: "rank 0 stopped", "waiting for rank 0")
            assert json.loads(store.get(keys["done"])) == {"ok": "built"}


def worker(port: int, world: int, first: int, count: int, handoff_s: float) -> None:
    """`count` ranks from `first` as threads, each with its own store connection; one JSON line per path."""
    import torch.distributed as dist
    from store_count import CountingStore
    os.environ["WORLD_SIZE"] = str(world)  # launch.launch_world(): how many ranks rank 0 waits for
    raw = dist.TCPStore("127.0.0.1", port, world, False, timeout=timedelta(seconds=600))
    t0 = time.perf_counter()
    stores = [CountingStore(dist.TCPStore("127.0.0.1", port, world, False, timeout=timedelta(seconds=600)))
              for _ in range(count)]
    print("CONNECT " + json.dumps({"first": first, "seconds": time.perf_counter() - t0}), flush=True)
    sys.stderr = open(os.devnull, "w")  # the failure path's `error:` line, once per simulated failure
    run_dir = tempfile.mkdtemp(prefix="scale_coord-")  # the failure path writes its traceback under <run.dir>/hang
    for name in STORE_PATHS:
        _barrier(raw, name, count, world)
        before = [s.totals() for s in stores]
        ends, errors = [0.0] * count, []
        start = time.perf_counter()

        def one(i: int) -> None:
            try:
                _run_path(name, first + i, world, stores[i], handoff_s, run_dir)
            except BaseException as e:  # noqa: BLE001 - counted and reported: the row then says the path failed
                errors.append(f"rank {first + i}: {type(e).__name__}: {e}")
            ends[i] = time.perf_counter()
        threads = [threading.Thread(target=one, args=(i,)) for i in range(count)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        per = [{k: s.totals()[k] - b[k] for k in ("requests", "bytes")} for s, b in zip(stores, before)]
        print("PATH " + json.dumps({"path": name, "first": first, "per_rank": per, "errors": errors,
                                    "seconds": max(ends) - start}), flush=True)
    shutil.rmtree(run_dir, ignore_errors=True)


def store_paths(world: int, procs: int, handoff_s: float) -> dict:
    """Every store path at W: per path, per-rank requests and bytes, and the seconds of the slowest process."""
    import torch.distributed as dist
    server = dist.TCPStore("127.0.0.1", 0, world, True, timeout=timedelta(seconds=600), use_libuv=True,
                           wait_for_workers=False)
    procs = min(procs, world)
    spans = [(world * i // procs, world * (i + 1) // procs - world * i // procs) for i in range(procs)]
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    workers = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker",
                                 f"{server.port},{world},{first},{count},{handoff_s}"], env=env,
                                stdout=subprocess.PIPE, text=True) for first, count in spans]
    lines = []
    for p in workers:
        out, _ = p.communicate(timeout=1800)
        if p.returncode != 0:
            raise RuntimeError(f"a store worker at W={world} exited {p.returncode}")
        lines += out.splitlines()
    result = {"connect_s": max(json.loads(x[8:])["seconds"] for x in lines if x.startswith("CONNECT "))}
    for name in STORE_PATHS:
        parts = sorted((json.loads(x[5:]) for x in lines if x.startswith("PATH ") and f'"path": "{name}"' in x),
                       key=lambda r: r["first"])
        per_rank = [r for part in parts for r in part["per_rank"]]
        errors = [e for part in parts for e in part["errors"]]
        result[name] = {"requests": [r["requests"] for r in per_rank], "bytes": [r["bytes"] for r in per_rank],
                        "seconds": max(part["seconds"] for part in parts), "errors": len(errors),
                        "first_error": errors[0] if errors else None}
    return result


# ---------------------------------------------------------------- DCP plans, in this process

def shapes(model: str) -> dict[str, tuple[int, ...]]:
    """Every weight of the Llama model (name -> shape) from its published config."""
    with open(os.path.join(ROOT, "assets", MODELS[model], "config.json")) as f:
        c = json.load(f)
    h, i, v, kv = c["hidden_size"], c["intermediate_size"], c["vocab_size"], c["num_key_value_heads"] * c["head_dim"]
    out = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,), "lm_head.weight": (v, h)}
    for n in range(c["num_hidden_layers"]):
        p = f"model.layers.{n}."
        out.update({p + "self_attn.q_proj.weight": (h, h), p + "self_attn.k_proj.weight": (kv, h),
                    p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, h),
                    p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                    p + "mlp.down_proj.weight": (h, i), p + "input_layernorm.weight": (h,),
                    p + "post_attention_layernorm.weight": (h,)})
    return out


def sharded(model: str) -> list[tuple[str, tuple[int, ...]]]:
    """The checkpoint's sharded tensors: each weight and its two AdamW moments."""
    return [(f"{prefix}{name}{suffix}", shape) for name, shape in shapes(model).items()
            for prefix, suffix in (("model.", ""), ("optim.state.", ".exp_avg"), ("optim.state.", ".exp_avg_sq"))]


def _shard(shape: tuple, rank: int, world: int):
    import torch
    rows = math.ceil(shape[0] / world)
    lo = min(rank * rows, shape[0])
    return torch.Size([lo, *[0] * (len(shape) - 1)]), torch.Size([min(rows, shape[0] - lo), *shape[1:]])


def local_save_plans(tensors, world: int) -> list:
    import torch
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType
    props = TensorProperties(dtype=torch.float32)
    plans = []
    for r in range(world):
        items = []
        for fqn, shape in tensors:
            offsets, sizes = _shard(shape, r, world)
            items.append(WriteItem(index=MetadataIndex(fqn, offsets), type=WriteItemType.SHARD, tensor_data=TensorWriteData(
                chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes), properties=props, size=torch.Size(shape))))
        # planner_data: the flattened key -> state-dict path mapping DefaultSavePlanner's local plan carries
        plans.append(SavePlan(items, planner_data={fqn: tuple(fqn.split(".", 1)) for fqn, _ in tensors}))
    return plans


def local_load_plans(tensors, world: int) -> list:
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem
    plans = []
    for r in range(world):
        items = []
        for fqn, shape in tensors:
            offsets, sizes = _shard(shape, r, world)
            index = MetadataIndex(fqn, offsets)
            items.append(ReadItem(type=LoadItemType.TENSOR, dest_index=index, dest_offsets=offsets * 0,
                                  storage_index=index, storage_offsets=offsets * 0, lengths=sizes))
        plans.append(LoadPlan(items))
    return plans


def rank0_plan_step(local_plans: list, plan) -> dict:
    """What rank 0 does between DCP's gather and scatter: unpickle W plans, plan, pickle W results; its bytes."""
    blobs = [pickle.dumps(p) for p in local_plans]
    gathered = len(blobs) * max(map(len, blobs))  # gloo's gather_object pads every object to the largest
    del local_plans
    gc.collect()
    t0 = time.perf_counter()
    plans = [pickle.loads(b) for b in blobs]
    del blobs
    global_plans = plan(plans)
    out = [pickle.dumps(p) for p in global_plans]
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "gathered_bytes": gathered, "scattered_bytes": sum(map(len, out)),
            "items": sum(len(p.items) for p in plans)}


def project_save_plan(name: str):
    """Rank 0's global step with the save planner the project configures (a first save)."""
    from ckpt.uploader import save_planner
    return lambda plans: save_planner(name, None).create_global_plan(plans)[0]


def torch_save_plan(plans):
    """The same with torch's DefaultSavePlanner as it comes (the comparison at --layer-worlds)."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    return DefaultSavePlanner()._create_global_plan(plans)[0]


def dcp_plans(model: str, world: int) -> dict:
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    tensors = sharded(model)
    save = rank0_plan_step(local_save_plans(tensors, world), project_save_plan(f"/scale-sim/{model}/{world}"))
    gc.collect()
    load = rank0_plan_step(local_load_plans(tensors, world), DefaultLoadPlanner().create_global_plan)
    gc.collect()
    return {"tensors": len(tensors), "save": save, "load": load}


def layer_plans(model: str, world: int) -> dict:
    """Rank 0's save plan step for one decoder layer's tensors (layer 0: 9 weights and their moments) at `world`,
    with the project's planner and with torch's."""
    tensors = [(k, s) for k, s in sharded(model) if ".layers.0." in k]
    out = {"tensors": len(tensors)}
    project = project_save_plan(f"/scale-sim/{model}/layer/{world}")
    for name, plan in (("save", project), ("torch_save", torch_save_plan)):
        out[name] = rank0_plan_step(local_save_plans(tensors, world), plan)
        gc.collect()
    return out


# ---------------------------------------------------------------- rows

FORMULAS = {
    "bad_input": ("bad-input report: count in, rank 0 waits for all, the others poll for its verdict "
                  "(finetune/launch.py)", "on failure",
                  "1 add + 1 check per 0.1 s per rank until rank 0 tells (10W r/s); W store connections"),
    "failure_key": ("job failure key: the failing rank publishes, every watchdog checks once per CHECK_S "
                    "(finetune/hang.py failed, _failure)", "on failure",
                    "2 on the failing rank; each rank 1 check per CHECK_S = 1 s, + 1 get once it is set: W r/s"),
    "handoff": ("data-cache handoff: rank 0 builds, the others poll (common/handoff.py)", "at start",
                "waiters: 1 check per 2 s + 1 add per 40 s = ~0.53 (W-1) r/s during the build; builder 1 add per 20 s"),
}


def store_rows(world: int, m: dict) -> list[dict]:
    rows = []
    for name in STORE_PATHS:
        path, when, formula = FORMULAS[name]
        req, nbytes = m[name]["requests"], m[name]["bytes"]
        failed = (f"FAILED on {m[name]['errors']} ranks (first: {m[name]['first_error']}); figures up to the failure; "
                  if m[name]["errors"] else "")
        rows.append({"path": path, "when": when, "formula": formula, "W": world, "N": world // RANKS_PER_NODE,
                     "requests_per_rank": sum(req) / world, "requests_total": sum(req),
                     "bytes_per_rank": sum(nbytes) / world, "bytes_total": sum(nbytes),
                     "busiest_share": 1.0, "seconds": m[name]["seconds"],
                     "note": failed + "measured: W TCPStore clients (threads) against one libuv TCPStore server; busiest: "
                             f"the store's server (every request); busiest rank {max(req)} requests"})
    return rows


def nonnegative_fit(ws, secs) -> tuple[float, float]:
    """(a, b) of secs ~ a W + b W^2, neither negative (timings on a shared machine are noisy): the least-squares
    fit if both come out >= 0, else the better of a W alone and b W^2 alone."""
    import numpy as np
    both = np.linalg.lstsq(np.stack([ws, ws ** 2], 1), secs, rcond=None)[0]
    if min(both) >= 0:
        return float(both[0]), float(both[1])
    a, b = float(ws @ secs / (ws @ ws)), float(ws ** 2 @ secs / (ws ** 2 @ ws ** 2))
    return (a, 0.0) if np.sum((a * ws - secs) ** 2) <= np.sum((b * ws ** 2 - secs) ** 2) else (0.0, b)


def plan_rows(model: str, world: int, plans: dict, layers: dict | None = None) -> list[dict]:
    """The save and load plan rows at `world`: measured there, or fitted on the measured worlds (bytes: c x W, as the
    plans hold T x W items; seconds: a W + b W^2 on the whole-model points and `layers`' one-layer points scaled by
    T / their tensors, so that a term quadratic in W shows at the larger W they reach)."""
    import numpy as np
    rows = []
    for kind, when, what in (("save", "per checkpoint", "DCP save plan (first save; cached after)"),
                             ("load", "on resume", "DCP load plan (every resume; model load too)")):
        pts = sorted((w, m[kind]) for w, m in plans.items())
        if world in plans:
            x, how = plans[world][kind], "measured"
        else:
            t = plans[pts[0][0]]["tensors"]
            extra = sorted((w, m[kind]["seconds"] * t / m["tensors"]) for w, m in (layers or {}).items() if kind in m)
            ws = np.array([w for w, _ in pts] + [w for w, _ in extra], dtype=float)
            per_w = {k: float(np.mean([m[k] / w for w, m in pts])) for k in ("gathered_bytes", "scattered_bytes", "items")}
            a, b = nonnegative_fit(ws, np.array([m["seconds"] for _, m in pts] + [s for _, s in extra]))
            x = {k: v * world for k, v in per_w.items()} | {"seconds": float(a * world + b * world ** 2)}
            scaled = (f" (and one layer's tensors at W={','.join(str(w) for w, _ in extra)}, seconds x T/"
                      f"{layers[extra[0][0]]['tensors']})" if extra else "")
            how = (f"extrapolated from W={','.join(str(w) for w, _ in pts)} measured{scaled}"
                   + f": bytes and items x W, seconds {a:.3g} W + {b:.3g} W^2 (least squares)")
        gathered, scattered = x["gathered_bytes"], x["scattered_bytes"]
        rows.append({"path": f"{what} at {model}: gather W local plans to rank 0, global plan, scatter",
                     "when": when, "formula": f"T x W items on rank 0 (T = {plans[pts[0][0]]['tensors']} sharded "
                                              "tensors); bytes ~ T x W; seconds a W + b W^2",
                     "W": world, "N": world // RANKS_PER_NODE, "requests_per_rank": None, "requests_total": None,
                     "bytes_per_rank": (gathered + scattered) / world, "bytes_total": gathered + scattered,
                     "busiest_share": 1.0,  # every plan byte goes to or from rank 0
                     "seconds": x["seconds"],
                     "note": f"{how}; rank 0: {x['items']:.0f} items, gathered {gathered / 1e6:.1f} MB (padded), "
                             f"scattered {scattered / 1e6:.1f} MB; seconds = rank 0's unpickle + plan + pickle"})
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worlds", default="64,256,1024,2048")
    p.add_argument("--out", help="the section's JSON (required but for --worker)")
    p.add_argument("--procs", type=int, default=8, help="worker processes the W store clients are spread over")
    p.add_argument("--handoff-s", type=float, default=6.0, help="how long the simulated data-cache build takes")
    p.add_argument("--plan-worlds", default="16,32,64", help="W whose DCP plans are built and timed (the rest fitted)")
    p.add_argument("--layer-worlds", default="256,1024",
                   help="W whose save plan is timed for one layer's tensors ('' for none): the fit's larger W")
    p.add_argument("--plan-only", action="store_true", help="only the DCP plans (no store paths)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        port, world, first, count, handoff_s = args.worker.split(",")
        worker(int(port), int(world), int(first), int(count), float(handoff_s))
        return
    started = provenance.start(argv)
    worlds = [int(w) for w in args.worlds.split(",")]
    measured, rows = {"store": {}, "plans": {}}, []
    for w in ([] if args.plan_only else worlds):
        m = measured["store"][w] = store_paths(w, args.procs, args.handoff_s)
        rows += store_rows(w, m)
        print(f"W={w}: store paths measured ({m['connect_s']:.1f} s to connect)", flush=True)
    for model in MODELS:
        plans = {w: dcp_plans(model, w) for w in map(int, args.plan_worlds.split(","))}
        layers = {w: layer_plans(model, w) for w in map(int, filter(None, args.layer_worlds.split(",")))}
        measured["plans"][model] = plans
        measured.setdefault("layer_plans", {})[model] = layers
        for w in worlds:
            rows += plan_rows(model, w, plans, layers)
        print(f"{model}: plans measured at W={list(plans)}; one layer at W={list(layers)}: "
              + ", ".join(f"{w}: {m['save']['seconds']:.2f} s (torch's {m['torch_save']['seconds']:.2f} s)"
                          for w, m in layers.items()), flush=True)
    for m in measured["store"].values():  # the per-rank lists stay in the rows' sums: keep the file small
        for name in STORE_PATHS:
            m[name]["max_rank_requests"] = max(m[name].pop("requests"))
            m[name]["max_rank_bytes"] = max(m[name].pop("bytes"))
    result = {"rows": rows, "measured": measured, "provenance": provenance.provenance(started)}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()

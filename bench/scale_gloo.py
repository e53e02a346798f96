"""Store traffic of the job's gloo groups: counted at W = 2..4 real processes, fitted, extrapolated to W = 2048.

    python bench/scale_gloo.py --worlds 64,256,1024,2048 --out /tmp/scale_gloo.json   # bench/scale_sim.py runs it
    python bench/scale_gloo.py --measure 2,4 --worlds 64 --out /tmp/g.json     # seconds, for a smoke test

One section of bench/scale_sim.py (its row contract). Each measured world: a real TCPStore server in this process
(libuv, as torchrun's agent hosts it; TORCHELASTIC_USE_AGENT_STORE=True so no rank hosts it) and W worker processes
that run the project's own start-up: train_fsdp.init_distributed (the default group; gloo on CPU, the gloo half
of "cpu:gloo,cuda:nccl" on CUDA), ckpt.manager.checkpoint_groups for the disk tier and again for the memory tier
(2 + 2 groups), then a first save's collectives: a real dcp.save on the save group and first_problem's all-reduce
on the agreement group. Each worker's store is wrapped in bench/store_count.py's CountingStore, so every request
gloo and c10d make is counted with its payload bytes. Run once with TORCH_GLOO_LAZY_INIT=0 (gloo connects every
pair when a group is made: each rank sets one key of 8W + ~150 bytes, then waits for and gets all W keys) and once
with =1 (each rank sets one short key; a pair connects, with one wait + get, when a collective first uses it).

Rows above the measured worlds are extrapolated: least-squares fits of the measured totals (requests on W and W^2
eager, W and W log2 W lazy; bytes on W, W^2, W^3 eager), stated per row, with the fit's largest relative error on
the measured points. Seconds are not extrapolated (None): the store's request rate at W=2048 is
bench/scale_coord.py's to measure. The uploader world (ckpt.async_mode=process) is one more group, made at the
first save, on a store rank 0's training process hosts: the per-group figures apply to it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import provenance  # noqa: E402 - bench/provenance.py, beside this script

MEMORY_TIER_GROUPS = 2  # checkpoint_groups again for the memory tier (ckpt/memory_tier/tier.py)
PHASES = ("init", "ckpt_groups", "memory_groups", "first_save")


def worker(ckpt_dir: str) -> None:
    """One rank (RANK, WORLD_SIZE, MASTER_* in the environment): the project's start-up and a first save's
    collectives, printing its counted store traffic after each phase as one JSON line."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from store_count import CountingStore
    import train_fsdp
    from ckpt.manager import checkpoint_groups
    from common.dist import first_problem
    counted = {}
    rendezvous = dist.rendezvous

    def counting_rendezvous(*args, **kwargs):  # init_distributed's store, wrapped before its PrefixStore
        store, rank, world = next(rendezvous(*args, **kwargs))
        counted["store"] = CountingStore(store)
        yield counted["store"], rank, world
    dist.rendezvous = counting_rendezvous
    out = {}
    timeout = train_fsdp.collective_timeout(2)
    train_fsdp.init_distributed(timeout)
    out["init"] = counted["store"].totals()
    save_pg, agree_pg = checkpoint_groups(timeout)
    out["ckpt_groups"] = counted["store"].totals()
    checkpoint_groups(timeout)
    out["memory_groups"] = counted["store"].totals()
    dcp.save({"w": torch.full((4,), float(dist.get_rank()))}, checkpoint_id=ckpt_dir, process_group=save_pg)
    first_problem(None, agree_pg)
    out["first_save"] = counted["store"].totals()
    print("COUNTS " + json.dumps({"rank": dist.get_rank(), **out}), flush=True)
    dist.destroy_process_group()


def measure(world: int, lazy: str | None) -> dict:
    """Per phase: store requests and bytes summed over the ranks, and rank 0's, at this W (real processes).
    `lazy`: TORCH_GLOO_LAZY_INIT for the workers; None: as this process has it (unset: the project's default)."""
    import torch.distributed as dist
    from datetime import timedelta
    store = dist.TCPStore("127.0.0.1", 0, world, True, timeout=timedelta(seconds=120), use_libuv=True,
                          wait_for_workers=False)
    work = tempfile.mkdtemp(prefix="scale-gloo-")
    env = dict(os.environ, WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port),
               TORCHELASTIC_USE_AGENT_STORE="True", OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    if lazy is not None:
        env["TORCH_GLOO_LAZY_INIT"] = lazy
    t0 = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", work],
                              env=dict(env, RANK=str(r), LOCAL_RANK=str(r)), stdout=subprocess.PIPE, text=True)
             for r in range(world)]
    ranks = []
    for p in procs:
        stdout, _ = p.communicate(timeout=600)
        if p.returncode != 0:
            raise RuntimeError(f"a worker at W={world} exited {p.returncode}")
        ranks += [json.loads(line[7:]) for line in stdout.splitlines() if line.startswith("COUNTS ")]
    wall = time.perf_counter() - t0
    ranks.sort(key=lambda r: r["rank"])
    phases = {}
    for i, ph in enumerate(PHASES):  # each phase's own traffic: the cumulative counts minus the phase before
        def own(r, what):
            return r[ph][what] - (r[PHASES[i - 1]][what] if i else 0)
        phases[ph] = {"requests": sum(own(r, "requests") for r in ranks), "bytes": sum(own(r, "bytes") for r in ranks),
                      "rank0_requests": own(ranks[0], "requests"), "rank0_bytes": own(ranks[0], "bytes"),
                      "max_rank_requests": max(own(r, "requests") for r in ranks)}
    return {"world": world, "lazy": lazy, "wall_s": wall, "phases": phases}


def fit(points: list[tuple[int, float]], basis) -> tuple[list[float], float]:
    """Least-squares coefficients of `basis(W)` through (W, value) points, and the largest relative error on them."""
    import numpy as np
    a = np.array([basis(w) for w, _ in points], dtype=float)
    y = np.array([v for _, v in points], dtype=float)
    coef = np.linalg.lstsq(a, y, rcond=None)[0]
    err = max(abs(float(a[i] @ coef) - y[i]) / max(abs(y[i]), 1.0) for i in range(len(y)))
    return [float(c) for c in coef], err


BASES = {  # (what the formula says, basis) per mode and quantity; W terms only: every total is 0 at W=0
    ("0", "requests"): ("a W + b W^2", lambda w: [w, w * w]),
    ("0", "bytes"): ("a W + b W^2 + c W^3", lambda w: [w, w * w, w ** 3]),
    ("1", "requests"): ("a W + b W log2 W", lambda w: [w, w * math.log2(w)]),
    ("1", "bytes"): ("a W + b W log2 W", lambda w: [w, w * math.log2(w)]),
}


def formula(mode: str, what: str, coef: list[float]) -> str:
    terms = {"0": ["W", "W^2", "W^3"], "1": ["W", "W log2 W"]}[mode]
    return " + ".join(f"{c:.3g} {t}" for c, t in zip(coef, terms) if abs(c) > 1e-9) or "0"


def rows_for(measured: list[dict], worlds: list[int]) -> list[dict]:
    """The section's rows: per mode, (a) the groups made at start, (b) the first save's collectives, (c) one more
    group (the uploader world), each fitted on the measured W and evaluated at `worlds`."""
    rows = []
    small = sorted({m["world"] for m in measured})
    for mode, label in (("0", "eager (TORCH_GLOO_LAZY_INIT=0)"), ("1", "lazy (TORCH_GLOO_LAZY_INIT=1)")):
        runs = [m for m in measured if m["lazy"] == mode]
        paths = (
            ("at start", f"gloo groups at start, {label}: default group + 2 checkpoint + 2 memory-tier groups",
             ("init", "ckpt_groups", "memory_groups"), 1.0),
            ("per checkpoint", f"first save's gloo collectives (DCP plan/finish, agreement), {label}",
             ("first_save",), 1.0),
            ("per checkpoint", f"process-mode uploaders' gloo world, made at the first save (and after an uploader "
             f"restart), {label}; on a store rank 0 hosts", ("ckpt_groups",), 0.5))
        for when, path, phases, scale in paths:
            def total(m, what):
                return scale * sum(m["phases"][p][what] for p in phases)
            fits = {what: fit([(m["world"], total(m, what)) for m in runs], BASES[(mode, what)][1])
                    for what in ("requests", "bytes")}
            for w in worlds:
                req = sum(c * b for c, b in zip(fits["requests"][0], BASES[(mode, "requests")][1](w)))
                nbytes = sum(c * b for c, b in zip(fits["bytes"][0], BASES[(mode, "bytes")][1](w)))
                rows.append({
                    "path": path, "when": when,
                    "formula": f"requests {formula(mode, 'requests', fits['requests'][0])}; "
                               f"bytes {formula(mode, 'bytes', fits['bytes'][0])}",
                    "W": w, "N": w // 8, "requests_per_rank": req / w, "requests_total": req,
                    "bytes_per_rank": nbytes / w, "bytes_total": nbytes,
                    "busiest_share": 1.0,  # the store's server thread serves every request
                    "seconds": None,
                    "note": (f"extrapolated: least-squares fit of W={','.join(map(str, small))} measured (real "
                             f"processes, counted store); fit's largest error on them "
                             f"{max(fits['requests'][1], fits['bytes'][1]):.1%}; busiest: the store's server; "
                             "seconds not extrapolated")})
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worlds", default="64,256,1024,2048", help="W to extrapolate to, comma-separated")
    p.add_argument("--measure", default="2,3,4", help="W to run as real processes, comma-separated")
    p.add_argument("--out", help="the section's JSON (required but for --worker)")
    p.add_argument("--worker", metavar="CKPT_DIR", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args.worker)
        return
    started = provenance.start(argv)
    measured = [measure(w, lazy) for lazy in ("0", "1") for w in map(int, args.measure.split(","))]
    rows = rows_for(measured, [int(w) for w in args.worlds.split(",")])
    result = {"rows": rows, "measured": measured, "provenance": provenance.provenance(started)}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    for m in measured:
        print(f"W={m['world']} lazy={m['lazy']}: " + ", ".join(
            f"{ph} {v['requests']} req {v['bytes']} B" for ph, v in m["phases"].items()))


if __name__ == "__main__":
    main()

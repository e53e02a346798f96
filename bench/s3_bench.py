"""Object-store benchmark: our checkpoint save (committed) and resume (verify + load) on an object store (`--store`,
s3 by default) against the local file system, side by side on the bench model (bench/ckpt_bench.py's default
size), methods interleaved over rounds.

    python bench/s3_bench.py                                   # ~190M params, 2 ranks, moto's S3 server on 127.0.0.1
    python bench/s3_bench.py --hidden 256 --layers 2 --vocab 1000 --rounds 3 --out /tmp/s3b   # a smoke test
    python bench/s3_bench.py --store az                        # Azure Blob: Azurite on 127.0.0.1 (npm azurite)
    AWS_ENDPOINT_URL=... python bench/s3_bench.py --bucket my-bucket --prefix bench   # a real S3-compatible store

Without --bucket it starts the store's test emulator (STORES: the tests' own, e.g. tests/s3_server.py's moto) in
127.0.0.1 (moto in this process, Azurite as its own) and launches itself under torchrun (2 ranks, gloo): each round saves with
CheckpointManager (sync, so committed_s is the whole save) to a local folder and to the store, in alternating
order, then resumes each (verify, every rank its share, then dcp.load through the backend's reader). Per method:
median and min-max over the rounds after the first (warm-up), and the ratios store / local. On one machine the
store's figures are the emulator's own cost (moto parses and stores every request in Python, in this process; Azurite in Node.js)
plus loopback HTTP, never a network: relative figures that bound the client side's overhead, not what a real
bucket would do (docs/performance.md has that arithmetic, per store).
Writes <out>/<store>_bench.{json,md}, keeps the run under <out>/runs/<store>_bench/ (bench/provenance.py).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))  # the stores' test emulators (STORES)
from common.dist import free_port  # noqa: E402 - after the path insert

import provenance  # noqa: E402 - bench/provenance.py, beside this script

# --store -> how to name it, and its test emulator: a module in tests/ whose start_server() returns (server, env)
# with the emulator running on 127.0.0.1 and holding the bucket (container) BUCKET, and stop_server(server);
# `server` names the emulator. Another object-store backend plugs in here with its emulator module.
STORES = {
    "s3": {"name": "S3", "emulator": "s3_server", "server": lambda: f"moto {importlib.metadata.version('moto')}, in the benchmark's process"},
    "az": {"name": "Azure Blob", "emulator": "azurite_server",
           "server": lambda: "Azurite " + subprocess.run(["azurite-blob", "--version"], capture_output=True,
                                                         text=True).stdout.strip() + ", a separate process"},
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=10)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5, help="saves and resumes per method (the first is warm-up)")
    p.add_argument("--store", choices=sorted(STORES), default="s3", help="the object store's URL scheme")
    p.add_argument("--bucket", default=None, help="an existing bucket (container) at the store's endpoint, taken "
                   "the standard way (S3: AWS_ENDPOINT_URL); default: start the store's test emulator")
    p.add_argument("--prefix", default="s3-bench", help="key prefix for the benchmark's checkpoints")
    p.add_argument("--work-dir", default=None, help="where local checkpoints go (default: a temp dir)")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ---------------------------------------------------------------- worker side (under torchrun)

def timed_save(mgr, state: dict, step: int, events: list) -> dict:
    """One sync save through CheckpointManager: until committed, then its retention (keep_last=1) in the background,
    waited for and not counted."""
    start = len(events)
    t0 = time.perf_counter()
    mgr.save(step, state, {"meta.json": json.dumps({"step": step, "world_size": mgr.world_size})}, blocking=True)
    committed = time.perf_counter() - t0
    mgr.wait()
    saved = next(kw for name, kw in events[start:] if name == "checkpoint")
    return {"committed_s": committed, "upload_s": saved["upload_s"]}


def timed_resume(mgr, state: dict) -> dict:
    """The newest checkpoint verified by all ranks (each its share), then loaded."""
    t0 = time.perf_counter()
    path = mgr.choose_checkpoint("auto")
    verified = time.perf_counter() - t0
    mgr.load(path, state)
    return {"verify_s": verified, "load_s": time.perf_counter() - t0 - verified, "resume_s": time.perf_counter() - t0}


def worker(args) -> None:
    import torch.distributed as dist

    import ckpt_bench  # bench/ckpt_bench.py: the same model, built and sharded the same way
    from ckpt import CheckpointManager, ModelOptimizer
    from ckpt.storage import join, storage_for

    dist.init_process_group("gloo")
    model, optim, device = ckpt_bench.build(args, args.work_dir)
    ckpt_bench.train_steps(model, optim, device, 1, args.seq_len, args.vocab)  # AdamW state exists
    events: list = []
    methods = ("local", args.store)
    dirs = {"local": os.path.join(args.work_dir, "ckpt"), args.store: f"{args.store}://{args.bucket}/{args.prefix}"}
    managers = {m: CheckpointManager(dirs[m], async_mode="off", keep_last=1,
                                     on_event=lambda name, **kw: events.append((name, kw))) for m in methods}
    state = {"app": ModelOptimizer(model, optim)}
    rows = []
    for r in range(args.rounds):
        for method in methods if r % 2 == 0 else reversed(methods):  # interleaved: drift hits both alike
            row = {"round": r, "method": method, **timed_save(managers[method], state, r + 1, events)}
            row.update(timed_resume(managers[method], state))
            path = join(dirs[method], f"step-{r + 1:06d}")
            row["bytes"] = sum(storage_for(path).sizes(path).values())
            rows.append(row)
    for mgr in managers.values():
        mgr.close()
    if dist.get_rank() == 0:
        with open(os.path.join(args.work_dir, "result.json"), "w") as f:
            json.dump({"rows": rows, "world_size": dist.get_world_size(),
                       "params": sum(p.numel() for p in model.parameters())}, f)
    dist.destroy_process_group()


# ---------------------------------------------------------------- driver side

def start_emulator(store: str):
    """(stop, env, bucket): the store's test emulator on 127.0.0.1 (STORES), and what stops it."""
    emulator = importlib.import_module(STORES[store]["emulator"])
    try:
        server, env = emulator.start_server()
    except RuntimeError as e:  # not installed, or it did not start
        sys.exit(f"error: {e}")
    return (lambda: emulator.stop_server(server)), env, emulator.BUCKET


def real_store(store: str, bucket: str) -> str:
    """The endpoint and bucket a run against a store of one's own goes to, as the backend names them."""
    from ckpt.storage import storage_for

    url = f"{store}://{bucket}"
    return storage_for(url).location(url)


def launch(args, work: str, env: dict) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.nproc), "--master_addr",
           "127.0.0.1", "--master_port", str(free_port()), os.path.abspath(__file__), "--worker", "--work-dir", work,
           "--hidden", str(args.hidden), "--layers", str(args.layers), "--vocab", str(args.vocab), "--seq-len",
           str(args.seq_len), "--rounds", str(args.rounds), "--store", args.store, "--bucket", args.bucket,
           "--prefix", args.prefix]
    subprocess.run(cmd, check=True, cwd=ROOT, env={**os.environ, **env, "OMP_NUM_THREADS": "1"})
    with open(os.path.join(work, "result.json")) as f:
        return json.load(f)


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarize(raw: dict, store: str, server: str) -> dict:
    measured = [row for row in raw["rows"] if row["round"] > 0] or raw["rows"]  # round 0: warm-up
    keys = ("committed_s", "upload_s", "verify_s", "load_s", "resume_s")
    methods = ("local", store)
    per = {m: {k: spread([row[k] for row in measured if row["method"] == m]) for k in keys} for m in methods}
    for m in methods:
        per[m]["bytes"] = max(row["bytes"] for row in raw["rows"] if row["method"] == m)
    ratio = {k: per[store][k]["median"] / per["local"][k]["median"] for k in ("committed_s", "resume_s")}
    return {"world_size": raw["world_size"], "params": raw["params"], "rounds_measured": len(measured) // 2,
            "store": store, "server": server, "methods": per, f"{store}_over_local": ratio, "rows": raw["rows"]}


def to_markdown(result: dict) -> list[str]:
    store, name = result["store"], STORES[result["store"]]["name"]
    lines = [provenance.markdown_line(result), "",
             f"{result['params'] / 1e6:.0f}M params, {result['world_size']} ranks, {result['rounds_measured']} rounds "
             f"measured; {name} server: {result['server']}", "",
             "| method | save, committed (s) | resume: verify + load (s) | verify (s) | load (s) | MiB |",
             "|---|---|---|---|---|---|"]
    for m in ("local", store):
        p = result["methods"][m]
        cell = lambda k: f"{p[k]['median']:.2f} ({p[k]['min']:.2f}-{p[k]['max']:.2f})"  # noqa: E731
        lines.append(f"| {m} | {cell('committed_s')} | {cell('resume_s')} | {cell('verify_s')} | {cell('load_s')} | "
                     f"{p['bytes'] / 2**20:.0f} |")
    r = result[f"{store}_over_local"]
    lines += ["", f"{name} / local (medians): save {r['committed_s']:.2f}x, resume {r['resume_s']:.2f}x"]
    return lines


def main(argv=None):
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    started = provenance.start(argv)
    work = args.work_dir or tempfile.mkdtemp(prefix="s3-bench-")
    stop, env, emulated = (None, {}, None) if args.bucket else start_emulator(args.store)
    args.bucket = args.bucket or emulated
    try:
        raw = launch(args, work, env)
    finally:
        if stop is not None:
            stop()
        if not args.work_dir:
            shutil.rmtree(work, ignore_errors=True)
    what = f"{STORES[args.store]['server']()}, on 127.0.0.1" if stop else \
        real_store(args.store, args.bucket)
    name = f"{args.store}_bench"
    result = provenance.record(summarize(raw, args.store, what), name, args.out, started)
    provenance.write_markdown(args.out, name, to_markdown(result))


if __name__ == "__main__":
    main()

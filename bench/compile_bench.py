"""model.compile: training tokens/s with each decoder block compiled (inductor) against eager, side by side.

    python bench/compile_bench.py                       # ckpt_bench's default model (~190M params), 2 ranks, CPU
    python bench/compile_bench.py --nproc 8 --batch 8 --seq-len 2048   # on a GPU node (CUDA where present)
    python bench/compile_bench.py --hidden 64 --layers 2 --vocab 256 --rounds 2 --steps 2 --out /tmp/cb  # smoke

Launches itself under torchrun. Each rank builds the model once, sharded like train_fsdp.py with model.compile=true
(fp32 on CPU, bf16 compute on CUDA), and trains it with train_fsdp.train_step on random tokens; the eager rounds run
the same model under `torch.compiler.set_stance("force_eager")` (the compiled blocks run their plain Python), so both
ways share the parameters, the memory and the machine's state. Warm-up: one eager step, then the first compiled
step, which compiles (inductor's cache is a fresh folder, so this is the cost a first run pays; --warm-cache uses
the default one). Then interleaved rounds, eager first in even rounds and compiled first in odd ones, --steps steps
each.
Reports tokens/s (all ranks) per way as median and min-max over rounds, their ratio, the compile time (first
compiled step minus the median compiled step) apart from the steady throughput, and the steps after which the
compile has paid for itself (compile time / the median step time it saves). Writes
bench/results/compile_bench.{json,md} and keeps the run under bench/results/runs/ (bench/provenance.py).
"""

from __future__ import annotations

import argparse
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
import provenance  # noqa: E402 - bench/provenance.py, beside this script

SIZE_ARGS = ("hidden", "layers", "vocab", "batch", "seq_len", "rounds", "steps")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=1024, help="as bench/ckpt_bench.py's default model")
    p.add_argument("--layers", type=int, default=10)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--batch", type=int, default=4, help="sequences per rank per step (one micro batch)")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds; each runs both ways")
    p.add_argument("--steps", type=int, default=3, help="optimizer steps per way per round")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--warm-cache", action="store_true", help="keep inductor's default cache (compile time: a rerun's)")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    p.add_argument("--work-dir", default=None, help=argparse.SUPPRESS)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ---------------------------------------------------------------- worker side (under torchrun)

def build(args, work: str, device):
    """The bench Llama with model.compile=true, fully_shard-ed as train_fsdp.py does, and fused AdamW."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import LlamaConfig

    from finetune.config import ModelConfig
    from finetune.model import build_sharded_model, init_random

    cfg_dir = os.path.join(work, "model")
    if dist.get_rank() == 0:
        LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3,
                    num_hidden_layers=args.layers, num_attention_heads=max(1, args.hidden // 64),
                    max_position_embeddings=args.seq_len).save_pretrained(cfg_dir)
    dist.barrier()
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    # param_dtype auto: fp32 on CPU, bf16 compute on CUDA, as train_fsdp.py runs by default
    model = build_sharded_model(ModelConfig(config_path=cfg_dir, compile=True), mesh, device)
    init_random(model, seed=0, std=0.02)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)


def timed_steps(model, optim, device, args, gen, n: int, compiled: bool) -> list[float]:
    """Seconds of each of n train steps (one micro batch of random tokens), compiled or forced eager."""
    import contextlib

    import torch
    import torch.distributed as dist

    from train_fsdp import train_step
    stance = contextlib.nullcontext() if compiled else torch.compiler.set_stance("force_eager")
    out = []
    with stance:
        for _ in range(n):
            ids = torch.randint(0, args.vocab, (args.batch, args.seq_len), generator=gen)
            t0 = time.perf_counter()
            train_step(model, optim, [(ids, ids.clone(), None)], device, dist.get_world_size(), 1.0)
            out.append(time.perf_counter() - t0)  # train_step ends in an all-reduce + .item(): all ranks, all kernels
    return out


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    from torch._dynamo.utils import counters

    if torch.cuda.is_available():  # as train_fsdp.py: NCCL for training, gloo beside it
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("cpu:gloo,cuda:nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    model, optim = build(args, args.work_dir, device)
    gen = torch.Generator().manual_seed(dist.get_rank())
    first = {"eager": timed_steps(model, optim, device, args, gen, 1, False)[0],
             "compiled": timed_steps(model, optim, device, args, gen, 1, True)[0]}
    steps = {"eager": [], "compiled": []}
    for r in range(args.rounds):
        for way in (("eager", "compiled") if r % 2 == 0 else ("compiled", "eager")):
            steps[way].append(timed_steps(model, optim, device, args, gen, args.steps, way == "compiled"))
    if dist.get_rank() == 0:
        with open(os.path.join(args.work_dir, "raw.json"), "w") as f:
            json.dump({"device": device.type, "first_step_s": first, "step_s": steps,
                       "world_size": dist.get_world_size(),
                       "params": sum(p.numel() for p in model.parameters()),
                       "graphs": counters["stats"]["unique_graphs"],
                       "graph_breaks": sum(counters["graph_break"].values())}, f)
    dist.destroy_process_group()


# ---------------------------------------------------------------- driver side

def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "rounds": values}


def summarize(raw: dict, args) -> dict:
    """tokens/s per round (its steps' tokens over their time, all ranks), and the compile time on its own."""
    tokens = raw["world_size"] * args.batch * args.seq_len
    rate = {way: spread([tokens * len(r) / sum(r) for r in rounds]) for way, rounds in raw["step_s"].items()}
    median_step = {way: statistics.median([s for r in rounds for s in r]) for way, rounds in raw["step_s"].items()}
    compile_s = raw["first_step_s"]["compiled"] - median_step["compiled"]
    saved = median_step["eager"] - median_step["compiled"]  # per step; the compile pays back after compile_s / saved
    return {"device": raw["device"],
            "model": {"hidden": args.hidden, "layers": args.layers, "vocab": args.vocab, "params": raw["params"]},
            "world_size": raw["world_size"], "batch_per_rank": args.batch, "seq_len": args.seq_len,
            "rounds": args.rounds, "steps_per_round": args.steps,
            "inductor_cache": "warm" if args.warm_cache else "cold",
            "graphs": raw["graphs"], "graph_breaks": raw["graph_breaks"],
            "tokens_per_s": rate, "first_step_s": raw["first_step_s"], "median_step_s": median_step,
            "compile_s": compile_s, "breakeven_steps": compile_s / saved if saved > 0 else None,
            "ratios": {"compiled_over_eager_tokens_per_s": rate["compiled"]["median"] / rate["eager"]["median"]}}


def table(res: dict) -> list[str]:
    m = res["model"]
    lines = [f"{m['params']:,} params (hidden {m['hidden']}, {m['layers']} blocks, vocab {m['vocab']}), "
             f"{res['world_size']} {res['device']} ranks x {res['batch_per_rank']} x {res['seq_len']} tokens per step, "
             f"{res['rounds']} rounds x {res['steps_per_round']} steps per way, "
             f"inductor cache {res['inductor_cache']}. "
             + provenance.markdown_line(res), "",
             "| way | tokens/s median (min-max) | first step | median step |", "|---|---|---|---|"]
    for way, r in res["tokens_per_s"].items():
        lines.append(f"| {way} | {r['median']:.0f} ({r['min']:.0f}-{r['max']:.0f}) | "
                     f"{res['first_step_s'][way]:.2f} s | {res['median_step_s'][way]:.3f} s |")
    even = res["breakeven_steps"]
    lines += ["", f"compiled / eager tokens/s: {res['ratios']['compiled_over_eager_tokens_per_s']:.2f}x; "
              f"compile time {res['compile_s']:.1f} s ({res['graphs']} graphs, {res['graph_breaks']} graph breaks); "
              + (f"paid back after {even:.0f} steps" if even is not None else "never paid back: compiled is not faster")]
    return lines


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    started = provenance.start(argv)
    work = tempfile.mkdtemp(prefix="compile_bench_")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if not args.warm_cache:
        env["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(work, "inductor")
    # --standalone: torchrun's own store on a free port, so no port is chosen here and raced for
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(args.nproc),
           os.path.abspath(__file__), "--worker", "--work-dir", work,
           *[x for a in SIZE_ARGS for x in (f"--{a.replace('_', '-')}", str(getattr(args, a)))]]
    try:
        subprocess.run(cmd, check=True, cwd=ROOT, env=env)
        with open(os.path.join(work, "raw.json")) as f:
            res = summarize(json.load(f), args)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    os.makedirs(args.out, exist_ok=True)
    provenance.record(res, "compile_bench", args.out, started)
    provenance.write_markdown(args.out, "compile_bench", table(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Checkpoint benchmark: rank-0 torch.save vs DCP sync vs DCP async (thread, process), against the memcpy floor.

    python bench/ckpt_bench.py                          # ~190M params, 2 ranks, CPU here (CUDA where present)
    python bench/ckpt_bench.py --hidden 256 --layers 2  # seconds, for a smoke test

Launches itself under torchrun: a save worker at 2 ranks (every way of saving, load at the same world
size, training throughput with and without periodic saves) and a load worker at 1 rank (load at another
world size). Writes bench/results/ckpt_bench.{json,md}. Figures, not assertions: see README "Performance".
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=10)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--saves", type=int, default=3, help="saves per method (first + steady state)")
    p.add_argument("--train-steps", type=int, default=30, help="steps for the throughput comparison")
    p.add_argument("--every", type=int, default=10, help="checkpoint interval in the throughput comparison")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--work-dir", default=None, help="where checkpoints go (default: a temp dir)")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    p.add_argument("--worker", choices=("save", "load"), default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ---------------------------------------------------------------- worker side (under torchrun)

def build(args, work):
    """A Llama of the asked size, sharded like train_fsdp.py, with AdamW state materialised by one step."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import LlamaConfig

    from finetune.config import ModelConfig
    from finetune.model import build_sharded_model, init_random

    cfg_dir = os.path.join(work, "model")
    if dist.get_rank() == 0:
        os.makedirs(cfg_dir, exist_ok=True)
        LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3,
                    num_hidden_layers=args.layers, num_attention_heads=max(1, args.hidden // 64),
                    max_position_embeddings=args.seq_len).save_pretrained(cfg_dir)
    dist.barrier()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if torch.cuda.is_available() else torch.device("cpu")
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    model = build_sharded_model(ModelConfig(config_path=cfg_dir, param_dtype="fp32"), mesh, device)
    init_random(model, seed=0, std=0.02)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return model, optim, device


def train_steps(model, optim, device, n: int, seq_len: int, vocab: int):
    import torch
    gen = torch.Generator().manual_seed(0)
    for _ in range(n):
        ids = torch.randint(0, vocab, (1, seq_len), generator=gen).to(device)
        model(input_ids=ids, labels=ids).loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)


def local_tensors(state) -> list:
    import torch
    out = []
    def walk(x):
        if isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, torch.Tensor):
            out.append(x.to_local() if hasattr(x, "to_local") else x)
    walk(state)
    return out


def memcpy_floor(state) -> tuple[float, int]:
    """Seconds to copy this rank's state bytes into preallocated host buffers (warm), and the bytes."""
    import torch
    src = local_tensors(state)
    dst = [torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=t.is_cuda) for t in src]
    for _ in range(2):  # first pass faults the pages in; the second is the floor
        t0 = time.perf_counter()
        for d, s in zip(dst, src):
            d.copy_(s, non_blocking=s.is_cuda)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        secs = time.perf_counter() - t0
    return secs, sum(t.numel() * t.element_size() for t in src)


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def bench_rank0_torch_save(model, optim, path, n):
    """The seed approach: gather the full state to rank 0 (CPU) and torch.save it."""
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    out = []
    for i in range(n):
        t0 = time.perf_counter()
        msd, osd = get_state_dict(model, optim, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if dist.get_rank() == 0:
            os.makedirs(path, exist_ok=True)
            torch.save({"model": msd, "optim": osd}, os.path.join(path, f"full-{i}.pt"))
            with open(os.path.join(path, f"full-{i}.pt"), "rb+") as f:
                os.fsync(f.fileno())
        dist.barrier()
        secs = time.perf_counter() - t0
        out.append({"blocking_s": secs, "committed_s": secs})
        del msd, osd
    return out, dir_bytes(path) // n


def bench_manager(model, optim, mode, ckpt_dir, n):
    """Our path: CheckpointManager (DCP + commit marker with checksums), one save per simulated step."""
    from ckpt import CheckpointManager, ModelOptimizer
    events = []
    mgr = CheckpointManager(ckpt_dir, mode, keep_last=0, on_event=lambda name, **kw: events.append(kw))
    state = {"app": ModelOptimizer(model, optim)}
    out = []
    for i in range(1, n + 1):
        blocking = mgr.save(i, state, {"meta.json": json.dumps({"step": i, "world_size": mgr.world_size})})
        mgr.wait()  # measure each save alone: blocking part, then time to commit
        out.append({"blocking_s": blocking, "committed_s": events[-1]["committed_s"]})
    mgr.close()
    return out, dir_bytes(os.path.join(ckpt_dir, "step-000001")), mgr


def bench_load(model, optim, path):
    import torch.distributed.checkpoint as dcp
    from ckpt import ModelOptimizer
    t0 = time.perf_counter()
    dcp.load({"app": ModelOptimizer(model, optim)}, checkpoint_id=path)
    return time.perf_counter() - t0


def throughput(model, optim, device, args, ckpt_dir, mode):
    """Steps/s over args.train_steps steps, saving every args.every steps (mode None: no saves)."""
    from ckpt import CheckpointManager, ModelOptimizer
    mgr = CheckpointManager(ckpt_dir, mode or "off", keep_last=1)
    state = {"app": ModelOptimizer(model, optim)}
    train_steps(model, optim, device, 2, args.seq_len, args.vocab)  # warm up
    t0 = time.perf_counter()
    for step in range(1, args.train_steps + 1):
        mgr.wait_for_staging()
        train_steps(model, optim, device, 1, args.seq_len, args.vocab)
        mgr.poll()
        if mode and step % args.every == 0:
            mgr.save(step, state, {"meta.json": "{}"})
    secs = time.perf_counter() - t0
    mgr.close()
    return args.train_steps / secs


def worker(args):
    import torch
    import torch.distributed as dist
    dist.init_process_group("cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    work = args.work_dir
    model, optim, device = build(args, work)
    train_steps(model, optim, device, 1, args.seq_len, args.vocab)
    result = {"world_size": world}
    if args.worker == "load":
        result["load_s"] = bench_load(model, optim, os.path.join(work, "dcp-off", "step-000001"))
    else:
        from ckpt import ModelOptimizer
        floor_s, nbytes = memcpy_floor(ModelOptimizer(model, optim).state_dict())
        result.update(params=sum(p.numel() for p in model.parameters()), rank_state_bytes=nbytes,
                      memcpy_floor_s=floor_s, methods={})
        runs = [("rank0_torch_save", None), ("dcp_sync", "off"), ("dcp_async_thread", "thread"),
                ("dcp_async_process", "process")]
        for name, mode in runs:
            if mode is None:
                saves, size = bench_rank0_torch_save(model, optim, os.path.join(work, "torch-save"), args.saves)
            else:
                saves, size, _ = bench_manager(model, optim, mode, os.path.join(work, f"dcp-{mode}"), args.saves)
            result["methods"][name] = {"saves": saves, "checkpoint_bytes": size}
            dist.barrier()
        result["load_same_world_s"] = bench_load(model, optim, os.path.join(work, "dcp-off", "step-000001"))
        result["steps_per_s"] = {m or "none": throughput(model, optim, device, args, os.path.join(work, f"tp-{m}"), m)
                                 for m in (None, "thread", "process")}
    if rank == 0:
        with open(os.path.join(work, f"result-{args.worker}.json"), "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()


# ---------------------------------------------------------------- driver side

def launch(args, worker_kind, nproc, work):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_addr",
           "127.0.0.1", "--master_port", str(port), os.path.abspath(__file__), "--worker", worker_kind,
           "--work-dir", work, "--hidden", str(args.hidden), "--layers", str(args.layers), "--vocab",
           str(args.vocab), "--saves", str(args.saves), "--train-steps", str(args.train_steps), "--every",
           str(args.every), "--seq-len", str(args.seq_len)]
    subprocess.run(cmd, check=True, cwd=ROOT)
    with open(os.path.join(work, f"result-{worker_kind}.json")) as f:
        return json.load(f)


def summarize(save: dict, load: dict, every: int) -> dict:
    floor = save["memcpy_floor_s"]
    rows = {}
    for name, m in save["methods"].items():
        s = m["saves"]
        steady = s[1:] or s
        rows[name] = {
            "first_blocking_s": s[0]["blocking_s"],
            "steady_blocking_s": sum(x["blocking_s"] for x in steady) / len(steady),
            "committed_s": sum(x["committed_s"] for x in steady) / len(steady),
            "write_GBps": m["checkpoint_bytes"] / 1e9 / (sum(x["committed_s"] for x in steady) / len(steady)),
            "checkpoint_GB": m["checkpoint_bytes"] / 1e9,
        }
    sync = rows["dcp_sync"]["steady_blocking_s"]
    best_async = min(rows["dcp_async_thread"]["steady_blocking_s"], rows["dcp_async_process"]["steady_blocking_s"])
    tp = save["steps_per_s"]
    return {
        "params": save["params"], "world_size": save["world_size"], "rank_state_GB": save["rank_state_bytes"] / 1e9,
        "memcpy_floor_s": floor, "methods": rows,
        "load_s": {"same_world": save["load_same_world_s"], "world_1": load["load_s"]},
        "throughput_steps_per_s": tp,
        "ratios": {
            "async_blocking_over_memcpy": best_async / floor,
            "async_blocking_over_sync": best_async / sync,
            "throughput_thread_over_none": tp["thread"] / tp["none"],
            "throughput_process_over_none": tp["process"] / tp["none"],
            "rank0_torch_save_over_dcp_sync": rows["rank0_torch_save"]["steady_blocking_s"] / sync,
        },
        "save_every": every,
    }


def speed_words(time_ratio: float) -> str:
    """`time of the other / time of this` -> "1.77x faster" or "1.06x slower" (never "0.94x slower")."""
    if time_ratio >= 1:
        return f"{time_ratio:.2f}x faster"
    return f"{1 / time_ratio:.2f}x slower"


def to_markdown(r: dict, machine: str) -> str:
    lines = [f"{r['params'] / 1e6:.0f}M params, {r['world_size']} ranks, {r['rank_state_GB']:.2f} GB of model + "
             f"AdamW state per rank; {machine}", "",
             "| method | first save blocking (s) | steady blocking (s) | until committed (s) | write GB/s |",
             "|---|---|---|---|---|"]
    for name, m in r["methods"].items():
        lines.append(f"| {name} | {m['first_blocking_s']:.2f} | {m['steady_blocking_s']:.2f} | "
                     f"{m['committed_s']:.2f} | {m['write_GBps']:.2f} |")
    lines.append(f"| memcpy floor (rank's state bytes) | | {r['memcpy_floor_s']:.2f} | | |")
    ra, tp = r["ratios"], r["throughput_steps_per_s"]
    lines += ["", f"- load: {r['load_s']['same_world']:.2f} s at the same world size, "
              f"{r['load_s']['world_1']:.2f} s at 1 rank",
              f"- training: {tp['none']:.3f} steps/s without saves, {tp['thread']:.3f} with a thread-mode save every "
              f"{r['save_every']} steps ({ra['throughput_thread_over_none']:.1%}), {tp['process']:.3f} with process mode "
              f"({ra['throughput_process_over_none']:.1%})",
              f"- async steady blocking / memcpy floor: {ra['async_blocking_over_memcpy']:.2f}x; "
              f"/ sync DCP save: {ra['async_blocking_over_sync']:.1%}",
              f"- DCP sync vs rank-0 torch.save: {speed_words(ra['rank0_torch_save_over_dcp_sync'])}"]
    return "\n".join(lines) + "\n"


def main(argv=None):
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    work = args.work_dir or tempfile.mkdtemp(prefix="ckpt-bench-")
    try:
        save = launch(args, "save", args.nproc, work)
        load = launch(args, "load", 1, work)
    finally:
        if not args.work_dir:
            shutil.rmtree(work, ignore_errors=True)
    import platform
    import torch
    machine = (f"{torch.cuda.get_device_name()}" if torch.cuda.is_available() else
               f"CPU only, {os.cpu_count()} cores, {platform.processor() or platform.machine()}") + \
              f", torch {torch.__version__}"
    result = summarize(save, load, args.every)
    result["machine"] = machine
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "ckpt_bench.json"), "w") as f:
        json.dump(result, f, indent=1)
    md = to_markdown(result, machine)
    with open(os.path.join(args.out, "ckpt_bench.md"), "w") as f:
        f.write(md)
    print(md)


if __name__ == "__main__":
    main()

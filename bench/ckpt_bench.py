"""Checkpoint benchmark: rank-0 torch.save and plain dcp.save (each with the old checkpoint deleted before, or
kept until the new one is written), DCP's own async_save, our DCP sync / async (thread, process), memcpy floor,
and the disk's own write rate in every round (dd), which each method's rate is compared with.

    python bench/ckpt_bench.py                          # ~190M params, 2 ranks, CPU here (CUDA where present)
    python bench/ckpt_bench.py --hidden 768 --layers 6 --saves 8 --train-steps 0   # ~90M, what docs/ reports
    python bench/ckpt_bench.py --hidden 256 --layers 2  # seconds, for a smoke test

Launches itself under torchrun: a save worker at 2 ranks (every way of saving and a disk probe, interleaved over
rounds; resume verification; load at the same world size; optionally training throughput with periodic saves)
and a load worker at 1 rank (load and verification at another world size). Per method: blocking,
upload (until every rank's files and .metadata are written), commit overhead (committed - upload) and the write
rate against the disk's in the same round, as median and min-max (bench/ckpt_summary.py). Writes
bench/results/ckpt_bench.{json,md},
keeps the run under bench/results/runs/ (bench/provenance.py); docs/checkpoint-integrity.md reads them.
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
from bench.ckpt_summary import summarize  # noqa: E402 - after the path insert
from bench.host_rates import disk_write_s, probe_bytes  # noqa: E402
from common.dist import free_port  # noqa: E402

import provenance  # noqa: E402 - bench/provenance.py, beside this script


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=10)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--saves", type=int, default=4, help="rounds: saves per method (the first is warm-up)")
    p.add_argument("--train-steps", type=int, default=30, help="steps for the throughput comparison (0: skip it)")
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


def memcpy_floor(state, pinned: bool = True) -> tuple[float, int]:
    """Seconds to copy this rank's state bytes into preallocated host buffers (warm), and the bytes.
    On CUDA, pinned buffers are what the async stager uses; pageable ones show what pinning buys."""
    import torch
    src = local_tensors(state)
    dst = [torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pinned and t.is_cuda) for t in src]
    for _ in range(2):  # first pass faults the pages in; the second is the floor, every rank copying at once
        torch.distributed.barrier()
        t0 = time.perf_counter()
        for d, s in zip(dst, src):
            d.copy_(s, non_blocking=s.is_cuda)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        secs = time.perf_counter() - t0
    return secs, sum(t.numel() * t.element_size() for t in src)


def disk_probe(work: str, nbytes: int) -> dict:
    """Every rank writes `nbytes` with dd (conv=fdatasync) at the same time: the disk's rate for a save's bytes."""
    import torch.distributed as dist
    dist.barrier()
    t0 = time.perf_counter()
    disk_write_s(work, nbytes)
    dist.barrier()
    return {"seconds": time.perf_counter() - t0, "bytes": probe_bytes(nbytes) * dist.get_world_size()}


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def rank0_torch_save(model, optim, path) -> dict:
    """The seed approach: gather the full state to rank 0 (CPU) and torch.save it."""
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    shutil.rmtree(path, ignore_errors=True)
    t0 = time.perf_counter()
    msd, osd = get_state_dict(model, optim, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
        torch.save({"model": msd, "optim": osd}, os.path.join(path, "full.pt"))
        with open(os.path.join(path, "full.pt"), "rb+") as f:
            os.fsync(f.fileno())
    dist.barrier()
    secs = time.perf_counter() - t0
    return {"blocking_s": secs, "upload_s": secs, "committed_s": secs, "bytes": dir_bytes(path)}


def plain_dcp_save(model, optim, path) -> dict:
    """dcp.save of the same state with its stock writer: no commit marker, no checksums, no manager."""
    import torch.distributed.checkpoint as dcp
    from ckpt import ModelOptimizer
    shutil.rmtree(path, ignore_errors=True)
    t0 = time.perf_counter()
    dcp.save({"app": ModelOptimizer(model, optim)}, checkpoint_id=path)
    secs = time.perf_counter() - t0
    return {"blocking_s": secs, "upload_s": secs, "committed_s": secs, "bytes": dir_bytes(path)}


def bare_async_dcp_save(model, optim, path, stager) -> dict:
    """dcp.async_save in thread mode with its stock writer and the stager our manager builds (ckpt/uploader.py
    make_stager), no checksums, no marker, no manager: DCP's own async path, the floor for ours."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, AsyncSaveResponse
    from ckpt import ModelOptimizer
    shutil.rmtree(path, ignore_errors=True)
    t0 = time.perf_counter()
    resp = dcp.async_save({"app": ModelOptimizer(model, optim)}, checkpoint_id=path, async_stager=stager,
                          async_checkpointer_type=AsyncCheckpointerType.THREAD)
    if isinstance(resp, AsyncSaveResponse):  # CUDA: staging in the background; training would wait for it
        resp.staging_completion.result()
        resp = resp.upload_completion
    blocking = time.perf_counter() - t0
    resp.result()
    secs = time.perf_counter() - t0
    return {"blocking_s": blocking, "upload_s": secs, "committed_s": secs, "bytes": dir_bytes(path)}


def keeping_old(save, model, optim, work, r: int) -> dict:
    """`save` (rank0_torch_save or plain_dcp_save) into a new folder per round, the previous one deleted only after
    the new one is written (its deletion not timed), as a save that never leaves you without a checkpoint must,
    and as the manager does. On this VM that order alone doubles a plain dcp.save (docs/checkpoint-integrity.md)."""
    import torch.distributed as dist
    rec = save(model, optim, os.path.join(work, f"round-{r}"))
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(os.path.join(work, f"round-{r - 1}"), ignore_errors=True)
    return rec


def manager_save(mgr, model, optim, step: int, events: list) -> dict:
    """Our path: CheckpointManager (DCP + checksums as written + commit marker), one save measured alone.
    retention_s: the sweep after the marker that deletes the checkpoint keep_last pushed out (its `retention`
    event, on rank 0; in the background in every mode), 0 when there was nothing to delete."""
    from ckpt import ModelOptimizer
    start = len(events)
    blocking = mgr.save(step, {"app": ModelOptimizer(model, optim)},
                        {"meta.json": json.dumps({"step": step, "world_size": mgr.world_size})})
    mgr.wait()  # the blocking part, then the time until committed, then the retention sweep
    mine = {name: kw for name, kw in events[start:]}
    e = mine["checkpoint"]
    return {"blocking_s": blocking, "upload_s": e["upload_s"], "committed_s": e["committed_s"],
            "retention_s": mine.get("retention", {}).get("seconds", 0.0), "bytes": dir_bytes(e["path"])}


def sha256_everything_on_rank0(path: str) -> float:
    """The old commit/resume check: one process SHA-256s every file of the checkpoint."""
    import hashlib
    t0 = time.perf_counter()
    for name in sorted(os.listdir(path)):
        h = hashlib.sha256()
        with open(os.path.join(path, name), "rb") as f:
            while chunk := f.read(8 << 20):
                h.update(chunk)
    return time.perf_counter() - t0


def verify_times(path: str) -> dict:
    """Resume verification of a committed checkpoint at this world size: ours (each rank its share of the
    files, verdict agreed) against the old scheme (rank 0 alone, SHA-256 of everything, others waiting)."""
    import torch.distributed as dist
    from ckpt import CheckpointManager
    from ckpt.resume import verify
    mgr = CheckpointManager(os.path.dirname(path), "off")
    dist.barrier()
    t0 = time.perf_counter()
    verify(path, mgr.pg)
    ours = time.perf_counter() - t0
    dist.barrier()
    t0 = time.perf_counter()
    if dist.get_rank() == 0:
        sha256_everything_on_rank0(path)
    dist.barrier()
    return {"parallel_xxh3_s": ours, "rank0_sha256_s": time.perf_counter() - t0}


def bench_load(model, optim, path):
    import torch.distributed.checkpoint as dcp
    from ckpt import ModelOptimizer
    t0 = time.perf_counter()
    dcp.load({"app": ModelOptimizer(model, optim)}, checkpoint_id=path)
    return time.perf_counter() - t0


def throughput(model, optim, device, args, ckpt_dir, mode):
    """Steps/s over args.train_steps steps, saving every args.every steps (mode None: no saves)."""
    from ckpt import CheckpointManager, ModelOptimizer, settle_alone
    mgr = CheckpointManager(ckpt_dir, mode or "off", keep_last=1)
    state = {"app": ModelOptimizer(model, optim)}
    train_steps(model, optim, device, 2, args.seq_len, args.vocab)  # warm up
    t0 = time.perf_counter()
    for step in range(1, args.train_steps + 1):
        mgr.wait_for_staging()
        train_steps(model, optim, device, 1, args.seq_len, args.vocab)
        settle_alone(mgr)
        if mode and step % args.every == 0:
            mgr.save(step, state, {"meta.json": "{}"})
    secs = time.perf_counter() - t0
    mgr.close()
    return args.train_steps / secs


METHODS = ("rank0_torch_save", "rank0_torch_save_keep_old", "dcp_plain", "dcp_plain_keep_old", "dcp_async_bare",
           "dcp_sync", "dcp_async_thread", "dcp_async_process")


def interleaved_saves(model, optim, work, rounds: int, nbytes: int) -> tuple[dict, list]:
    """Every method once per round, and a disk probe of `nbytes` per rank, in an order rotated each round, so
    machine load hits all of them alike. Returns (records per method, the probes)."""
    import torch.distributed as dist
    from ckpt import CheckpointManager
    from ckpt.prestage import make_stager
    events: list = []
    stager = make_stager("thread")
    managers = {name: CheckpointManager(os.path.join(work, name), mode, keep_last=1,
                                        on_event=lambda name, **kw: events.append((name, kw)))
                for name, mode in (("dcp_sync", "off"), ("dcp_async_thread", "thread"),
                                   ("dcp_async_process", "process"))}
    out, disk = {name: [] for name in METHODS}, []
    order = METHODS + ("disk",)
    for r in range(rounds):
        for name in order[r % len(order):] + order[:r % len(order)]:
            if name == "disk":
                disk.append(disk_probe(work, nbytes))
                continue
            if name == "rank0_torch_save":
                rec = rank0_torch_save(model, optim, os.path.join(work, name))
            elif name == "dcp_plain":
                rec = plain_dcp_save(model, optim, os.path.join(work, name, "plain"))
            elif name == "rank0_torch_save_keep_old":
                rec = keeping_old(rank0_torch_save, model, optim, os.path.join(work, name), r)
            elif name == "dcp_plain_keep_old":
                rec = keeping_old(plain_dcp_save, model, optim, os.path.join(work, name), r)
            elif name == "dcp_async_bare":
                rec = bare_async_dcp_save(model, optim, os.path.join(work, name, "plain"), stager)
            else:
                rec = manager_save(managers[name], model, optim, r + 1, events)
            out[name].append(rec)
            dist.barrier()
    for mgr in managers.values():
        mgr.close()
    stager.close()
    return out, disk


def worker(args):
    import torch
    import torch.distributed as dist
    if torch.cuda.is_available():  # before anything touches CUDA: the stager's stream and synchronize() use it
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("cpu:gloo,cuda:nccl", device_id=device)
    else:
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    work = args.work_dir
    model, optim, device = build(args, work)
    train_steps(model, optim, device, 1, args.seq_len, args.vocab)
    result = {"world_size": world}
    committed = os.path.join(work, "dcp_sync", f"step-{args.saves:06d}")
    if args.worker == "load":
        result["load_s"] = bench_load(model, optim, committed)
        result["verify"] = verify_times(committed)
    else:
        from ckpt import ModelOptimizer
        floor_s, nbytes = memcpy_floor(ModelOptimizer(model, optim).state_dict())
        methods, disk = interleaved_saves(model, optim, work, args.saves, nbytes)
        result.update(params=sum(p.numel() for p in model.parameters()), rank_state_bytes=nbytes,
                      memcpy_floor_s=floor_s, methods=methods, disk=disk)
        if device.type == "cuda":
            result["memcpy_pageable_s"] = memcpy_floor(ModelOptimizer(model, optim).state_dict(), pinned=False)[0]
        result["load_same_world_s"] = bench_load(model, optim, committed)
        result["verify"] = verify_times(committed)
        result["checkpoint_files"] = len(os.listdir(committed))
        if args.train_steps:
            result["steps_per_s"] = {m or "none": throughput(model, optim, device, args, os.path.join(work, f"tp-{m}"), m)
                                     for m in (None, "thread", "process")}
    if rank == 0:
        with open(os.path.join(work, f"result-{args.worker}.json"), "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()


# ---------------------------------------------------------------- driver side

def launch(args, worker_kind, nproc, work):
    port = free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_addr",
           "127.0.0.1", "--master_port", str(port), os.path.abspath(__file__), "--worker", worker_kind,
           "--work-dir", work, "--hidden", str(args.hidden), "--layers", str(args.layers), "--vocab",
           str(args.vocab), "--saves", str(args.saves), "--train-steps", str(args.train_steps), "--every",
           str(args.every), "--seq-len", str(args.seq_len)]
    subprocess.run(cmd, check=True, cwd=ROOT)
    with open(os.path.join(work, f"result-{worker_kind}.json")) as f:
        return json.load(f)


def speed_words(time_ratio: float) -> str:
    """`time of the other / time of this` -> "1.77x faster" or "1.06x slower" (never "0.94x slower")."""
    if time_ratio >= 1:
        return f"{time_ratio:.2f}x faster"
    return f"{1 / time_ratio:.2f}x slower"


def to_markdown(r: dict) -> str:
    def ms(x):
        return f"{x['median']:.2f} ({x['min']:.2f}-{x['max']:.2f})"
    lines = [f"{r['params'] / 1e6:.0f}M params, {r['world_size']} ranks, {r['rank_state_GB']:.2f} GB of model + "
             f"AdamW state per rank; {r['device']}. Median (min-max) over {r['methods']['dcp_sync']['rounds'] - 1} "
             "steady-state rounds after the first, methods interleaved. " + provenance.markdown_line(r), "",
             "| method | first blocking (s) | blocking (s) | upload (s) | commit overhead (s) | until committed (s) | "
             "then retention (s) | write GB/s | write / disk's, same round |", "|---|---|---|---|---|---|---|---|---|"]
    for name, m in r["methods"].items():
        lines.append(f"| {name} | {m['first_blocking_s']:.2f} | {ms(m['blocking_s'])} | {ms(m['upload_s'])} | "
                     f"{ms(m['commit_overhead_s'])} | {ms(m['committed_s'])} | {ms(m['retention_s'])} | "
                     f"{m['write_GBps']:.2f} | {ms(m['write_over_disk'])} |")
    lines.append(f"| disk: dd of every rank's bytes at once (GB/s) | | | | | | | {ms(r['disk_GBps'])} | 1 |")
    if r.get("memcpy_pageable_s") is None:
        lines.append(f"| memcpy floor (rank's state bytes) | | {r['memcpy_floor_s']:.2f} | | | | | |")
    else:  # CUDA: device-to-host into pinned buffers (what the stager uses) and into pageable ones
        lines.append(f"| D2H floor, pinned host buffers | | {r['memcpy_floor_s']:.2f} | | | | | |")
        lines.append(f"| D2H floor, pageable host buffers | | {r['memcpy_pageable_s']:.2f} | | | | | |")
    ra = r["ratios"]
    lines += ["", "| resume verification | parallel, XXH3-128 (s) | old: rank 0 SHA-256 of all (s) |", "|---|---|---|"]
    for w, v in sorted(r["verify_s"].items()):
        lines.append(f"| W={w[1:]} | {v['parallel_xxh3_s']:.2f} | {v['rank0_sha256_s']:.2f} |")
    lines += ["", f"- load: {r['load_s']['same_world']:.2f} s at the same world size, {r['load_s']['world_1']:.2f} s "
              "at 1 rank",
              f"- commit overhead / upload (worst of our modes): {ra['commit_overhead_over_upload']:.1%} (target <= 10%)",
              f"- DCP sync vs rank-0 torch.save: {speed_words(ra['rank0_torch_save_over_dcp_sync'])} (target >= 3x faster); "
              f"vs a rank-0 torch.save that also keeps the previous checkpoint until written: "
              f"{speed_words(ra['rank0_torch_save_keep_old_over_dcp_sync'])}",
              *(f"- async {mode}: committed / plain dcp.save {ra[f'async_committed_over_plain_dcp_{mode}']:.2f}x "
                f"(target <= 1.2x); / DCP's own async_save {ra[f'async_committed_over_bare_async_{mode}']:.2f}x; "
                f"blocking / memcpy floor {ra[f'async_blocking_over_memcpy_{mode}']:.2f}x; blocking / sync DCP save "
                f"{ra[f'async_blocking_over_sync_{mode}']:.1%} (target <= 10%)" for mode in ("thread", "process")),
              f"- DCP's own async_save committed / plain dcp.save: {ra['bare_async_committed_over_plain_dcp']:.2f}x",
              "- write rate / the disk's (dd) in the same round, median (target >= 80%): " + ", ".join(
                  f"{m} {ra[f'write_over_disk_{m}']:.0%}" for m in ("dcp_plain", "dcp_sync", "dcp_async_thread",
                                                                   "dcp_async_process")),
              f"- plain dcp.save keeping the old folder until written / deleting it first: "
              f"{ra['plain_keep_old_over_plain']:.2f}x; our sync upload / the former: "
              f"{ra['sync_upload_over_plain_keep_old']:.2f}x"]
    if "throughput_steps_per_s" in r:
        tp = r["throughput_steps_per_s"]
        lines.append(f"- training: {tp['none']:.3f} steps/s without saves, {tp['thread']:.3f} with a thread-mode save "
                     f"every {r['save_every']} steps ({ra['throughput_thread_over_none']:.1%}), {tp['process']:.3f} "
                     f"with process mode ({ra['throughput_process_over_none']:.1%})")
    return "\n".join(lines) + "\n"


def main(argv=None):
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    started = provenance.start(argv)  # the machine is shared: say how loaded it was
    work = args.work_dir or tempfile.mkdtemp(prefix="ckpt-bench-")
    try:
        save = launch(args, "save", args.nproc, work)
        load = launch(args, "load", 1, work)
    finally:
        if not args.work_dir:
            shutil.rmtree(work, ignore_errors=True)
    import torch
    result = summarize(save, load, args.every)
    result["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU only"
    md = to_markdown(provenance.record(result, "ckpt_bench", args.out, started))
    with open(os.path.join(args.out, "ckpt_bench.md"), "w") as f:
        f.write(md)
    print(md)


if __name__ == "__main__":
    main()

"""One-GPU benchmark: tokens/s and MFU at Qwen2.5 shapes, peak memory against --plan, async and memory-tier saves.

    python bench/gpu_bench.py                         # on one GPU, within --budget-s (bench/gpu_check.sh runs it)
    python bench/gpu_bench.py --device cpu --tiny --out /tmp/gb   # the code paths on CPU: a smoke run, not a figure

One process, a world of one (FSDP2 on a one-rank mesh, cpu:gloo,cuda:nccl, as torchrun --nproc_per_node 1), random
tokens through train_fsdp.train_step (bf16 compute, fp32 masters, fused AdamW). In order, each part skipped (and
said so in the results) when the time left in --budget-s is short:
1. each shape of --shapes (Qwen2.5 0.5B, 1.5B, 3B; random init): --batch x --seq-len tokens per optimizer step, the
   micro batch halved from --batch until --plan's per-GPU estimate (finetune/plan.py gpu_items) fits 90% of the
   GPU, gradient accumulation making up the rest; tokens/s over --steps steps after 2 warm-up steps; MFU = model
   FLOPs per token x tokens/s / the GPU's dense bf16 peak; max_memory_allocated and _reserved against the plan;
   - at the first shape, before a larger one needs the memory: async saves (ckpt.async_mode=thread,
     CheckpointManager), the training thread's blocking (the time in save() plus the staging wait before the
     optimizer step) against a pinned device-to-host copy of the same bytes (the floor), and the time to commit
     against the disk's own write rate (dd, same folder, same run); then a memory-tier save every step
     (ckpt.memory_interval=1) against no checkpointing, tokens/s;
   - at a shape under 40% MFU: a torch.profiler trace of one step, its top kernels by device time and the share
     of the step the device was busy;
2. the largest shape measured again with model.compile=true: tokens/s against eager, and the compile time.
Model FLOPs per token (causal, no recompute): 6 x the parameters of every matmul (attention and MLP projections,
lm_head) + 6 x layers x seq_len x attention width (QK^T and AV, each token attending to seq_len/2 keys on average;
PaLM's convention counts the full square, 12). A part that raises (out of memory, no Triton) is recorded with its
error and the run goes on to the next; the exit status is then 1. Writes bench/results/gpu_bench.{json,md} with
the provenance (bench/provenance.py), the GPU's name and driver. Without CUDA (and without --device cpu) it says
so in one line and exits 1; --device cpu writes its smoke results only under the --out it is given, named
gpu_bench_cpu_smoke.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from bench.ckpt_bench import memcpy_floor  # noqa: E402 - after the path insert
from bench.host_rates import disk_write_s, probe_bytes  # noqa: E402
from bench.memory_bench import Log  # noqa: E402
from bench.qwen_shape import SHAPES, write_qwen_config  # noqa: E402
from common.dist import free_port  # noqa: E402
import provenance  # noqa: E402 - bench/provenance.py, beside this script

GIB = 2 ** 30
MFU_GOAL = 0.40
# Dense bf16 peak (no sparsity), TFLOP/s, by the exact torch.cuda.get_device_name(): NVIDIA's datasheets. Exact, as
# a part of a name would match "NVIDIA H200 NVL" (835) as "H200" (989.4); another name: --peak-tflops, else no MFU.
PEAK_BF16_TFLOPS = {"NVIDIA H100 80GB HBM3": 989.4, "NVIDIA H100 PCIe": 756.0, "NVIDIA H100 NVL": 835.0,
                    "NVIDIA H200": 989.4, "NVIDIA H200 NVL": 835.0, "NVIDIA A100-SXM4-80GB": 312.0,
                    "NVIDIA A100-SXM4-40GB": 312.0, "NVIDIA A100 80GB PCIe": 312.0, "NVIDIA A100-PCIE-40GB": 312.0}
TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
            num_hidden_layers=2)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=["0.5b", "1.5b", "3b"])
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch", type=int, default=8, help="sequences per optimizer step (the global batch); the micro "
                   "batch starts there and is halved until the plan fits, accumulation making up the rest")
    p.add_argument("--steps", type=int, default=8, help="timed steps per measurement, after 2 warm-up steps")
    p.add_argument("--saves", type=int, default=3, help="async saves measured (one more first, as warm-up)")
    p.add_argument("--budget-s", type=float, default=420.0, help="wall seconds for everything; parts that do not fit "
                   "what is left are skipped and listed as such")
    p.add_argument("--peak-tflops", type=float, default=None, help="the GPU's dense bf16 peak, if not in the table")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: a smoke run of the code paths")
    p.add_argument("--tiny", action="store_true", help="a 2-block, 64-wide model (with --device cpu)")
    p.add_argument("--work-dir", default=None, help="checkpoints and probes go here (default: a temp dir, removed)")
    p.add_argument("--out", default=None, help="results folder (default bench/results; required with --device cpu)")
    p.add_argument("--tier-junit", default=None, help="the single-GPU test tier's junit XML, recorded in the results")
    p.add_argument("--tier-log", default=None, help="its pytest -v log: the outcomes when no XML was written")
    p.add_argument("--tier-rc", type=int, default=None, help="the test tier's exit status (124: out of its time)")
    p.add_argument("--tier-collected", default=None, help="the tier's test ids, one a line: those that did not end are "
                   "listed as not run")
    a = p.parse_args(argv)
    if a.device == "cpu" and not a.out:
        p.error("--device cpu writes smoke results, never into bench/results: give --out")
    a.out = a.out or os.path.join(ROOT, "bench", "results")
    return a


# ---------------------------------------------------------------- arithmetic (tests/test_bench.py checks it)

def model_flops_per_token(shape: dict, seq_len: int) -> dict:
    """Training FLOPs per token of a Llama/Qwen2-style decoder (HF config keys), forward and backward, causal."""
    h, layers = shape["hidden_size"], shape["num_hidden_layers"]
    head_dim = shape.get("head_dim") or h // shape["num_attention_heads"]
    attn, kv = shape["num_attention_heads"] * head_dim, shape.get("num_key_value_heads",
                                                                  shape["num_attention_heads"]) * head_dim
    per_layer = 2 * h * attn + 2 * h * kv + 3 * h * shape["intermediate_size"]  # q, o; k, v; gate, up, down
    matmul_params = layers * per_layer + shape["vocab_size"] * h  # + lm_head (tied or not, it is a matmul)
    attention = 6 * layers * seq_len * attn
    return {"matmul_params": matmul_params, "dense": 6 * matmul_params, "attention": attention,
            "total": 6 * matmul_params + attention}


def mfu(flops_per_token: float, tokens_per_s: float, peak_tflops: float | None) -> float | None:
    return flops_per_token * tokens_per_s / (peak_tflops * 1e12) if peak_tflops else None


def peak_tflops(device_name: str, given: float | None) -> float | None:
    if given:
        return given
    return PEAK_BF16_TFLOPS.get(device_name.strip())


# ---------------------------------------------------------------- measurements (one process, a world of one)

class Budget:
    """Wall seconds left of --budget-s; parts that need more are skipped and listed."""

    def __init__(self, seconds: float):
        self.end, self.skipped = time.monotonic() + seconds, []

    def allows(self, part: str, need_s: float) -> bool:
        left = self.end - time.monotonic()
        if left < need_s:
            self.skipped.append(f"{part}: {left:.0f} s left of the budget, needs about {need_s:.0f} s")
        return left >= need_s


def init_world(device_kind: str):
    import torch
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    if device_kind == "cuda":
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
        dist.init_process_group("cpu:gloo,cuda:nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return device


def plan_bytes(model_dir: str, seq_len: int, micro: int, accum: int) -> dict:
    """--plan's per-GPU estimate of this config (world 1), and its assumed CUDA-context line apart."""
    from finetune.config import load_config
    from finetune.plan import CUDA_OVERHEAD_GIB, gpu_items, model_shapes
    cfg = load_config(None, [f"model.config_path={model_dir}", f"data.seq_len={seq_len}",
                             f"data.micro_batch_size={micro}", f"data.global_batch_size={micro * accum}"])
    total = sum(b for _, b in gpu_items(cfg, model_shapes(cfg.model), 1, micro, accum))
    return {"total": total, "without_cuda_context": total - CUDA_OVERHEAD_GIB * GIB}


def fitting_batch(model_dir: str, a, device) -> tuple[int, int, dict] | None:
    """(micro batch, accumulation, plan): the largest halving of --batch whose plan fits 90% of the GPU; None if
    not even 1 does."""
    import torch
    room = torch.cuda.get_device_properties(device).total_memory * 0.9 if device.type == "cuda" else float("inf")
    micro = a.batch
    while micro >= 1:
        accum = -(-a.batch // micro)
        plan = plan_bytes(model_dir, a.seq_len, micro, accum)
        if plan["total"] <= room:
            return micro, accum, plan
        micro //= 2
    return None


def build(model_dir: str, device, compile_blocks: bool = False):
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from finetune.config import ModelConfig
    from finetune.model import build_sharded_model, init_random
    model = build_sharded_model(ModelConfig(config_path=model_dir, compile=compile_blocks),
                                init_device_mesh(device.type, (dist.get_world_size(),)), device)
    init_random(model, seed=0, std=0.02)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device.type == "cuda")


def batches(vocab: int, micro: int, accum: int, seq_len: int):
    """Endless global batches of `accum` micro batches of random tokens (host memory, as the data loader hands them)."""
    import torch
    gen = torch.Generator().manual_seed(0)
    while True:
        ids = [torch.randint(0, vocab, (micro, seq_len), generator=gen) for _ in range(accum)]
        yield [(x, x.clone(), None) for x in ids]


def step_times(model, optim, device, data, n: int, before=None, after=None) -> list[float]:
    """Seconds of each of n train_fsdp.train_step calls (each ends in an all-reduce and .item(): a device sync)."""
    from train_fsdp import train_step
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        train_step(model, optim, next(data), device, 1, 1.0, before_optimizer_step=before)
        if after is not None:
            after()
        out.append(time.perf_counter() - t0)
    return out


def tokens_per_s(tokens_per_step: int, times: list[float]) -> float:
    return tokens_per_step * len(times) / sum(times)


def throughput(model_dir: str, shape: dict, fit: tuple, a, device, compile_blocks: bool, peak: float | None) -> dict:
    """tokens/s, MFU and peak memory of one shape, eager or compiled (the first step, the compile, timed apart)."""
    import torch
    micro, accum, _ = fit
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    model, optim = build(model_dir, device, compile_blocks)
    data = batches(shape["vocab_size"], micro, accum, a.seq_len)
    first = step_times(model, optim, device, data, 2)
    times = step_times(model, optim, device, data, a.steps)
    flops = model_flops_per_token(shape, a.seq_len)
    rate = tokens_per_s(micro * accum * a.seq_len, times)
    out = {"compile": compile_blocks, "micro_batch": micro, "accumulation": accum,
           "tokens_per_step": micro * accum * a.seq_len,
           "warmup_step_s": first, "median_step_s": statistics.median(times), "tokens_per_s": rate,
           "model_flops_per_token": flops["total"], "mfu": mfu(flops["total"], rate, peak)}
    if device.type == "cuda":
        free_b, total_b = torch.cuda.mem_get_info(device)
        out.update(max_memory_allocated=torch.cuda.max_memory_allocated(device),
                   max_memory_reserved=torch.cuda.max_memory_reserved(device), device_used=total_b - free_b)
    return {"result": out, "model": model, "optim": optim, "data": data}


def free(run: dict) -> None:
    """Drop a run's model, optimizer and data, and give their device memory back (the next part's peak is its own)."""
    import torch
    run.clear()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def async_saves(run: dict, a, device, work: str) -> dict:
    """Thread-mode async saves through CheckpointManager: blocking against the pinned D2H floor of the same bytes,
    time to commit against the disk's own write rate (dd into the same folder, in this run)."""
    from ckpt import CheckpointManager, ModelOptimizer
    model, optim, data = run["model"], run["optim"], run["data"]
    log, state = Log(0), {"app": ModelOptimizer(model, optim)}
    floor_s, nbytes = memcpy_floor(state["app"].state_dict(), pinned=True)
    ckpt_dir = os.path.join(work, "ckpt")
    mgr = CheckpointManager(ckpt_dir, "thread", keep_last=1, on_event=log.event)
    saves = []
    try:
        for step in range(1, a.saves + 2):  # the first save allocates and pins the staging buffers: warm-up
            in_save = mgr.save(step, state, {"meta.json": "{}"})
            waited = []
            timed_wait = lambda: waited.append(_timed(mgr.wait_for_staging))  # noqa: E731
            step_s = step_times(model, optim, device, data, 1, before=timed_wait)[0]
            mgr.wait()
            e = log.last("checkpoint", None)
            saves.append({"step": step, "in_save_s": in_save, "staging_wait_s": waited[0],
                          "blocking_s": in_save + waited[0], "step_s": step_s, "upload_s": e["upload_s"],
                          "committed_s": e["committed_s"]})
    finally:
        mgr.close()
    disk_s = disk_write_s(work, nbytes)
    disk_GBps = probe_bytes(nbytes) / disk_s / 1e9
    steady = saves[1:] or saves
    blocking = statistics.median(s["blocking_s"] for s in steady)
    committed = statistics.median(s["committed_s"] for s in steady)
    return {"bytes": nbytes, "saves": saves, "d2h_pinned_floor_s": floor_s, "blocking_s": blocking,
            "blocking_over_floor": blocking / floor_s, "committed_s": committed, "disk_GBps": disk_GBps,
            "disk_write_of_the_bytes_s": nbytes / (disk_GBps * 1e9),
            "committed_over_disk_write": committed / (nbytes / (disk_GBps * 1e9))}


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def memory_tier(run: dict, a, device, tokens_per_step: int, work: str) -> dict:
    """tokens/s with a memory-tier save every step against none, interleaved (none, memory, memory, none)."""
    from types import SimpleNamespace
    from ckpt import ModelOptimizer, settle_alone
    from ckpt.memory_tier.tier import MemoryTier
    model, optim, data = run["model"], run["optim"], run["data"]
    log, state = Log(0), {"app": ModelOptimizer(model, optim)}
    options = SimpleNamespace(memory_interval=1, memory_keep=1, memory_replicas=0, dir=os.path.join(work, "disk"),
                              memory_dir=os.path.join(work, "mem"), upload_nice=0)
    tier = MemoryTier.open(options, None, log)
    mgr, step, rates = tier.mgr, 0, {"none": [], "memory": []}

    def save():
        nonlocal step
        step += 1
        settle_alone(mgr)
        mgr.save(step, state, {"meta.json": "{}"})
    try:
        step_times(model, optim, device, data, 1, before=mgr.wait_for_staging, after=save)  # warm-up: first staging
        for way in ("none", "memory", "memory", "none"):
            times = step_times(model, optim, device, data, a.steps, before=mgr.wait_for_staging,
                               after=save if way == "memory" else None)
            mgr.wait()
            rates[way].append(tokens_per_s(tokens_per_step, times))
    finally:
        tier.close(remove=True)
    none, memory = statistics.median(rates["none"]), statistics.median(rates["memory"])
    return {"tokens_per_s": rates, "memory_over_none": memory / none, "goal": 0.97}


def profile_one_step(run: dict, device, top: int = 15) -> dict:
    """Where one step's time goes: torch.profiler's top ops by self device time (CPU time on CPU), and how much of
    the step's wall time the device was busy."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        wall = step_times(run["model"], run["optim"], device, run["data"], 1)[0]
    rows = prof.key_averages()
    if device.type == "cuda":  # the kernels' own rows (an op's row would count its kernels' time a second time)
        rows = [r for r in rows if str(r.device_type).endswith("CUDA")]

    def self_us(r):
        if device.type != "cuda":
            return r.self_cpu_time_total
        return getattr(r, "self_device_time_total", None) or getattr(r, "self_cuda_time_total", 0)
    busy_us = sum(self_us(r) for r in rows)
    ranked = sorted(rows, key=self_us, reverse=True)[:top]
    return {"step_wall_s": wall, "device_busy_s": busy_us / 1e6, "device_busy_share": busy_us / 1e6 / wall,
            "top": [{"op": r.key, "calls": r.count, "self_s": self_us(r) / 1e6,
                     "share_of_busy": self_us(r) / busy_us if busy_us else 0.0} for r in ranked]}


def plan_ratios(r: dict, plan: dict) -> dict:
    """Measured against the plan, like with like: the allocator's reserved and allocated peaks hold no CUDA context
    or NCCL buffers, so they are held against the plan without its assumed CUDA_OVERHEAD_GIB; the device's own
    used memory (mem_get_info, which holds them) against the whole plan."""
    out = {"reserved_over_plan": r["max_memory_reserved"] / plan["without_cuda_context"],
           "allocated_over_plan_without_context": r["max_memory_allocated"] / plan["without_cuda_context"]}
    if "device_used" in r:
        out["device_used_over_plan"] = r["device_used"] / plan["total"]
    return out


def tier_outcome(junit: str | None, log: str | None, rc: int | None, collected: str | None = None) -> dict | None:
    """The test tier's counts from pytest's junit XML, or, where pytest was cut short before writing it, from the
    outcome lines of its -v log (the tests that ended); its exit status; and (`collected`: the ids, one a line)
    the tests that did not run."""
    if junit is None and rc is None:
        return None
    import re
    import xml.etree.ElementTree as ET
    out = {"exit_status": rc, "timed_out": rc == 124}
    if (not junit or not os.path.isfile(junit)) and log and os.path.isfile(log):
        with open(log) as f:
            ended = re.findall(r"^(\S+::\S+) (PASSED|FAILED|SKIPPED|ERROR)", f.read(), re.M)
        kinds = [k for _, k in ended]
        out.update(source="log (no junit XML: pytest did not reach its end)", tests=len(ended),
                   failures=kinds.count("FAILED"), errors=kinds.count("ERROR"), skipped=kinds.count("SKIPPED"),
                   seconds=0.0, failed=[t for t, k in ended if k in ("FAILED", "ERROR")])
    elif junit and os.path.isfile(junit):
        suite = ET.parse(junit).getroot()
        suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
        out.update({k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")},
                   seconds=float(suite.get("time", 0)),
                   failed=[f"{c.get('classname')}::{c.get('name')}" for c in suite.iter("testcase")
                           if c.find("failure") is not None or c.find("error") is not None])
    if collected and os.path.isfile(collected) and log and os.path.isfile(log):
        with open(log) as f:
            ended = set(re.findall(r"^(\S+::\S+) (?:PASSED|FAILED|SKIPPED|ERROR)", f.read(), re.M))
        with open(collected) as f:
            out["not_run"] = [t for t in (ln.strip() for ln in f) if "::" in t and t not in ended]
    return out


def gpu_identity(device) -> dict:
    import torch
    if device.type != "cuda":
        return {"name": "cpu (smoke run)"}
    smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader", "-i", "0"],
                         capture_output=True, text=True) if shutil.which("nvidia-smi") else None
    props = torch.cuda.get_device_properties(device)
    return {"name": props.name, "memory_GiB": round(props.total_memory / GIB, 1),
            "driver": smi.stdout.strip() if smi and smi.returncode == 0 else "unknown (no nvidia-smi)",
            "cuda": torch.version.cuda, "torch": torch.__version__}


# ---------------------------------------------------------------- the parts, in order

def shape_dir(work: str, name: str, tiny: bool) -> tuple[str, dict]:
    from transformers import Qwen2Config
    path = os.path.join(work, f"model-{name}")
    if tiny:
        shape = dict(SHAPES["0.5b"], **TINY)
        Qwen2Config(**shape).save_pretrained(path)
        return path, shape
    return write_qwen_config(path, shape=name), SHAPES[name]


def attempt(errors: list, part: str, fn):
    """fn()'s result; if it raises, the error is listed (the results say which part failed and why) and None is
    returned, so one failing part does not lose the others' figures."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - recorded, and the run's exit status says so
        errors.append(f"{part}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        print(f"gpu_bench: {errors[-1]}", file=sys.stderr, flush=True)
        free({})
        return None


def measure_shape(name: str, model_dir: str, shape: dict, fit: tuple, a, device, peak, first: bool, res: dict,
                  budget: Budget) -> None:
    """One shape, eager: its figures into res["shapes"][name]; at the first shape also the save parts; a profile
    of one step when under the MFU goal."""
    run = throughput(model_dir, shape, fit, a, device, False, peak)
    r = run["result"]
    r.update(flops=model_flops_per_token(shape, a.seq_len), plan_bytes=fit[2])
    if "max_memory_reserved" in r:
        r.update(plan_ratios(r, fit[2]))
        r["reserved_within_20pct_of_plan"] = abs(r["reserved_over_plan"] - 1) <= 0.2  # the goal
    res["shapes"][name] = {"eager": r}
    errors = res["errors"]
    try:
        if first:  # the saves at the first (smallest) shape, before a larger one needs the memory
            if budget.allows("async saves", 60):
                res["async_save"] = attempt(errors, "async saves", lambda: dict(async_saves(run, a, device, a.work),
                                                                                 shape=name))
            if budget.allows("memory tier", 45):
                res["memory_tier"] = attempt(errors, "memory tier", lambda: dict(
                    memory_tier(run, a, device, r["tokens_per_step"], a.work), shape=name))
        if (r["mfu"] is None or r["mfu"] < MFU_GOAL or a.tiny) and budget.allows(f"{name} profile of one step", 20):
            r["profile"] = attempt(errors, f"{name} profile", lambda: profile_one_step(run, device))
    finally:
        free(run)


def compiled(name: str, model_dir: str, shape: dict, fit: tuple, a, device, peak, res: dict) -> None:
    run = throughput(model_dir, shape, fit, a, device, True, peak)
    res["shapes"][name]["compiled"] = c = run["result"]
    free(run)
    c["compiled_over_eager_tokens_per_s"] = c["tokens_per_s"] / res["shapes"][name]["eager"]["tokens_per_s"]
    c["compile_s"] = c["warmup_step_s"][0] - c["median_step_s"]


def run_parts(a, device, budget: Budget) -> dict:
    gpu = gpu_identity(device)
    peak = peak_tflops(gpu["name"], a.peak_tflops)
    res = {"gpu": gpu, "peak_bf16_tflops": peak, "seq_len": a.seq_len, "global_batch": a.batch, "steps": a.steps,
           "mfu_goal": MFU_GOAL, "shapes": {}, "skipped": budget.skipped, "errors": []}
    largest = None
    for name in ["tiny"] if a.tiny else a.shapes:
        model_dir, shape = shape_dir(a.work, name, a.tiny)
        fit = fitting_batch(model_dir, a, device)
        if fit is None:
            budget.skipped.append(f"{name}: --plan needs more than 90% of the GPU's memory even at micro batch 1")
            continue
        if not budget.allows(f"{name} eager", 45):
            break
        attempt(res["errors"], f"{name} eager", lambda: measure_shape(name, model_dir, shape, fit, a, device, peak,
                                                                      not res["shapes"], res, budget))
        if name in res["shapes"]:
            largest = (name, model_dir, shape, fit)
    if largest is None:
        return res
    name, model_dir, shape, fit = largest
    if a.tiny:
        budget.skipped.append("compile: not in a --tiny run (inductor needs a C++ compiler on CPU)")
    elif budget.allows(f"{name} model.compile=true", 150):
        attempt(res["errors"], f"{name} compiled", lambda: compiled(name, model_dir, shape, fit, a, device, peak, res))
    best = max(res["shapes"][name].values(), key=lambda r: r["tokens_per_s"])
    res["largest"] = {"shape": name, "compile": best["compile"], "mfu": best["mfu"],
                      "meets_goal": None if best["mfu"] is None else best["mfu"] >= MFU_GOAL}
    return res


def to_markdown(r: dict) -> list[str]:
    g = r["gpu"]
    lines = [f"{g['name']}, driver {g.get('driver', '-')}, CUDA {g.get('cuda', '-')}, peak dense bf16 "
             f"{r['peak_bf16_tflops']} TFLOP/s; seq_len {r['seq_len']}, {r['steps']} timed steps. "
             + provenance.markdown_line(r), "",
             "| shape | way | micro batch x accumulation | tokens/s | MFU | max allocated | max reserved | plan | "
             "reserved / plan |", "|---|---|---|---|---|---|---|---|---|"]
    for name, ways in r["shapes"].items():
        for way, m in ways.items():
            gib = (lambda k: f"{m[k] / GIB:.1f} GiB" if k in m else "-")  # noqa: E731
            lines.append(f"| {name} | {way} | {m['micro_batch']} x {m['accumulation']} | {m['tokens_per_s']:,.0f} | "
                         f"{'-' if m['mfu'] is None else format(m['mfu'], '.1%')} | {gib('max_memory_allocated')} | "
                         f"{gib('max_memory_reserved')} | {ways['eager']['plan_bytes']['total'] / GIB:.1f} GiB | "
                         f"{format(m['reserved_over_plan'], '.2f') if 'reserved_over_plan' in m else '-'} |")
    if r.get("async_save"):
        s = r["async_save"]
        lines += ["", f"Async save ({s['shape']}, {s['bytes'] / 1e9:.2f} GB): blocking {s['blocking_s']:.3f} s against "
                  f"the pinned D2H floor {s['d2h_pinned_floor_s']:.3f} s ({s['blocking_over_floor']:.2f}x); committed "
                  f"after {s['committed_s']:.2f} s against {s['disk_write_of_the_bytes_s']:.2f} s for the disk "
                  f"({s['disk_GBps']:.2f} GB/s by dd) ({s['committed_over_disk_write']:.2f}x)."]
    if r.get("memory_tier"):
        lines += ["", f"Memory-tier save every step: {r['memory_tier']['memory_over_none']:.1%} of the tokens/s "
                  f"without checkpointing (goal 97%)."]
    for name, ways in r["shapes"].items():
        if ways["eager"].get("profile"):
            p = ways["eager"]["profile"]
            lines += ["", f"One eager step of {name} profiled: {p['step_wall_s']:.3f} s, device busy "
                      f"{p['device_busy_share']:.0%}; top by self time:", "", "| op or kernel | calls | s | share |",
                      "|---|---|---|---|"]
            lines += [f"| `{t['op'][:60]}` | {t['calls']} | {t['self_s']:.4f} | {t['share_of_busy']:.1%} |"
                      for t in p["top"]]
    t = r.get("test_tier")
    if t:
        lines += ["", f"Single-GPU test tier: exit {t['exit_status']}"
                  + (" (out of its time)" if t["timed_out"] else "")
                  + (f", {t['tests']} tests ended, {t['failures']} failed, {t['errors']} errors, {t['skipped']} "
                     f"skipped" + (f", {t['seconds']:.0f} s" if t["seconds"] else " (from the log)") if "tests" in t
                     else "") + "".join(f"; failed {f}" for f in t.get("failed", []))
                  + "".join(f"; did not run {n}" for n in t.get("not_run", []))]
    lines += [""] + [f"Skipped: {s}" for s in r["skipped"]] + [f"Failed: {e}" for e in r["errors"]]
    return lines


def main(argv=None) -> int:
    a = parse_args(argv)
    started = provenance.start(argv)
    budget = Budget(a.budget_s)
    import torch
    if a.device == "cuda" and not torch.cuda.is_available():
        print("error: no CUDA device (torch.cuda.is_available() is False): bench/gpu_bench.py measures a GPU and "
              "wrote nothing", file=sys.stderr)
        return 1
    a.work = a.work_dir or tempfile.mkdtemp(prefix="gpu_bench_")
    if a.tiny:
        a.seq_len, a.batch, a.steps, a.saves = min(a.seq_len, 32), min(a.batch, 2), min(a.steps, 2), min(a.saves, 1)
    device = init_world(a.device)
    try:
        res = run_parts(a, device, budget)
    finally:
        import torch.distributed as dist
        dist.destroy_process_group()
        if not a.work_dir:
            shutil.rmtree(a.work, ignore_errors=True)
    res["test_tier"] = tier_outcome(a.tier_junit, a.tier_log, a.tier_rc, a.tier_collected)
    name = "gpu_bench" if a.device == "cuda" else "gpu_bench_cpu_smoke"
    os.makedirs(a.out, exist_ok=True)
    provenance.record(res, name, a.out, started)
    provenance.write_markdown(a.out, name, to_markdown(res))
    return 1 if res["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())

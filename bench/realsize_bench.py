"""Real-size run: the Qwen2.5-0.5B shape (random init) on 2 CPU ranks with process-mode async saves, each rank's
memory attributed to phases, the checkpoint events' timings against the memcpy floor, and the CPU plan.

    python bench/realsize_bench.py                     # 24 blocks, 494M params: ~15 min, ~2 x 11 GiB; opt-in
    python bench/realsize_bench.py --layers 8          # the 255M shape the tests use: ~2 x 6 GiB
    python bench/realsize_bench.py --layers 8 --repo /path/to/other/checkout --tag baseline   # the same, other code

Runs train_fsdp.py under torchrun with bench/rss_sampler.py on its process tree, then a resume of the last
checkpoint at 1 rank (load at another world size) for one step. Phases come from metrics.jsonl's clock: build
(until the first step), each step, and each save (from its step's record until its commit); a rank's peak
in each is the largest VmRSS sampled then. Also: `--plan --cpu`'s per-rank total, the first and steady async
save's blocking against a bare copy of the rank's bytes (memcpy floor), and the steps that overlapped an
upload against the others. Writes bench/results/realsize_bench[-TAG].json and keeps the run under
bench/results/runs/ (bench/provenance.py: commit and dirty flag, date, machine, load, command). Nothing here is run by the tests.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from bench.qwen_shape import write_qwen_config  # noqa: E402
from bench.rss_sampler import RSSSampler  # noqa: E402
from finetune.config import load_config  # noqa: E402
from common.dist import free_port  # noqa: E402
import provenance  # noqa: E402 - bench/provenance.py, beside this script
from finetune.plan import checkpoint_bytes, model_shapes  # noqa: E402

GIB = 2 ** 30


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=24, help="decoder blocks: 24 is Qwen2.5-0.5B, 8 the test's 255M")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--every", type=int, default=2, help="ckpt.interval")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--repo", default=ROOT, help="the checkout whose train_fsdp.py runs (default: this one)")
    p.add_argument("--tag", default="", help="suffix of the results file")
    p.add_argument("--work-dir", default=None, help="where the run goes (default: a temp dir, removed)")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    return p.parse_args(argv)


def run_sampled(cmd: list[str], cwd: str) -> tuple[RSSSampler, float, float]:
    t0 = time.time()
    proc = subprocess.Popen(cmd, cwd=cwd, env={**os.environ, "OMP_NUM_THREADS": "1"})
    with RSSSampler(proc.pid) as sampler:
        code = proc.wait()
    if code:
        raise SystemExit(f"error: {' '.join(cmd[:6])} ... exited {code}")
    return sampler, t0, time.time()


def read_jsonl(path: str) -> tuple[list[dict], list[dict]]:
    steps, events = [], []
    with open(path) as f:
        for line in f:
            rec = json.loads(line)
            (events if "event" in rec else steps).append(rec)
    return steps, events


def phases(steps: list[dict], saves: list[dict], t_start: float, t_end: float) -> list[tuple[str, float, float]]:
    """(name, t0, t1): build until the first step ends, each step, each save from its step until its commit."""
    out, prev = [("build + first step", t_start, steps[0]["time"])], steps[0]["time"]
    for s in steps[1:]:
        out.append((f"step {s['step']}", prev, s["time"]))
        prev = s["time"]
    by_step = {s["step"]: s["time"] for s in steps}
    for e in saves:
        t = by_step.get(e["step"], prev)
        out.append((f"save {e['step']} ({e['mode']}: staging, upload, commit)", t, t + e["committed_s"]))
    out.append(("final save and exit", prev, t_end))
    return out


def memcpy_floor_s(nbytes: int) -> float:
    """A warm copy of one rank's checkpoint bytes into a preallocated buffer: what staging cannot beat."""
    import torch
    src, dst = torch.ones(nbytes // 4), torch.empty(nbytes // 4)
    dst.copy_(src)
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return min(times)


def overlapped_steps(steps: list[dict], saves: list[dict]) -> dict:
    """Step durations split by whether an upload was running during them."""
    windows = [(next(s["time"] for s in steps if s["step"] == e["step"]), e["committed_s"]) for e in saves
               if any(s["step"] == e["step"] for s in steps)]
    quiet, busy = [], []
    for a, b in zip(steps, steps[1:]):
        overlap = any(t < b["time"] and t + c > a["time"] for t, c in windows)
        (busy if overlap else quiet).append(b["time"] - a["time"])
    return {"quiet_step_s": quiet, "overlapping_step_s": busy,
            "ratio": statistics.median(busy) / statistics.median(quiet) if quiet and busy else None}


def main(argv=None):
    a = parse_args(argv)
    started = provenance.start(argv)  # at the start: the code that ran, the load it ran under
    if a.repo != ROOT:  # another checkout's code is what runs: its commit, not this one's
        started.update(repo=a.repo, git_commit=subprocess.run(["git", "rev-parse", "HEAD"], cwd=a.repo,
                                                              capture_output=True, text=True).stdout.strip())
    work = a.work_dir or tempfile.mkdtemp(prefix="realsize-")
    model = write_qwen_config(os.path.join(work, "model"), a.layers)
    run = os.path.join(work, "run")
    common = ["--config", "configs/tiny.yaml", f"model.config_path={model}", "model.tokenizer_path=assets/tiny-llama",
              f"data.seq_len={a.seq_len}", f"data.global_batch_size={a.nproc}", "data.micro_batch_size=1",
              "ckpt.async_mode=process"]
    plan = subprocess.run([sys.executable, "train_fsdp.py", *common, "--plan", "--cpu", "--gpus-per-node",
                           str(a.nproc)], cwd=a.repo, capture_output=True, text=True)
    planned = re.search(r"^\s+total\s+([\d.]+) GiB", plan.stdout, re.M)
    train = common + [f"run.dir={run}", f"data.cache_dir={os.path.join(work, 'tok')}", f"ckpt.interval={a.every}",
                      "ckpt.keep_last=1", "train.sample_at_end=false", "train.eval_interval=0", "run.log_interval=1",
                      "run.progress_bar=false"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--master_addr", "127.0.0.1"]
    sampler, t0, t1 = run_sampled(torchrun + ["--nproc_per_node", str(a.nproc), "--master_port", str(free_port()),
                                              "train_fsdp.py", *train, f"train.max_steps={a.steps}"], a.repo)
    steps, events = read_jsonl(os.path.join(run, "metrics.jsonl"))
    saves = [e for e in events if e["event"] == "checkpoint" and e["mode"] != "sync"]
    rank_bytes = checkpoint_bytes(model_shapes(load_config(None, [f"model.config_path={model}"]).model), a.nproc)[1]
    floor = memcpy_floor_s(rank_bytes)
    result = {
        "layers": a.layers, "nproc": a.nproc, "steps": a.steps, "every": a.every, "seq_len": a.seq_len,
        "planned_total_GiB_per_rank": float(planned.group(1)) if planned else None, "plan": plan.stdout,
        "peak_rss_GiB": {r: round(sampler.peak(r) / GIB, 3) for r in sorted(sampler.samples)},
        "uploader_peak_rss_GiB": round(sampler.uploader_peak / GIB, 3),
        "phases": [{"phase": name, **{f"rank{r}_peak_GiB": round(sampler.peak_between(r, p0, p1) / GIB, 3)
                                      for r in sorted(sampler.samples)}, "seconds": round(p1 - p0, 2)}
                   for name, p0, p1 in phases(steps, saves, t0, t1)],
        "saves": [{k: e[k] for k in ("step", "mode", "blocking_s", "upload_s", "committed_s")} for e in saves],
        "memcpy_floor_s": floor, "rank_bytes": rank_bytes,
        "upload_overlap": overlapped_steps(steps, saves), "losses": [s["loss"] for s in steps]}
    if len(saves) >= 2:
        steady = statistics.median(e["blocking_s"] for e in saves[1:])
        result["first_over_steady_blocking"] = saves[0]["blocking_s"] / steady
        result["steady_blocking_over_memcpy_floor"] = steady / floor if floor else None
    resume, r0, r1 = run_sampled(torchrun + ["--nproc_per_node", "1", "--master_port", str(free_port()),
                                             "train_fsdp.py", *train, f"train.max_steps={a.steps + 1}",
                                             "data.global_batch_size=2", "ckpt.resume=auto"], a.repo)
    result["resume_at_1_rank_peak_rss_GiB"] = round(resume.peak(0) / GIB, 3)
    name = f"realsize_bench{'-' + a.tag if a.tag else ''}"
    provenance.record(result, name, a.out, started)
    print(json.dumps({k: v for k, v in result.items() if k not in ("plan", "phases")}, indent=1))
    print(f"wrote {os.path.join(a.out, name + '.json')} and a copy under runs/{name}/")
    if not a.work_dir:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

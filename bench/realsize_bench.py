"""Real-size run: the Qwen2.5-0.5B shape (random init) on 2 CPU ranks with async saves (process mode): each rank's
memory by phase against `--plan --cpu`, the saves against the memcpy floor and the disk's own write rate, steps
that overlap an upload against quiet ones, and the loads and the export.

    python bench/realsize_bench.py                          # 24 blocks, 494M params: ~7 min idle, ~2 x 10 GiB; opt-in
    python bench/realsize_bench.py --async-mode thread --upload-nice 19 --tag thread   # the other async mode
    python bench/realsize_bench.py --layers 8               # the 255M shape tests/test_plan_measured.py uses
    python bench/realsize_bench.py --layers 1 --vocab 512 --steps 4 --out /tmp/rs   # seconds: a smoke run
    python bench/realsize_bench.py --layers 8 --repo /path/to/other/checkout --tag baseline   # other code

Runs train_fsdp.py under torchrun with bench/rss_sampler.py on its process tree (saves every --every steps, an
export at the end), then two resumes of its last checkpoint for one step each: at the same world size (load) and
at 1 rank (load at another world size). Phases come from metrics.jsonl's clock and rank 0's log lines, stamped as
they arrive (bench/realsize_phases.py). Beside the runs, in the same invocation: the disk's sequential write rate
(dd, every rank's bytes at once) and the memcpy floor of a rank's bytes (all ranks at once), before and after
training (bench/host_rates.py). --upload-nice trains again at each further ckpt.upload_nice (the overlap and
time-to-commit trade-off). Writes bench/results/realsize_bench[-TAG].{json,md} and keeps the run under
bench/results/runs/ (bench/provenance.py). Nothing here is run by the default tests but a smoke run.
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
from bench.host_rates import disk_write_s, memcpy_floor_s, probe_bytes  # noqa: E402 - after the path insert
from bench.qwen_shape import write_qwen_config  # noqa: E402
from bench.realsize_phases import overlapped_steps, phase_windows, plan_check, rank_peaks, to_markdown  # noqa: E402
from bench.rss_sampler import RSSSampler  # noqa: E402
from common.dist import free_port  # noqa: E402
from finetune.config import CkptConfig, load_config  # noqa: E402
from finetune.optim import OPTIMIZERS  # noqa: E402
from finetune.plan import checkpoint_bytes, model_shapes  # noqa: E402
import provenance  # noqa: E402 - bench/provenance.py, beside this script

GIB = 2 ** 30


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=24, help="decoder blocks: 24 is Qwen2.5-0.5B, 8 the test's 255M")
    p.add_argument("--vocab", type=int, default=None, help="vocabulary (default Qwen's 151,936); small for a smoke run")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--every", type=int, default=2, help="ckpt.interval")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--async-mode", choices=("process", "thread"), default="process", help="ckpt.async_mode")
    p.add_argument("--upload-nice", type=int, nargs="*", default=None,
                   help="ckpt.upload_nice of the run, then of one more training run each (default: the config's, "
                        "then 0; none with --repo, whose code may not know the key)")
    p.add_argument("--repo", default=ROOT, help="the checkout whose train_fsdp.py runs (default: this one)")
    p.add_argument("--tag", default="", help="suffix of the results file")
    p.add_argument("--work-dir", default=None, help="where the runs go (default: a temp dir, removed)")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    a = p.parse_args(argv)
    if a.upload_nice is None:
        a.upload_nice = [CkptConfig().upload_nice, 0] if os.path.realpath(a.repo) == ROOT else []
    return a


def run_sampled(cmd: list[str], cwd: str) -> dict:
    """Run `cmd` with the sampler on its process tree; rank 0's output lines are stamped as they arrive."""
    t0, lines = time.time(), []
    proc = subprocess.Popen(cmd, cwd=cwd, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    with RSSSampler(proc.pid) as sampler:
        for line in proc.stdout:
            lines.append((time.time(), line.rstrip("\n")))
        code = proc.wait()
    if code:
        print("\n".join(text for _, text in lines[-40:]), file=sys.stderr)
        raise SystemExit(f"error: {' '.join(cmd[:6])} ... exited {code}")
    return {"sampler": sampler, "t0": t0, "t1": time.time(), "lines": lines}


def read_jsonl(path: str) -> tuple[list[dict], list[dict]]:
    steps, events = [], []
    with open(path) as f:
        for line in f:
            rec = json.loads(line)
            (events if "event" in rec else steps).append(rec)
    return steps, events


def host_probes(folder: str, rank_bytes: int, nproc: int) -> dict:
    """The disk's write rate (every rank's bytes by dd at once) and the memcpy floor (all ranks copying at once)."""
    disk_s = disk_write_s(folder, rank_bytes, nproc)
    return {"disk_GBps": nproc * probe_bytes(rank_bytes) / disk_s / 1e9, "memcpy_floor_s": memcpy_floor_s(rank_bytes, nproc)}


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


class Runs:
    """The torchrun invocations of one benchmark: the same model, data and shape; each its own run folder."""

    def __init__(self, a, work: str, model: str):
        self.a, self.work = a, work
        self.common = ["--config", "configs/tiny.yaml", f"model.config_path={model}",
                       "model.tokenizer_path=assets/tiny-llama", f"data.seq_len={a.seq_len}",
                       f"data.global_batch_size={a.nproc}", "data.micro_batch_size=1", f"ckpt.async_mode={a.async_mode}",
                       f"data.cache_dir={os.path.join(work, 'tok')}", "train.sample_at_end=false",
                       "train.eval_interval=0", "run.log_interval=1", "run.progress_bar=false"]

    def plan(self) -> str:
        return subprocess.run([sys.executable, "train_fsdp.py", *self.common, "--plan", "--cpu", "--gpus-per-node",
                               str(self.a.nproc)], cwd=self.a.repo, capture_output=True, text=True, check=True).stdout

    def train(self, name: str, nproc: int, extra: list[str]) -> dict:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--master_addr", "127.0.0.1", "--master_port",
               str(free_port()), "--nproc_per_node", str(nproc), "train_fsdp.py", *self.common,
               f"run.dir={os.path.join(self.work, name)}", *extra]
        run = run_sampled(cmd, self.a.repo)
        run["steps"], run["events"] = read_jsonl(os.path.join(self.work, name, "metrics.jsonl"))
        return run

    def training(self, name: str, nice: int | None, export: bool) -> dict:
        return self.train(name, self.a.nproc, [f"train.max_steps={self.a.steps}", f"ckpt.interval={self.a.every}",
                                               "ckpt.keep_last=1", f"export.at_end={str(export).lower()}"]
                          + ([f"ckpt.upload_nice={nice}"] if nice is not None else []))

    def resume(self, name: str, nproc: int, ckpt: str) -> dict:
        """One step from `ckpt` and no save: what loading it costs, in time and memory."""
        return self.train(name, nproc, [f"train.max_steps={self.a.steps + 1}", f"ckpt.resume={ckpt}",
                                        "ckpt.interval=0", "ckpt.save_at_end=false"])


def async_saves(run: dict) -> list[dict]:
    return [{k: e[k] for k in ("step", "mode", "blocking_s", "upload_s", "committed_s")}
            for e in run["events"] if e["event"] == "checkpoint" and e["mode"] != "sync"]


def save_summary(run: dict, ckpt_bytes: int, disk_GBps: float) -> dict:
    """Blocking (first, steady), time to commit, each save kind's write rate against the disk's."""
    saves = async_saves(run)
    final = [e for e in run["events"] if e["event"] == "checkpoint" and e["mode"] == "sync"]
    out = {"saves": saves, "checkpoint_GB": ckpt_bytes / 1e9, "overlap": overlapped_steps(run["steps"], saves)}
    if saves:
        steady = saves[1:] or saves
        out.update(first_blocking_s=saves[0]["blocking_s"],
                   steady_blocking_s=statistics.median(e["blocking_s"] for e in steady),
                   committed_s_median=statistics.median(e["committed_s"] for e in steady),
                   async_write_GBps=statistics.median(ckpt_bytes / e["upload_s"] / 1e9 for e in steady))
        out["async_write_over_disk"] = out["async_write_GBps"] / disk_GBps
    if final:  # the final save at the end: sync, nothing else running
        out["sync_write_GBps"] = ckpt_bytes / final[-1]["upload_s"] / 1e9
        out["sync_write_over_disk"] = out["sync_write_GBps"] / disk_GBps
    return out


def main(argv=None):
    a = parse_args(argv)
    started = provenance.start(argv)  # at the start: the code that ran, the load it ran under
    if a.repo != ROOT:  # another checkout's code is what runs: its commit, not this one's
        started.update(repo=a.repo, git_commit=subprocess.run(["git", "rev-parse", "HEAD"], cwd=a.repo,
                                                              capture_output=True, text=True).stdout.strip())
    work = a.work_dir or tempfile.mkdtemp(prefix="realsize-")
    model = write_qwen_config(os.path.join(work, "model"), a.layers, a.vocab)
    shapes = model_shapes(load_config(None, [f"model.config_path={model}"]).model)
    rank_bytes = checkpoint_bytes(shapes, a.nproc, OPTIMIZERS["adamw"].state_bytes)[1]  # its runs' default
    runs = Runs(a, work, model)
    plan = runs.plan()
    probes = [host_probes(work, rank_bytes, a.nproc)]
    main_nice = a.upload_nice[0] if a.upload_nice else None
    train = runs.training("run", main_nice, export=True)
    probes.append(host_probes(work, rank_bytes, a.nproc))
    ckpt = os.path.join(work, "run", "checkpoints", f"step-{a.steps:06d}")
    loads = {f"W={a.nproc}": runs.resume("load-same", a.nproc, ckpt), "W=1": runs.resume("load-1", 1, ckpt)}
    disk = statistics.median(p["disk_GBps"] for p in probes)
    floor = statistics.median(p["memcpy_floor_s"] for p in probes)
    ckpt_bytes = dir_bytes(ckpt)
    result = {
        "layers": a.layers, "vocab": shapes.vocab, "params": shapes.params, "nproc": a.nproc, "steps": a.steps,
        "every": a.every, "seq_len": a.seq_len, "async_mode": a.async_mode, "rank_bytes": rank_bytes, "plan": plan,
        "peak_rss_GiB": {r: round(train["sampler"].peak(r) / GIB, 3) for r in sorted(train["sampler"].samples)},
        "uploader_peak_rss_GiB": round(train["sampler"].uploader_peak / GIB, 3),
        "machine_min_available_GiB": round((train["sampler"].min_available or 0) / GIB, 2),
        "phases": rank_peaks(train, phase_windows(train, async_saves(train))),
        "loads": {w: {"seconds": round(run["t1"] - run["t0"], 1),
                      "phases": rank_peaks(run, phase_windows(run, [])),
                      "peak_rss_GiB": {r: round(run["sampler"].peak(r) / GIB, 3) for r in sorted(run["sampler"].samples)}}
                  for w, run in loads.items()},
        "host": {"probes": probes, "disk_GBps": disk, "memcpy_floor_s": floor},
        "losses": [s["loss"] for s in train["steps"]]}
    result["plan_check"] = plan_check(plan, train, async_saves(train))
    result["upload_nice"] = {str(main_nice if main_nice is not None else "default"): save_summary(train, ckpt_bytes, disk)}
    for nice in a.upload_nice[1:]:
        result["upload_nice"][str(nice)] = save_summary(runs.training(f"nice-{nice}", nice, export=False),
                                                        ckpt_bytes, disk)
    main = next(iter(result["upload_nice"].values()))
    result["blocking"] = {"first_s": main.get("first_blocking_s"), "steady_s": main.get("steady_blocking_s"),
                          "memcpy_floor_s": floor}
    if main.get("steady_blocking_s"):
        result["blocking"].update(first_over_steady=main["first_blocking_s"] / main["steady_blocking_s"],
                                  steady_over_floor=main["steady_blocking_s"] / floor)
    name = f"realsize_bench{'-' + a.tag if a.tag else ''}"
    provenance.record(result, name, a.out, started)
    provenance.write_markdown(a.out, name, to_markdown(result))
    print(f"wrote {os.path.join(a.out, name + '.json')} and a copy under runs/{name}/")
    if not a.work_dir:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

"""Tokenizing throughput and peak memory: the old one-process loop vs the datasets pipeline (docs/data.md).

    python bench/data_bench.py --conversations 200000 --lines 1000000 --repeats 3 --num-proc 2
    python bench/data_bench.py --conversations 20000 --lines 100000 --old-rows 10000 --repeats 2   # ~5 min

Writes bench/results/data_bench.{json,md} (--out) and keeps every run under bench/results/runs/data_bench/
(bench/provenance.py).

Generates a chat jsonl (conversations of 1-4 turns) and a text file, then tokenizes each with the tiny
tokenizer, alternating old and new, each run in a fresh process. "old" is finetune/data.py as of commit
7e96d2e (read with `git show`, so it is the exact code this replaced); "new" is build_cache. --old-rows N
runs the old loop on the file's first N rows only (its rows/s is flat in the size: one row at a time),
the new pipeline always on the whole file. Reports rows/s (median and min-max over repeats), the load
average before each run, memory, and the size of the result. Memory: the process's peak RSS (ru_maxrss),
and the peak, sampled every 0.2 s, of the whole pipeline: the process's RSS plus its worker processes'
private memory (USS: forked workers share the parent's pages, so their RSS would count those twice).
Both are given absolute and as growth over the RSS after every import (torch, transformers, datasets:
the same for both methods), and divided by the size of the finished cache. RSS also counts the pages of
memory-mapped files (the arrow files datasets reads and writes), which are page cache the kernel can drop,
so the last column gives the growth of anonymous memory alone: the process's `Anonymous` plus its
workers' `Private_Dirty` (what they copied or allocated), over the process's `Anonymous` after imports.
A last line gives the new pipeline's file-backed RSS (Rss - Anonymous) when finetune/data/cache.py's
_write_cache starts and ends: the pages of datasets' arrow files mapped into the process at that point.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import provenance  # bench/provenance.py, beside this script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OLD_COMMIT = "7e96d2e"


def make_chat(path: str, n: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            msgs = []
            for _ in range(rng.randint(1, 4)):
                word = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 12)))
                msgs += [{"role": "user", "content": f"reverse: {word}"}, {"role": "assistant", "content": word[::-1]}]
            f.write(json.dumps({"messages": msgs}) + "\n")


def make_text(path: str, n: int, seed: int = 1) -> None:
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            words = ("".join(rng.choice("abcdefghij klmnop") for _ in range(rng.randint(2, 9)))
                     for _ in range(rng.randint(4, 16)))
            f.write(" ".join(words) + "\n")


def _kib(pid: int, fields: tuple[str, ...]) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            return sum(int(line.split()[1]) for line in f if line.split(":")[0] in fields)
    except OSError:
        return 0


def _children(pid: int) -> list[int]:
    out = []
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                out += [int(c) for c in f.read().split()]
        except OSError:
            pass
    return out


class TreeMemory:
    """Peaks of (own RSS + children's USS) and of (own anonymous + children's private dirty), sampled in a thread."""

    def __init__(self, period: float = 0.2):
        self.peak, self.peak_anon, self._stop = 0, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, args=(period,), daemon=True)
        self._thread.start()

    def _run(self, period: float) -> None:
        me = os.getpid()
        while not self._stop.is_set():
            kids = _children(me)
            total = _kib(me, ("Rss",)) + sum(_kib(c, ("Private_Clean", "Private_Dirty")) for c in kids)
            anon = _kib(me, ("Anonymous",)) + sum(_kib(c, ("Private_Dirty",)) for c in kids)
            self.peak, self.peak_anon = max(self.peak, total), max(self.peak_anon, anon)
            self._stop.wait(period)

    def stop(self) -> tuple[int, int]:
        self._stop.set()
        self._thread.join()
        return self.peak, self.peak_anon


def _worker(method: str, path: str, cache_dir: str, num_proc: int, seq_len: int) -> dict:
    """One measurement, in this (fresh) process."""
    sys.path.insert(0, ROOT)
    import datasets  # noqa: F401 - every import before the baseline RSS, for both methods
    from transformers import AutoTokenizer

    import finetune.data.cache
    from finetune.config import DataConfig
    from finetune.data import build_cache
    datasets.disable_progress_bars()
    file_backed = _watch_write_cache(finetune.data.cache)
    tok = AutoTokenizer.from_pretrained(os.path.join(ROOT, "assets", "tiny-llama"))
    cfg = DataConfig(path=path, seq_len=seq_len, cache_dir=cache_dir, num_proc=num_proc)
    old = _load_old_module() if method == "old" else None
    base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    base_anon = _kib(os.getpid(), ("Anonymous",))
    file_backed["before"] = _kib(os.getpid(), ("Rss",)) - base_anon
    tree = TreeMemory()
    t0 = time.perf_counter()
    cache = old.cache_samples(cfg, tok) if old else build_cache(cfg, tok, num_proc=num_proc)
    secs = time.perf_counter() - t0
    size = sum(os.path.getsize(os.path.join(cache, f)) for f in os.listdir(cache))
    peak_tree, peak_anon = tree.stop()
    return {"seconds": secs, "cache_bytes": size, "rss_before_kib": base_rss,
            "peak_rss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, "peak_tree_kib": peak_tree,
            "anon_before_kib": base_anon, "peak_anon_kib": peak_anon, "file_backed_kib": file_backed}


def _watch_write_cache(data_module) -> dict:
    """This process's file-backed RSS (Rss - Anonymous: mapped files' pages, e.g. datasets' arrow files) when
    the new pipeline's _write_cache starts and ends; filled in as it runs."""
    seen, real = {}, data_module._write_cache

    def watched(*args, **kwargs):
        seen["write_start"] = _kib(os.getpid(), ("Rss",)) - _kib(os.getpid(), ("Anonymous",))
        try:
            return real(*args, **kwargs)
        finally:
            seen["write_end"] = _kib(os.getpid(), ("Rss",)) - _kib(os.getpid(), ("Anonymous",))
    data_module._write_cache = watched
    return seen


def _load_old_module():
    import importlib.util
    src = subprocess.run(["git", "-C", ROOT, "show", f"{OLD_COMMIT}:finetune/data.py"], check=True,
                         capture_output=True, text=True).stdout
    path = os.path.join(tempfile.mkdtemp(), "old_data.py")
    with open(path, "w") as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location("old_data", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["old_data"] = mod
    spec.loader.exec_module(mod)
    return mod


def head(path: str, rows: int, out: str) -> str:
    """The first `rows` lines of a file, for the old loop's subset."""
    with open(path) as f, open(out, "w") as g:
        for _, line in zip(range(rows), f):
            g.write(line)
    return out


def measure(method: str, path: str, rows: int, num_proc: int, seq_len: int, work: str) -> dict:
    load = os.getloadavg()[0]
    cache_dir = os.path.join(work, f"cache-{method}")
    shutil.rmtree(cache_dir, ignore_errors=True)
    env = {**os.environ, "HF_DATASETS_CACHE": os.path.join(work, "hf"), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, __file__, "--worker", method, path, cache_dir, str(num_proc), str(seq_len)],
                         capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise SystemExit(f"{method} failed:\n{out.stderr[-3000:]}")
    res = json.loads(out.stdout.strip().splitlines()[-1])
    shutil.rmtree(cache_dir, ignore_errors=True)
    shutil.rmtree(os.path.join(work, "hf"), ignore_errors=True)  # old: load_dataset's arrow copy
    return {**res, "rows": rows, "rows_per_s": rows / res["seconds"], "load_before": load,
            "load_after": os.getloadavg()[0]}


def summarize(name: str, runs: list[dict]) -> str:
    rps = [r["rows_per_s"] for r in runs]
    med = lambda key: statistics.median(key(r) for r in runs)  # noqa: E731
    cache_kib = runs[0]["cache_bytes"] / 1024
    tree, growth = med(lambda r: r["peak_tree_kib"]), med(lambda r: r["peak_tree_kib"] - r["rss_before_kib"])
    anon = med(lambda r: r["peak_anon_kib"] - r["anon_before_kib"])
    loads = [r["load_before"] for r in runs]
    return (f"| {name} | {runs[0]['rows']:,} | {statistics.median(rps):,.0f} ({min(rps):,.0f}-{max(rps):,.0f}) | "
            f"{min(loads):.1f}-{max(loads):.1f} | {med(lambda r: r['peak_rss_kib']) / 1024:,.0f} | "
            f"{tree / 1024:,.0f} | {growth / 1024:,.0f} | {cache_kib / 1024:,.1f} | "
            f"{tree / cache_kib:.1f}x / {growth / cache_kib:.1f}x | {anon / 1024:,.0f} ({anon / cache_kib:.1f}x) |")


def file_backed_line(name: str, runs: list[dict]) -> str:
    """The new pipeline's file-backed RSS (mapped arrow files) over imports when _write_cache starts and ends."""
    grow = {k: statistics.median(r["file_backed_kib"][k] - r["file_backed_kib"]["before"] for r in runs) / 1024
            for k in ("write_start", "write_end")}
    return (f"{name}: file-backed RSS over imports (median) when _write_cache starts {grow['write_start']:,.1f} MiB, "
            f"when it ends {grow['write_end']:,.1f} MiB; cache {runs[0]['cache_bytes'] / 2**20:,.1f} MiB")


HEADER = ("| data/method | rows | rows/s median (min-max) | load avg | peak RSS MiB | peak RSS + workers' USS MiB | "
          "same, growth over imports MiB | cache MiB | pipeline peak / cache (absolute / growth) | "
          "anonymous growth MiB (/ cache) |\n"
          "|---|---|---|---|---|---|---|---|---|---|")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--conversations", type=int, default=200_000)
    p.add_argument("--lines", type=int, default=1_000_000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--num-proc", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--old-rows", type=int, default=0, help="old loop on the first N rows only (0: all)")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    p.add_argument("--work", default=None, help="scratch folder (default: a temp dir, removed at the end)")
    args = p.parse_args()
    started = provenance.start()
    work = args.work or tempfile.mkdtemp(prefix="data_bench-")
    os.makedirs(work, exist_ok=True)
    files = {"chat": (os.path.join(work, "chat.jsonl"), args.conversations, make_chat),
             "text": (os.path.join(work, "text.txt"), args.lines, make_text)}
    results = {}
    for kind, (path, n, make) in files.items():
        if n <= 0:
            continue
        make(path, n)
        old_n = min(n, args.old_rows or n)
        inputs = {"old": (head(path, old_n, os.path.join(work, f"head-{old_n}-" + os.path.basename(path))) if old_n < n else path, old_n), "new": (path, n)}
        for rep in range(args.repeats):  # interleaved: old, new, old, new, ... so machine noise hits both
            for method in ("old", "new"):
                r = measure(method, *inputs[method], args.num_proc, args.seq_len, work)
                results.setdefault(f"{kind}/{method}", []).append(r)
                print(f"{kind} {method} rep {rep}: {r['rows_per_s']:,.0f} rows/s, peak RSS "
                      f"{r['peak_rss_kib'] / 1024:,.0f} MiB, load {r['load_before']:.1f}", file=sys.stderr, flush=True)
    ratios, pair_words = {}, {}
    for kind in files:
        if f"{kind}/old" in results:
            old = [r["rows_per_s"] for r in results[f"{kind}/old"]]
            new = [r["rows_per_s"] for r in results[f"{kind}/new"]]
            ratios[kind] = statistics.median(new) / statistics.median(old)
            pair_words[kind] = ", ".join(f"{b / a:.2f}x" for a, b in zip(old, new))
    res = provenance.record({"args": vars(args), "runs": results, "new_over_old_rows_per_s": ratios}, "data_bench",
                            args.out, started)
    lines = [provenance.markdown_line(res), "", f"{args.conversations:,} conversations, {args.lines:,} text lines "
             f"(old loop on the first {f'{args.old_rows:,}' if args.old_rows else 'all'} rows), {args.repeats} repeats "
             f"interleaved, new with num_proc={args.num_proc}", "", HEADER]
    lines += [summarize(name, runs) for name, runs in results.items()]
    lines += [""] + [file_backed_line(name, runs) for name, runs in results.items() if name.endswith("/new")]
    lines += [f"\n{kind}: new / old = {ratio:.2f}x rows/s (medians; per interleaved pair: {pair_words[kind]})"
              for kind, ratio in ratios.items()]
    print("\n" + "\n".join(lines))
    with open(os.path.join(args.out, "data_bench.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        method, path, cache_dir, num_proc, seq_len = sys.argv[2:7]
        print(json.dumps(_worker(method, path, cache_dir, int(num_proc), int(seq_len))))
    else:
        main()

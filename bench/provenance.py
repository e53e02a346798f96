"""Where a benchmark figure came from: every bench/ script records its runs through this module.

    python bench/checksum_bench.py --mib 8 --rounds 1 --out /tmp/r   # any bench script; then look at
    ls /tmp/r/runs/checksum_bench/                                     # one JSON per run, never overwritten

`start()` at the top of a script's main notes the load average before the run; `record()` at the end adds
the code (git commit, and whether the worktree had uncommitted changes to code: outside bench/results/, docs/,
tests/ and *.md), the UTC
date, the machine (CPU model, cores, RAM, kernel), the load average after, and the exact command line.
It writes the run twice: `<out>/runs/<name>/<UTC time>-<commit>.json`, which no later run overwrites (so a
claim like "met in N of M runs" can be checked against the M files), and `<out>/<name>.json`, the latest run,
which the docs quote and tests/test_docs_figures.py checks them against.
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _git(*args: str) -> str:
    proc = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
    return proc.stdout.strip() if proc.returncode == 0 else ""


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        return ""


def _ram_gib() -> float:
    try:
        with open("/proc/meminfo") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("MemTotal:"))
        return round(kib / 2**20, 1)
    except (OSError, StopIteration):
        return 0.0


def machine() -> dict:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    line = {"cpu": _cpu_model() or platform.machine(), "cores": cores, "ram_GiB": _ram_gib(),
            "kernel": f"{platform.system()} {platform.release()}", "python": platform.python_version()}
    if "torch" in sys.modules:  # only when the script imported it already: no import just to say its version
        line["torch"] = sys.modules["torch"].__version__
    return line


def start(argv: list[str] | None = None) -> dict:
    """Call first thing in main, with main's argv (None: the command line): the command and the load it started
    under."""
    script = os.path.relpath(os.path.abspath(sys.argv[0]), ROOT)
    args = sys.argv[1:] if argv is None else list(argv)
    return {**code(), "command": "python " + shlex.join([script, *args]),
            "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "load_average_before": os.getloadavg()}


def code() -> dict:
    """The commit checked out when the run starts (a commit made during the run is not what it measured)."""
    # dirty: uncommitted changes to what a run can execute; results, docs and tests do not change a measurement
    dirty = _git("status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)bench/results",
                 ":(exclude)docs", ":(exclude)tests", ":(exclude)*.md")
    return {"git_commit": _git("rev-parse", "HEAD") or "unknown", "git_dirty": bool(dirty)}


def provenance(started: dict) -> dict:
    return {**started, "finished_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "load_average_after": os.getloadavg(), "machine": machine()}


def record(result: dict, name: str, out_dir: str, started: dict) -> dict:
    """Add the provenance to `result`, append it as a new run file and make it the latest; returns `result`."""
    result["provenance"] = p = provenance(started)
    runs = os.path.join(out_dir, "runs", name)
    os.makedirs(runs, exist_ok=True)
    stem = p["finished_utc"].replace(":", "") + "-" + p["git_commit"][:9] + ("-dirty" if p["git_dirty"] else "")
    path, n = os.path.join(runs, stem + ".json"), 1
    while os.path.exists(path):  # two runs in the same second: both kept
        n += 1
        path = os.path.join(runs, f"{stem}-{n}.json")
    for target in (path, os.path.join(out_dir, name + ".json")):
        with open(target, "w") as f:
            json.dump(result, f, indent=1)
            f.write("\n")
    return result


def write_markdown(out_dir: str, name: str, lines: list[str]) -> None:
    """`<out>/<name>.md`, the run's table, which is also printed."""
    text = "\n".join(lines) + "\n"
    with open(os.path.join(out_dir, name + ".md"), "w") as f:
        f.write(text)
    print(text)


def markdown_line(result: dict) -> str:
    """One line for the top of a results table: what code, when, where, under what load, by which command."""
    p, m = result["provenance"], result["provenance"]["machine"]
    return (f"Commit {p['git_commit'][:9]}{' (with uncommitted changes)' if p['git_dirty'] else ''}, "
            f"{p['finished_utc']}; {m['cpu']}, {m['cores']} cores, {m['ram_GiB']} GiB, {m['kernel']}; "
            f"1-min load average {p['load_average_before'][0]:.2f} before, {p['load_average_after'][0]:.2f} after. "
            f"`{p['command']}`")

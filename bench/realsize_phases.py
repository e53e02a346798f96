"""What bench/realsize_bench.py makes of a sampled run: its phases, each rank's peak in each, the plan's components
against what the phases measured, the steps that overlapped an upload, and the results table.

    python bench/realsize_bench.py --layers 1 --vocab 512 --steps 4 --out /tmp/rs    # uses this

A run gives: metrics.jsonl (each step's end time; each checkpoint's blocking, upload and commit seconds), rank 0's
log lines stamped as they arrived ("world ..." once the model, optimizer and data are built; "resume: loading ...";
"export: writing ..."), and per rank VmRSS samples (bench/rss_sampler.py). Phases:
build (start until "world"; a resume's load inside it is its own phase), the first step (AdamW's state appears),
each later step, each async save's staging (its step's end + blocking) and upload (until committed), the final
save, the export. The plan check compares, per rank: the process with its parameter shards (VmRSS once built),
the staging buffers (VmRSS after the first save's staging minus after step 1: they are allocated in between),
the working set of a step (the peak of the steps after the first, once AdamW's state exists all through a step,
minus the staging and the VmRSS once built) and the run's peak, with the planner's items for each.
"""

from __future__ import annotations

import re
import statistics

import provenance  # bench/provenance.py, beside this file

GIB = 2 ** 30
UNITS = {"GiB": GIB, "MiB": 2 ** 20, "KiB": 2 ** 10, "B": 1}


def _line_time(lines: list, pattern: str, after: float = 0.0) -> float | None:
    return next((t for t, text in lines if t >= after and re.search(pattern, text)), None)


def phase_windows(run: dict, saves: list[dict]) -> list[tuple[str, float, float]]:
    """(name, t0, t1) of each phase of a sampled train_fsdp.py run (see the module docstring)."""
    lines, steps, t0, t1 = run["lines"], run["steps"], run["t0"], run["t1"]
    built = _line_time(lines, r"^world \d+ \|") or (steps[0]["time"] if steps else t1)
    out = [("build", t0, built)]
    load0, load1 = _line_time(lines, r"^resume: loading .* \.\.\.$"), _line_time(lines, r"^resume: loading .*: done in")
    if load0 and load1:
        out.append(("load (in build)", load0, load1))
    prev = built
    for i, s in enumerate(steps):
        out.append((f"step {s['step']}{' (the first)' if i == 0 else ''}", prev, s["time"]))
        prev = s["time"]
    by_step = {s["step"]: s["time"] for s in steps}
    for e in saves:
        t = by_step.get(e["step"], prev)
        out.append((f"save {e['step']}: staging (blocking)", t, t + e["blocking_s"]))
        out.append((f"save {e['step']}: upload until committed", t + e["blocking_s"], t + e["committed_s"]))
    export = _line_time(lines, r"^export: writing step", after=prev)
    out.append(("final save (sync) and exit" if not export else "final save (sync)", prev, export or t1))
    if export:
        out.append(("export", export, _line_time(lines, r"^export: step", after=export) or t1))
    return out


def rank_peaks(run: dict, windows: list) -> list[dict]:
    s = run["sampler"]
    return [{"phase": name, "seconds": round(b - a, 2),
             **{f"rank{r}_peak_GiB": round(s.peak_between(r, a, b) / GIB, 3) for r in sorted(s.samples)}}
            for name, a, b in windows]


def overlapped_steps(steps: list[dict], saves: list[dict]) -> dict:
    """Step durations split by whether an upload (from its step's end until committed) ran during them."""
    by_step = {s["step"]: s["time"] for s in steps}
    windows = [(by_step[e["step"]], e["committed_s"]) for e in saves if e["step"] in by_step]
    quiet, busy = [], []
    for a, b in zip(steps, steps[1:]):
        overlap = any(t < b["time"] and t + c > a["time"] for t, c in windows)
        (busy if overlap else quiet).append(b["time"] - a["time"])
    return {"quiet_step_s": quiet, "overlapping_step_s": busy,
            "ratio": statistics.median(busy) / statistics.median(quiet) if quiet and busy else None}


def plan_items(plan: str) -> dict[str, float]:
    """{item: bytes} of `--plan --cpu`'s per-rank lines, and its 'total'."""
    items = {}
    for what, value, unit in re.findall(r"^  (\S.*?)\s+([\d.]+) (GiB|MiB|KiB|B)(?: |$)", plan, re.M):
        if not what.startswith("per node"):
            items[what] = float(value) * UNITS[unit]
    return items


def _planned(items: dict, *prefixes: str) -> float:
    return sum(v for k, v in items.items() if k.startswith(prefixes))


def plan_check(plan: str, run: dict, saves: list[dict]) -> list[dict]:
    """The plan's components next to what the run's phases measured, per rank, GiB."""
    items, s, steps = plan_items(plan), run["sampler"], run["steps"]
    built = _line_time(run["lines"], r"^world \d+ \|") or run["t0"]
    base, staging = _planned(items, "parameters", "python"), _planned(items, "async staging")
    measured_base = {r: s.at(r, built) for r in s.samples}
    measured_staging = {r: 0 for r in s.samples}
    checks = [("the process and its parameter shards (once built)", base, measured_base)]
    if saves and steps:
        staged = steps[[x["step"] for x in steps].index(saves[0]["step"])]["time"] + saves[0]["blocking_s"]
        measured_staging = {r: s.at(r, staged) - s.at(r, steps[0]["time"]) for r in s.samples}
        checks.append(("async staging buffers (after the first save's staging - after step 1)", staging,
                       measured_staging))
    if steps:  # from step 2 on AdamW's state exists through the whole step (step 1 allocates it at its end)
        later = steps[0]["time"] if len(steps) > 1 else built
        checks.append(("a step's working set: gradients, AdamW, gathered, activations, logits (the later steps' "
                       "peak - staging - built)", items.get("total", 0) - base - staging,
                       {r: s.peak_between(r, later, steps[-1]["time"]) - measured_staging[r] - measured_base[r]
                        for r in s.samples}))
    checks.append(("total: the run's peak", items.get("total", 0), {r: s.peak(r) for r in s.samples}))
    return [{"component": what, "planned_GiB": round(planned / GIB, 3),
             "measured_GiB": {r: round(m / GIB, 3) for r, m in sorted(measured.items())},
             "measured_over_planned": {r: round(m / planned, 3) if planned else None for r, m in sorted(measured.items())}}
            for what, planned, measured in checks]


def _f(x, fmt: str = "{:.2f}") -> str:
    return "" if x is None else fmt.format(x)


def to_markdown(r: dict) -> list[str]:
    ranks = sorted(r["peak_rss_GiB"])
    out = [f"Qwen2.5-0.5B shape, {r['layers']} blocks, vocab {r['vocab']}: {r['params'] / 1e6:.0f}M params, "
           f"{r['nproc']} ranks, seq {r['seq_len']}, {r.get('async_mode', 'process')}-mode saves every {r['every']} steps. "
           + provenance.markdown_line(r), "",
           "| phase | seconds | " + " | ".join(f"rank {x} peak GiB" for x in ranks) + " |",
           "|---|---|" + "---|" * len(ranks)]
    out += [f"| {p['phase']} | {p['seconds']} | " + " | ".join(str(p.get(f"rank{x}_peak_GiB", "")) for x in ranks)
            + " |" for p in r["phases"]]
    out += ["", "| plan component | planned GiB | " + " | ".join(f"rank {x}: measured (x planned)" for x in ranks)
            + " |", "|---|---|" + "---|" * len(ranks)]
    for c in r["plan_check"]:
        out.append(f"| {c['component']} | {c['planned_GiB']} | " + " | ".join(
            f"{c['measured_GiB'].get(x, '')} ({_f(c['measured_over_planned'].get(x))})" for x in ranks) + " |")
    b, h = r["blocking"], r["host"]
    out += ["", f"- blocking: first {_f(b['first_s'])} s, steady {_f(b['steady_s'])} s (first / steady "
            f"{_f(b.get('first_over_steady'))}x); memcpy floor of a rank's {r['rank_bytes'] / 1e9:.2f} GB (all ranks "
            f"at once) {_f(h['memcpy_floor_s'], '{:.3f}')} s: steady / floor {_f(b.get('steady_over_floor'))}x",
            f"- disk (dd, every rank's bytes at once, before and after training): "
            f"{', '.join(_f(p['disk_GBps']) for p in h['probes'])} GB/s",
            f"- machine: smallest MemAvailable {r['machine_min_available_GiB']} GiB; uploader process peak VmRSS "
            f"{r['uploader_peak_rss_GiB']} GiB (it maps the same staging pages)"]
    for w, load in r["loads"].items():
        out.append(f"- resume at {w}: {load['seconds']} s in all, peak VmRSS "
                   + ", ".join(f"rank {x} {v} GiB" for x, v in load["peak_rss_GiB"].items()))
    out += ["", "| ckpt.upload_nice | overlapping / quiet step | time to commit (s) | steady blocking (s) | "
            "async write GB/s (x disk) | final sync save GB/s (x disk) |", "|---|---|---|---|---|---|"]
    for nice, s in r["upload_nice"].items():
        out.append(f"| {nice} | {_f(s['overlap']['ratio'])} | {_f(s.get('committed_s_median'))} | "
                   f"{_f(s.get('steady_blocking_s'))} | {_f(s.get('async_write_GBps'))} "
                   f"({_f(s.get('async_write_over_disk'))}) | {_f(s.get('sync_write_GBps'))} "
                   f"({_f(s.get('sync_write_over_disk'))}) |")
    return out

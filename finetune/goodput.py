"""Goodput of a run folder: the share of wall time, over every attempt, that trained steps that were kept.

    python -m finetune.metrics goodput runs/tiny          # prints the account, draws runs/tiny/goodput.png

Every attempt (a torchrun restart, a requeue, a manual rerun) appends to the same metrics.jsonl. An attempt
begins with an `attempt_start` event holding the process's own start time (`process_start`, from the kernel:
/proc/self/stat's start time, so the imports and everything before the first record count); a completed one
ends with `run_end`. Step records carry `time` (wall clock at the record) and `step_s` (the step's own
duration, data to optimizer step). The account, all from those records, none estimated:

    wall      last record - first attempt's process start
    startup   each attempt's process start -> (its first step record - that step's step_s)
    ckpt      sum of `checkpoint` events' blocking_s (the time saves held the loop; disk and memory tier)
    eval      sum of `eval` events' eval_s
    rollback  step_s of every step record a later record of the same step replaced: work lost to a failure
    downtime  each gap between one attempt's last record and the next attempt's process start
    hang      sum of `hang` events' waited_s (time a hang detector waited before ending the attempt)
    goodput   (wall - lost) / wall;  `other` = wall - lost - the kept steps' step_s (logging, gaps, unrecorded)

A save's staging wait (`staging_wait_s`, part of its blocking_s) is spent inside the next step's step_s: it
counts under ckpt and is taken off the kept steps, so no second is counted twice.

Cost: rank 0 reads metrics.jsonl once, at the end of a run (O(steps) once per run); nothing per step, and
nothing that grows with the world size.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field

from common.procfs import stat_fields

CAUSES = ("startup", "ckpt", "eval", "rollback", "downtime", "hang")
_WHAT = {"startup": "process start to first step", "ckpt": "checkpoint blocking", "eval": "evaluation",
         "rollback": "steps trained again after a failure", "downtime": "between attempts",
         "hang": "hang detection"}
_IMPORTED_AT = time.time()  # the fallback start time where /proc is missing (not Linux)


def process_start_time() -> float:
    """This process's start, wall clock, from the kernel (Linux: /proc/self/stat field 22, clock ticks since
    boot, against /proc/uptime; 10 ms resolution). Elsewhere: when this module was imported."""
    try:
        ticks = int(stat_fields()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return _IMPORTED_AT


@dataclass
class Attempt:
    start: float  # process start, wall clock
    end: float  # its last record
    steps: list = field(default_factory=list)  # (wall time at the record, step, step_s)
    saves: list = field(default_factory=list)  # (wall time, step, tier)
    resumed_from: int | None = None
    completed: bool = False  # wrote run_end (done or preempted); without it, the attempt failed


@dataclass
class Goodput:
    wall: float
    lost: dict  # cause -> seconds
    trained: float  # step_s of the steps kept
    attempts: list
    steps_redone: int

    @property
    def goodput(self) -> float:
        return (self.wall - sum(self.lost.values())) / self.wall if self.wall > 0 else 0.0

    @property
    def other(self) -> float:
        return self.wall - sum(self.lost.values()) - self.trained

    def lines(self) -> list[str]:
        """One line per cause, then the summary line."""
        pct = lambda s: f"{100 * s / self.wall:5.1f}%" if self.wall > 0 else "    -"  # noqa: E731
        out = [f"lost {c:9s} {self.lost[c]:9.1f}s {pct(self.lost[c])}  ({_WHAT[c]})" for c in CAUSES]
        out.append(f"kept steps     {self.trained:9.1f}s {pct(self.trained)}  other {self.other:.1f}s "
                   f"{pct(self.other).strip()} (logging, between steps)")
        out.append(self.summary())
        return out

    def summary(self) -> str:
        failed = sum(1 for a in self.attempts if not a.completed)
        return (f"goodput {100 * self.goodput:.1f}% of {self.wall:.1f}s wall over {len(self.attempts)} attempt(s) "
                f"({failed} failed), {self.steps_redone} step(s) trained again")


def read_records(path: str) -> list[dict]:
    """metrics.jsonl in file order; a torn last line (a SIGKILL mid-write) is skipped."""
    records = []
    with open(path) as f:
        for line in f:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return records


def split_attempts(records: list[dict]) -> list[Attempt]:
    """The records, cut at each attempt_start; records from before attempt_start existed form one attempt
    that starts at its first record."""
    attempts = []
    for rec in records:
        ev, t = rec.get("event"), rec.get("time")
        if ev == "attempt_start":
            attempts.append(Attempt(start=rec["process_start"], end=t))
            continue
        if t is None:
            continue
        if not attempts:
            attempts.append(Attempt(start=t, end=t))
        a = attempts[-1]
        a.end = max(a.end, t)
        if ev is None:
            a.steps.append((t, rec["step"], rec.get("step_s", 0.0)))
        elif ev == "checkpoint":
            a.saves.append((t, rec.get("step"), rec.get("tier", "disk")))
        elif ev == "resume":
            a.resumed_from = rec.get("step")
        elif ev == "run_end":
            a.completed = True
    return attempts


def account(records: list[dict]) -> Goodput:
    """The goodput account of one run folder's metrics records (see the module docstring)."""
    attempts = split_attempts(records)
    if not attempts:
        raise ValueError("no timed records")
    lost, staging_waits = dict.fromkeys(CAUSES, 0.0), 0.0
    for a in attempts:
        first = a.steps[0] if a.steps else None
        lost["startup"] += (first[0] - first[2] if first else a.end) - a.start
    for prev, nxt in zip(attempts, attempts[1:]):
        lost["downtime"] += max(nxt.start - prev.end, 0.0)
    for rec in records:
        if rec.get("event") == "checkpoint":
            lost["ckpt"] += rec.get("blocking_s", 0.0)
            staging_waits += rec.get("staging_wait_s", 0.0)
        elif rec.get("event") == "eval":
            lost["eval"] += rec.get("eval_s", 0.0)
        elif rec.get("event") == "hang":
            lost["hang"] += rec.get("waited_s", 0.0)
    last_of = {}  # step -> step_s of its last record; earlier records of the step were trained again
    redone = 0
    for a in attempts:
        for _, step, step_s in a.steps:
            if step in last_of:
                lost["rollback"] += last_of[step]
                redone += 1
            last_of[step] = step_s
    wall = attempts[-1].end - attempts[0].start
    return Goodput(wall, lost, sum(last_of.values()) - staging_waits, attempts, redone)


def run_account(run_dir: str) -> Goodput:
    return account(read_records(os.path.join(run_dir, "metrics.jsonl")))


def goodput_line(run_dir: str) -> str:
    """The run's closing goodput line; a metrics file that cannot be read says so instead of failing the run."""
    try:
        return run_account(run_dir).summary() + f" (python -m finetune.metrics goodput {run_dir})"
    except (OSError, ValueError, KeyError) as e:
        return f"goodput: cannot account {run_dir}/metrics.jsonl: {type(e).__name__}: {e}"


def plot_timeline(g: Goodput, out: str, title: str = "") -> str:
    """Step against wall time, one colour per attempt: startup and downtime shaded, saves and failures marked."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = g.attempts[0].start
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for i, a in enumerate(g.attempts):
        color = f"C{i % 10}"
        first = a.steps[0][0] - a.steps[0][2] if a.steps else a.end
        ax.axvspan(a.start - t0, first - t0, color="tab:gray", alpha=0.25, lw=0,
                   label="start-up" if i == 0 else None)
        if a.steps:
            ax.plot([s[0] - t0 for s in a.steps], [s[1] for s in a.steps], ".-", ms=3, lw=0.8, color=color,
                    label=f"attempt {i + 1}" + (f" (resumed at {a.resumed_from})" if a.resumed_from else ""))
        for t, step, tier in a.saves:
            ax.plot(t - t0, step, "v" if tier == "memory" else "s", ms=4, color="tab:green", mfc="none")
        if not a.completed:
            ax.plot(a.end - t0, a.steps[-1][1] if a.steps else 0, "x", ms=9, mew=2, color="tab:red",
                    label="failure" if i == next(j for j, b in enumerate(g.attempts) if not b.completed) else None)
    for prev, nxt in zip(g.attempts, g.attempts[1:]):
        ax.axvspan(prev.end - t0, nxt.start - t0, color="tab:red", alpha=0.12, lw=0)
    ax.plot([], [], "s", color="tab:green", mfc="none", label="save (disk)")
    ax.plot([], [], "v", color="tab:green", mfc="none", label="save (memory tier)")
    ax.set_xlabel("wall time since the first start (s); grey: start-up, red: downtime")
    ax.set_ylabel("optimizer step")
    ax.set_title((title + ": " if title else "") + g.summary(), fontsize=9)
    ax.legend(fontsize=7, loc="upper left")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out

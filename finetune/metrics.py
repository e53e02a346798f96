"""Rank-0 logging: one greppable line per log interval, metrics.jsonl per step, and a loss-curve PNG.

    python -m finetune.metrics runs/tiny/metrics.jsonl      # -> runs/tiny/loss.png

metrics.jsonl holds one JSON object per optimizer step ({"step", "loss", "lr", "tokens", ...}) and
event records ({"event": "checkpoint" | "resume" | ...}). A resumed run appends to the same file, so a
step can appear twice; the last record of a step is the one that counts.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time


class RankZeroLog:
    """print() and metrics.jsonl on rank 0 only; every other rank's calls are no-ops."""

    def __init__(self, rank: int, run_dir: str):
        self.rank = rank
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self._file = open(self.path, "a") if rank == 0 else None
        self._lock = threading.Lock()  # checkpoint events arrive from the commit thread

    def info(self, msg: str) -> None:
        if self.rank == 0:
            print(msg, flush=True)

    def record(self, **fields) -> None:
        if self._file is not None:
            with self._lock:  # flush per line: a SIGKILL must not eat the steps already logged
                self._file.write(json.dumps(fields) + "\n")
                self._file.flush()

    def event(self, name: str, **fields) -> None:
        self.record(event=name, time=time.time(), **fields)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def step_line(step: int, max_steps: int, loss: float, lr: float, grad_norm: float,
              tokens_per_s: float, elapsed: float, steps_done_here: int) -> str:
    remaining = max_steps - step
    eta = elapsed / max(steps_done_here, 1) * remaining
    return (f"step {step:6d}/{max_steps} | loss {loss:.4f} | lr {lr:.3e} | grad_norm {grad_norm:.3f} | "
            f"tok/s {tokens_per_s:,.0f} | elapsed {elapsed:6.1f}s | eta {eta:6.1f}s")


def progress_bar(enabled: bool, total: int, initial: int):
    """A tqdm bar only on an interactive terminal (logs in files stay one line per step)."""
    if not enabled or not sys.stdout.isatty():
        return None
    from tqdm import tqdm
    return tqdm(total=total, initial=initial, dynamic_ncols=True, leave=False)


def read_metrics(path: str) -> tuple[dict[int, dict], list[dict]]:
    """(step -> last record of that step, events in file order)."""
    steps, events = {}, []
    with open(path) as f:
        for line in f:
            rec = json.loads(line)
            if "event" in rec:
                events.append(rec)
            else:
                steps[rec["step"]] = rec
    return steps, events


_EVENT_STYLES = {"checkpoint": ("tab:green", ":"), "resume": ("tab:red", "--")}  # (color, line style)


def plot_metrics(path: str, out: str) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps, events = read_metrics(path)
    xs = sorted(steps)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.plot(xs, [steps[s]["loss"] for s in xs], lw=1.2, label="loss")
    for ev in events:
        if "step" not in ev:
            continue
        style = _EVENT_STYLES.get(ev["event"], ("gray", "-."))
        ax.axvline(ev["step"], color=style[0], ls=style[1], lw=0.8)
    for name, (color, ls) in _EVENT_STYLES.items():
        ax.plot([], [], color=color, ls=ls, label=name)
    if xs and all(steps[s]["loss"] > 0 for s in xs) and max(steps[s]["loss"] for s in xs) > 10 * min(
            steps[s]["loss"] for s in xs):
        ax.set_yscale("log")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    return out


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3):
        sys.exit("usage: python -m finetune.metrics <metrics.jsonl> [out.png]")
    src = sys.argv[1]
    print(plot_metrics(src, sys.argv[2] if len(sys.argv) == 3 else os.path.join(os.path.dirname(src), "loss.png")))

"""Rank-0 logging: one greppable line per log interval, metrics.jsonl per step, and a loss-curve PNG.

    python -m finetune.metrics runs/tiny/metrics.jsonl      # -> runs/tiny/loss.png
    python -m finetune.metrics goodput runs/tiny            # goodput account -> runs/tiny/goodput.png

metrics.jsonl holds one JSON object per optimizer step ({"step", "loss", "lr", "tokens", ...}; at each log interval
also per-rank lists such as "peak_memory_gib": [rank 0, rank 1, ...], finetune/per_rank.py) and event records
({"event": "checkpoint" | "resume" | "eval" | ...}; an eval record has "step" and each eval metric's field:
"eval_loss", "eval_accuracy", finetune/eval_metrics.py). A resumed run appends to the same file, so a step can
appear twice; the last record of a step is the one that counts.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import os
import statistics
import sys
import threading
import time
from typing import NamedTuple

from finetune.eval_metrics import EVAL_METRICS
from finetune.goodput import plot_timeline, run_account
from finetune.loggers import ScalarStream
from finetune.per_rank import RankPeaks


class RankZeroLog:
    """print() and metrics.jsonl on rank 0 only; every other rank's calls are no-ops."""

    def __init__(self, rank: int, run_dir: str, loggers: list = ()):
        self.rank = rank
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self._file = open(self.path, "a") if rank == 0 else None
        self._lock = threading.Lock()  # checkpoint events arrive from the commit thread
        self._loggers = list(loggers)  # finetune/loggers.py: TensorBoard, W&B, fed the same records
        self._scalars = ScalarStream()

    def info(self, msg: str) -> None:
        if self.rank == 0:
            print(msg, flush=True)

    def record(self, **fields) -> None:
        if self._file is not None:
            with self._lock:  # flush per line: a SIGKILL must not eat the steps already logged
                try:
                    self._file.write(json.dumps(fields) + "\n")
                    self._file.flush()
                except OSError as e:
                    self._stop_recording(e)
                    return
                if self._loggers:
                    scalars = self._scalars.scalars(fields)
                    for logger in self._loggers:
                        logger.log(scalars)

    def _stop_recording(self, error: OSError) -> None:
        """A full (or failing) disk under run.dir: rank 0 alone cannot stop the job without leaving the other
        ranks in a collective, so it says so once and stops writing metrics; stdout lines and checkpoints go on
        (a checkpoint on the same full disk then ends the job with its own error line)."""
        what = "no space left on" if error.errno in (errno.ENOSPC, errno.EDQUOT) else f"{error.strerror} on"
        print(f"warning: {what} {os.path.dirname(self.path)} while writing metrics.jsonl; metrics are no longer "
              "recorded there", file=sys.stderr, flush=True)
        with contextlib.suppress(OSError):
            self._file.close()
        self._file = None

    def event(self, name: str, **fields) -> None:
        self.record(event=name, time=time.time(), **fields)

    def event_from_any_rank(self, name: str, **fields) -> None:
        """An event that another rank than 0 may have to record (rank 0 is the one that hung): appended to
        metrics.jsonl as one line by whichever rank calls it."""
        if self.rank == 0:
            self.event(name, **fields)
            return
        try:
            with open(self.path, "a") as f:
                f.write(json.dumps({"event": name, "time": time.time(), **fields}) + "\n")
        except OSError as e:
            print(f"warning: could not record the {name} event in {self.path}: {e}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._file is not None:
            try:
                self._file.close()
            except OSError as e:
                self._stop_recording(e)
            self._file = None
        for logger in self._loggers:
            logger.close()
        self._loggers = []


def step_line(step: int, max_steps: int, loss: float, lr: float, grad_norm: float,
              tokens_per_s: float, elapsed: float, steps_done_here: int, aux_loss: float | None = None) -> str:
    remaining = max_steps - step
    eta = elapsed / max(steps_done_here, 1) * remaining
    aux = "" if aux_loss is None else f" | aux_loss {aux_loss:.4f}"
    return (f"step {step:6d}/{max_steps} | loss {loss:.4f}{aux} | lr {lr:.3e} | grad_norm {grad_norm:.3f} | "
            f"tok/s {tokens_per_s:,.0f} | elapsed {elapsed:6.1f}s | eta {eta:6.1f}s")


def progress_bar(enabled: bool, total: int, initial: int):
    """A tqdm bar only on an interactive terminal (logs in files stay one line per step)."""
    if not enabled or not sys.stdout.isatty():
        return None
    from tqdm import tqdm
    return tqdm(total=total, initial=initial, dynamic_ncols=True, leave=False)


class StepResult(NamedTuple):
    """What train_step returns: the LM loss, the global count of loss tokens, the gradient norm, and the MoE
    router's aux loss (None for a model without one, or whose config has output_router_logits false)."""
    loss: float
    tokens: int
    grad_norm: float
    aux_loss: float | None = None


class StepLog:
    """Per step: one record (metrics.jsonl + loggers), a console line every run.log_interval, the progress bar.
    Every log interval the record also holds each rank's peak memory (finetune/per_rank.py: one gather, so every
    rank calls `step`). `cfg`: the training Config; `split`: its BatchSplit; `progress`: a TrainProgress;
    `stream`: the BatchStream; `device`: this rank's."""

    def __init__(self, cfg, log, rank: int, world_size: int, split, start_step: int, device):
        self.cfg, self.log, self.world_size, self.start_step = cfg, log, world_size, start_step
        self.tokens_per_step = split.global_batch * cfg.data.seq_len
        self.bar = progress_bar(cfg.run.progress_bar and rank == 0, cfg.train.max_steps, start_step)
        self.peaks = RankPeaks(rank, world_size, device)
        self.t_start = time.perf_counter()

    def step(self, progress, stream, rows, done: StepResult, lr: float, step_s: float) -> None:
        """`done`: train_step's result; `step_s`: the step's own duration (batch to optimizer step), for the
        goodput account. A MoE router's aux loss is its own field (aux_loss), apart from the LM loss."""
        elapsed, max_steps = time.perf_counter() - self.t_start, self.cfg.train.max_steps
        interval = progress.step % self.cfg.run.log_interval == 0 or progress.step == max_steps
        per_rank = self.peaks.gather() if interval else {}  # a collective: every rank is at the same step
        aux = {} if done.aux_loss is None else {"aux_loss": done.aux_loss}
        self.log.record(step=progress.step, loss=done.loss, lr=lr, grad_norm=done.grad_norm, **aux,
                        tokens=progress.tokens, loss_tokens=progress.loss_tokens, samples=stream.position,
                        world_size=self.world_size, time=time.time(), step_s=round(step_s, 6), sample_ids=rows,
                        **per_rank)
        if interval:
            tps = (progress.tokens - self.start_step * self.tokens_per_step) / max(elapsed, 1e-9)
            self.log.info(step_line(progress.step, max_steps, done.loss, lr, done.grad_norm, tps, elapsed,
                                    progress.step - self.start_step, done.aux_loss) + RankPeaks.warning(per_rank))
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{done.loss:.4f}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


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


# (color, line style, legend label) of the marks drawn at an event's step; other events are not drawn
_MARKS = {
    "kept": ("tab:green", "-", "checkpoint (still on disk)"),
    "deleted": ("tab:green", ":", "checkpoint (deleted by retention)"),
    "resume": ("tab:red", "--", "resume"),
    "checkpoint_failed": ("tab:orange", ":", "checkpoint failed"),
    "preempted": ("black", "--", "preempted"),
}


def checkpoint_exists(path: str, run_dir: str) -> bool:
    """Is this checkpoint still on disk (committed, not deleted by retention)? A relative path is taken from
    the current directory (where training ran), else from <run_dir>/checkpoints."""
    candidates = [path] if os.path.isabs(path) else [path, os.path.join(run_dir, "checkpoints", os.path.basename(path))]
    return any(os.path.isfile(os.path.join(p, "commit.json")) for p in candidates)


def event_marks(steps: dict[int, dict], events: list[dict], run_dir: str) -> list[tuple[int, str]]:
    """(step, kind) for each vertical mark: checkpoints kept or deleted, resumes, failed saves, preemption."""
    marks = []
    for ev in events:
        if ev["event"] == "checkpoint" and "step" in ev:
            marks.append((ev["step"], "kept" if checkpoint_exists(ev.get("path", ""), run_dir) else "deleted"))
        elif ev["event"] in _MARKS and "step" in ev:
            marks.append((ev["step"], ev["event"]))
    return sorted(marks, key=lambda m: m[1] == "resume")  # resumes drawn last, on top of a checkpoint line


def world_size_spans(steps: dict[int, dict]) -> list[tuple[int, int, object]]:
    """[(first step, last step, world size)] for each stretch trained at one world size."""
    spans = []
    for s in sorted(steps):
        w = steps[s].get("world_size", "?")
        if spans and spans[-1][2] == w:
            spans[-1] = (spans[-1][0], s, w)
        else:
            spans.append((s, s, w))
    return spans


def _count(n, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def plot_metrics(path: str, out: str) -> str:
    """Draw metrics.jsonl at `path` into the PNG `out`; returns `out`."""
    import matplotlib.pyplot as plt

    fig = loss_figure(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def loss_figure(path: str):
    """The matplotlib figure of a run's metrics.jsonl: loss, eval loss, event marks, world-size spans; below it,
    when the records hold them, each rank's peak memory (memory_panel)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps, events = read_metrics(path)
    if not steps:
        raise ValueError(f"{path} has no step records")
    run_dir = os.path.dirname(os.path.abspath(path))
    xs = sorted(steps)
    ys = [steps[s]["loss"] for s in xs]
    peaks = {s: steps[s]["peak_memory_gib"] for s in xs if steps[s].get("peak_memory_gib")}
    if peaks:  # below the loss: each rank's peak memory per log interval
        fig, (ax, mem) = plt.subplots(2, 1, figsize=(8, 7), sharex=True, height_ratios=(3, 2))
        memory_panel(mem, peaks)
    else:
        fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.plot(xs, ys, lw=1.2, label="loss")
    fraction = eval_lines(ax, events)
    marks = event_marks(steps, events, run_dir)
    for step, kind in marks:
        color, ls, _ = _MARKS[kind]
        ax.axvline(step, color=color, ls=ls, lw=1.4 if kind == "resume" else 0.9)
    for kind in dict.fromkeys(kind for _, kind in marks):  # a legend entry only for what was drawn
        color, ls, label = _MARKS[kind]
        ax.plot([], [], color=color, ls=ls, label=label)
    spans = world_size_spans(steps)
    for i, (first, last, w) in enumerate(spans):  # each stretch at one world size: shaded, labelled
        if len(spans) > 1:
            ax.axvspan(first - 0.5, last + 0.5, color="tab:purple", alpha=0.06 if i % 2 else 0.14, lw=0)
        ax.text((first + last) / 2, 0.98, _count(w, "rank"), transform=ax.get_xaxis_transform(), ha="center",
                va="top", fontsize=8, color="tab:purple")
    if all(y > 0 for y in ys) and max(ys) > 10 * min(ys):
        ax.set_yscale("log")
    n_ckpt = sum(1 for _, kind in marks if kind in ("kept", "deleted"))
    n_resume = sum(1 for _, kind in marks if kind == "resume")
    ax.set_title(f"{os.path.basename(run_dir)}: loss over {_count(len(xs), 'step')} (last {ys[-1]:.4f}), "
                 f"{_count(n_ckpt, 'checkpoint')}, {_count(n_resume, 'resume')}", fontsize=10)
    (mem if peaks else ax).set_xlabel("optimizer step")  # the bottom panel: not fig.axes[-1], a right-hand twin
    ax.set_ylabel("loss")
    handles, labels = ax.get_legend_handles_labels()  # without the "_child" marks, as legend() alone would
    if fraction is not None:  # the right axis's lines in the same legend
        handles, labels = [a + b for a, b in zip((handles, labels), fraction.get_legend_handles_labels())]
    ax.legend(handles, labels, fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def eval_lines(ax, events: list[dict]):
    """Each eval metric of finetune/eval_metrics.py over the steps it was measured at: a loss on `ax`, a fraction
    on a 0-1 axis at the right (returned, or None when no fraction was drawn). The last record of a step wins."""
    fraction = None
    for m in EVAL_METRICS:
        points = {ev["step"]: ev[m.field] for ev in events if ev["event"] == "eval" and m.field in ev}
        if not points:
            continue
        if m.axis == "fraction" and fraction is None:
            fraction = ax.twinx()
            fraction.set_ylim(0, 1)
            fraction.set_ylabel("eval fraction")
        on = fraction if m.axis == "fraction" else ax
        on.plot(sorted(points), [points[s] for s in sorted(points)], "o-" if on is ax else "s--", ms=3, lw=1.2,
                label=m.label, color=None if on is ax else "tab:olive")
    return fraction


PANEL_RANKS = 8  # up to this many ranks, one line each; more: the band of all ranks, its median, and the top rank


def memory_panel(ax, peaks: dict[int, list[float]]) -> None:
    """Each rank's peak memory (GiB) at each log interval: `peaks` is {step: [rank 0, rank 1, ...]}."""
    xs = sorted(peaks)
    ranks = max(len(peaks[s]) for s in xs)
    at = [[peaks[s][r] if r < len(peaks[s]) else float("nan") for s in xs] for r in range(ranks)]  # W changed
    if ranks <= PANEL_RANKS:
        for r, ys in enumerate(at):
            ax.plot(xs, ys, lw=1, marker=".", ms=3, label=f"rank {r}")
    else:
        ax.fill_between(xs, [min(peaks[s]) for s in xs], [max(peaks[s]) for s in xs], color="tab:blue", alpha=0.2,
                        lw=0, label=f"{ranks} ranks: min to max")
        ax.plot(xs, [statistics.median(peaks[s]) for s in xs], color="tab:blue", lw=1, label="median")
        top = max((v, r) for s in xs for r, v in enumerate(peaks[s]))[1]
        ax.plot(xs, at[top], color="tab:red", lw=1, label=f"rank {top} (highest peak)")
    ax.set_ylabel("peak memory per rank (GiB)")
    ax.legend(fontsize=7, ncol=4)
    ax.grid(alpha=0.3)


def parse_args(argv: list[str], prog: str, description: str, what: str, what_help: str, png: str):
    """The two arguments of both commands: what to read, and the PNG to write (default: `png` beside it)."""
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument(what, help=what_help)
    p.add_argument("out", nargs="?", default=None, help=f"PNG to write (default: {png} beside it)")
    return p.parse_args(argv)


def goodput_main(argv: list[str]) -> int:
    args = parse_args(argv, "python -m finetune.metrics goodput", "Goodput of a run folder over all its attempts: "
                      "wall time, time lost by cause (finetune/goodput.py), and a timeline PNG.", "run_dir",
                      "a run folder holding metrics.jsonl, e.g. runs/tiny", "goodput.png in the folder")
    try:
        g = run_account(args.run_dir)
        print("\n".join(g.lines()))
        print(plot_timeline(g, args.out or os.path.join(args.run_dir, "goodput.png"), os.path.basename(
            os.path.abspath(args.run_dir))))
    except (OSError, ValueError, KeyError) as e:
        print(f"error: cannot account {args.run_dir}: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["goodput"]:
        return goodput_main(argv[1:])
    args = parse_args(argv, "python -m finetune.metrics", "Draw the loss curve of a run's metrics.jsonl to a PNG, "
                      "with checkpoints (kept or deleted), resumes and world-size changes marked.", "metrics",
                      "a run's metrics.jsonl, e.g. runs/tiny/metrics.jsonl", "loss.png")
    out = args.out or os.path.join(os.path.dirname(args.metrics), "loss.png")
    try:
        print(plot_metrics(args.metrics, out))
    except (OSError, ValueError, KeyError) as e:
        print(f"error: cannot plot {args.metrics}: {type(e).__name__}: {e}", file=sys.stderr)
        return 2  # bad input, as everywhere
    return 0


if __name__ == "__main__":
    sys.exit(main())

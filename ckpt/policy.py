"""When to save: every N steps, every M minutes of wall clock, or the Young/Daly interval from measured costs.

    python -m pytest tests/test_ckpt_policy.py -q

The loop asks `should_save(step)` after every step, on every rank, reports each save with `saved(step)`
and its cost to training with `measured(step, seconds)` once known (ckpt/loop.py: blocking seconds plus the
wait for the staged copy at the next step's `before_optimizer_step`; on CUDA staging runs in the background).
- steps: `step % every_steps == 0`, the same on every rank with no communication.
- minutes / auto: wall clock, so rank 0 decides and broadcasts one flag per step (clocks and step
  times differ between hosts; a save is collective, so every rank must start it at the same step).
- auto: Young/Daly. With C the cost of a save to training (blocking seconds + staging wait, the mean of
  the last three saves) and M the job's mean time between failures, the expected time lost per failure
  (saves + recomputation) is smallest at an interval of sqrt(2 C M). Until a save is measured,
  auto saves after the first step to measure one. Each new interval is logged with its inputs.
"""

from __future__ import annotations

import math
import time
from collections import deque
from typing import Callable

import torch
import torch.distributed as dist


def young_daly_s(cost_s: float, mtbf_s: float) -> float:
    """The checkpoint interval (seconds of work between saves) that minimises expected lost time."""
    return math.sqrt(2.0 * cost_s * mtbf_s)


def parse_interval(text: str) -> int | None:
    """'auto' -> None; '50' -> 50 (0: no periodic saves by step count). Raises ValueError otherwise."""
    if str(text).strip() == "auto":
        return None
    n = int(str(text))
    if n < 0:
        raise ValueError(f"must be >= 0, got {n}")
    return n


class SavePolicy:
    def __init__(self, interval: str | int = 0, interval_minutes: float = 0.0, mtbf_hours: float = 24.0,
                 group=None, on_log: Callable[[str], None] = lambda _msg: None,
                 clock: Callable[[], float] = time.monotonic):
        self.every_steps = parse_interval(interval)
        self.auto = self.every_steps is None
        self.every_s = interval_minutes * 60.0 if interval_minutes > 0 else None
        self.mtbf_s = mtbf_hours * 3600.0
        self.group, self.on_log, self.clock = group, on_log, clock
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.costs: deque[float] = deque(maxlen=3)
        self.start_t = self.last_save_t = clock()
        self.first_step: int | None = None
        self.auto_s: float | None = None  # the current Young/Daly interval, once a save was measured

    @property
    def wall_clock(self) -> bool:
        return self.auto or self.every_s is not None

    def should_save(self, step: int) -> bool:
        """The same answer on every rank. Collective (one tiny broadcast) when a wall-clock rule is on."""
        if self.first_step is None:
            self.first_step = step
        by_steps = bool(self.every_steps) and step % self.every_steps == 0
        if not self.wall_clock:
            return by_steps
        decision = torch.tensor([float(by_steps or self._time_is_up(step))])
        if dist.is_initialized():
            dist.broadcast(decision, src=0, group=self.group)  # rank 0's clock decides for everyone
        return bool(decision.item())

    def _time_is_up(self, step: int) -> bool:
        if self.rank != 0:
            return False  # ignored: rank 0's answer is broadcast
        elapsed = self.clock() - self.last_save_t
        if self.every_s is not None and elapsed >= self.every_s:
            return True
        if self.auto:
            return self.auto_s is None or elapsed >= self.auto_s  # no measured cost yet: save to measure one
        return False

    def saved(self, step: int) -> None:
        """Record a save that just started (its blocking part is over): restarts the wall-clock interval."""
        self.last_save_t = self.clock()

    def measured(self, step: int, cost_s: float) -> None:
        """For auto: the save of `step` cost training `cost_s` seconds (its blocking part plus the wait for its
        staged copy, which on CUDA comes a step later); updates C and the interval."""
        if not self.auto:
            return
        self.costs.append(cost_s)
        cost = sum(self.costs) / len(self.costs)
        steps_run = max(1, step - (self.first_step or step) + 1)
        per_step = (self.clock() - self.start_t) / steps_run
        self.auto_s = young_daly_s(cost, self.mtbf_s)
        self.on_log(f"checkpoint interval (auto, Young/Daly): sqrt(2 x C {cost:.3f}s x MTBF "
                    f"{self.mtbf_s / 3600:g}h) = {self.auto_s:.1f}s, about {self.auto_s / max(per_step, 1e-9):.0f} "
                    f"steps at {per_step:.3f} s/step (C: mean blocking + staging wait of the last "
                    f"{len(self.costs)} save(s))")

"""The metrics computed at each eval, declared once: `EVAL_METRICS`. Adding a metric is one entry here.

    python -m pytest tests/test_eval.py -q

`finetune/evaluate.py` runs one forward per eval chunk and hands the chunk's logits and labels to every
entry's `sums`, which returns integers (counts, or a float sum in fixed point). Integers add exactly in any
order, so after one all-reduce of every entry's integers each metric is the same number at any world size.
From its entry alone a metric reaches the console's eval line and the `eval` record of metrics.jsonl (`field`),
TensorBoard and W&B (`scalar`, finetune/loggers.py `SCALARS`) and the loss plot (`label`, `axis`;
`python -m finetune.metrics`); `ckpt.keep_best` scores checkpoints by `eval_loss`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from finetune.data import IGNORE
from finetune.loss import next_token_loss_sum, shift_labels

FIXED_POINT = 2 ** 24  # chunk sums up to 5e11 fit an int64; rounding is 3e-8 per chunk


@dataclass(frozen=True)
class EvalMetric:
    field: str  # the eval record's field and its name on the console's eval line
    scalar: str  # its TensorBoard / W&B name
    label: str  # its line in the loss plot
    axis: str  # "loss": drawn on the loss axis; "fraction": on a 0-1 axis at the right
    sums: Callable[[torch.Tensor, torch.Tensor], tuple[int, ...]]  # (logits, labels) of one chunk -> integers
    value: Callable[[list[int]], float]  # those integers summed over every chunk -> the metric


def _loss_sums(logits: torch.Tensor, labels: torch.Tensor) -> tuple[int, int]:
    """(summed next-token loss in fixed point, loss tokens)."""
    loss = float(next_token_loss_sum(logits, labels, IGNORE))
    return round(loss * FIXED_POINT), int((labels[:, 1:] != IGNORE).sum())


def _accuracy_sums(logits: torch.Tensor, labels: torch.Tensor) -> tuple[int, int]:
    """(loss tokens whose most likely next token is the label, loss tokens)."""
    targets = shift_labels(labels, IGNORE)
    scored = targets != IGNORE
    return int(((logits.argmax(-1) == targets) & scored).sum()), int(scored.sum())


EVAL_METRICS = (
    EvalMetric("eval_loss", "eval/loss", "eval loss", "loss", _loss_sums,
               lambda s: s[0] / FIXED_POINT / max(s[1], 1)),
    EvalMetric("eval_accuracy", "eval/accuracy", "eval next-token accuracy", "fraction", _accuracy_sums,
               lambda s: s[0] / max(s[1], 1)),
)
AXES = ("loss", "fraction")

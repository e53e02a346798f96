"""Next-token cross-entropy over full-vocabulary logits, in bounded memory.

    python -m pytest tests/test_loss.py -q          # same loss and gradients as the plain formula
    python bench/loss_memory.py                     # peak memory of both at a large vocabulary

The plain formula `F.cross_entropy(logits.float()[:, :-1].reshape(...), labels[:, 1:].reshape(-1))` holds
about four full-vocabulary fp32 copies per micro batch (the upcast, the copy of the shifted slice, the
log-softmax kept for backward, and its gradient): 15-20 GB at seq 4096, vocab 128k. Here the *labels*
are shifted (no copy of the logits), and the loss is computed chunk by chunk over the tokens with each
chunk recomputed in backward, so the only full-size tensors are the logits in their own dtype and their
gradient; fp32 lives one chunk at a time.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

CHUNK_ELEMENTS = 1 << 26  # logits per chunk: 64M fp32 values = 256 MiB (512 tokens at vocab 128k)


def shift_labels(labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """labels[:, t] becomes the target of position t (the next token); the last position has none."""
    return F.pad(labels[:, 1:], (0, 1), value=ignore_index)


def _chunk_loss_sum(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int) -> torch.Tensor:
    return F.cross_entropy(logits.float(), targets, ignore_index=ignore_index, reduction="sum")


def next_token_loss_sum(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int,
                        chunk_elements: int = CHUNK_ELEMENTS) -> torch.Tensor:
    """Sum over tokens of -log p(labels[:, t+1] | logits[:, t]) in fp32, positions labelled ignore_index skipped."""
    vocab = logits.size(-1)
    flat_logits = logits.reshape(-1, vocab)  # a view: model logits are contiguous
    flat_targets = shift_labels(labels, ignore_index).reshape(-1)
    rows = max(1, chunk_elements // vocab)
    total = logits.new_zeros((), dtype=torch.float32)
    for lg, tg in zip(flat_logits.split(rows), flat_targets.split(rows)):
        if not torch.is_grad_enabled() or not lg.requires_grad:
            total = total + _chunk_loss_sum(lg, tg, ignore_index)
        else:  # keep only the input view for backward; fp32 log-softmax is recomputed chunk by chunk
            total = total + checkpoint(_chunk_loss_sum, lg, tg, ignore_index, use_reentrant=False)
    return total

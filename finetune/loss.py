"""Next-token cross-entropy over full-vocabulary logits, in bounded memory.

    python -m pytest tests/test_loss.py -q          # same loss and gradients as the plain formula
    python bench/loss_memory.py                     # peak memory of both at a large vocabulary

The plain formula `F.cross_entropy(logits.float()[:, :-1].reshape(...), labels[:, 1:].reshape(-1))` holds
several full-vocabulary fp32 copies per micro batch (the upcast, the copy of the shifted slice, the
log-softmax kept for backward, its gradient): 15-20 GB at seq 4096, vocab 128k. Here the *labels* are
shifted, never the logits, and the loss and its gradient are computed together, chunk by chunk over the
tokens, in fp32: the only full-size tensor besides the logits is their gradient, in the logits' dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK_ELEMENTS = 1 << 24  # logits per fp32 chunk: 16M values = 64 MiB (130 tokens at vocab 128k)


def shift_labels(labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """labels[:, t] becomes the target of position t (the next token); the last position has none."""
    return F.pad(labels[:, 1:], (0, 1), value=ignore_index)


class _ChunkedCrossEntropySum(torch.autograd.Function):
    """Sum of token cross-entropies; forward also writes d(sum)/d(logits) chunk by chunk, backward scales it."""

    @staticmethod
    def forward(ctx, logits, targets, ignore_index: int, rows: int):
        grad = torch.empty_like(logits) if ctx.needs_input_grad[0] else None
        total = torch.zeros((), dtype=torch.float32, device=logits.device)
        for start in range(0, logits.size(0), rows):
            x = logits[start:start + rows].float()
            t = targets[start:start + rows]
            valid = t != ignore_index
            safe_t = torch.where(valid, t, 0).unsqueeze(1)
            lse = torch.logsumexp(x, dim=-1, keepdim=True)
            total += ((lse - x.gather(1, safe_t)).squeeze(1) * valid).sum()
            if grad is not None:  # softmax - one_hot(target), zero where ignored
                g = (x - lse).exp_()
                g.scatter_add_(1, safe_t, torch.full_like(safe_t, -1, dtype=g.dtype))
                grad[start:start + rows] = g.mul_(valid.unsqueeze(1))
        ctx.grad = grad  # not save_for_backward: backward scales it in place (one backward per forward)
        return total

    @staticmethod
    def backward(ctx, grad_out):
        grad, ctx.grad = ctx.grad, None
        return grad.mul_(grad_out.to(grad.dtype)), None, None, None


def next_token_loss_sum(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int,
                        chunk_elements: int = CHUNK_ELEMENTS) -> torch.Tensor:
    """Sum over tokens of -log p(labels[:, t+1] | logits[:, t]) in fp32, positions labelled ignore_index skipped."""
    vocab = logits.size(-1)
    flat_targets = shift_labels(labels, ignore_index).reshape(-1)
    rows = max(1, chunk_elements // vocab)
    return _ChunkedCrossEntropySum.apply(logits.reshape(-1, vocab), flat_targets, ignore_index, rows)


def router_aux_loss(output) -> torch.Tensor | None:
    """The MoE router's load-balancing loss of one forward, as transformers computes it (`aux_loss` of its MoE
    models' output: Switch Transformer's, over this forward's tokens, unscaled) when the model's config has
    output_router_logits true; None otherwise, and for every dense model."""
    aux = getattr(output, "aux_loss", None)
    return aux if isinstance(aux, torch.Tensor) else None


def router_aux_line(config) -> str | None:
    """One start-up line for a MoE config (one with router_aux_loss_coef): whether the aux loss is trained."""
    coef = getattr(config, "router_aux_loss_coef", None)
    if coef is None:
        return None
    if getattr(config, "output_router_logits", False):
        return f"model: router aux loss on: loss = LM loss + {coef} x aux_loss (config.router_aux_loss_coef)"
    return ("model: router aux loss off: config.output_router_logits is false (set it true in config.json to train "
            f"LM loss + {coef} x the load-balancing loss, as transformers does)")

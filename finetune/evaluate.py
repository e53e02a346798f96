"""The next-token loss (one definition for training and eval) and the validation loss over an eval set.

    python -m pytest tests/test_eval.py -q

Eval loss = sum of token losses over the eval rows / number of loss tokens, exactly, and the same
number at any world size: rows are cut into chunks of a fixed size (data.micro_batch_size, never a
function of W), chunk c runs on rank c % W, and the per-chunk sums are added in chunk order on every
rank after each round's all-reduce. Every rank runs the same number of forwards (FSDP all-gathers
need all ranks), so a rank without a chunk in the last round runs chunk 0 again and discards it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from finetune.data import IGNORE


def next_token_loss(model, ids, labels, position_ids=None, reduction: str = "sum") -> torch.Tensor:
    """Cross entropy of token t+1 given tokens <= t. position_ids carry packed documents' boundaries."""
    logits = model(input_ids=ids, position_ids=position_ids, use_cache=False).logits.float()
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), labels[:, 1:].reshape(-1),
                           ignore_index=IGNORE, reduction=reduction)


def eval_rows(num_rows: int, global_batch: int, eval_batches: int) -> int:
    return num_rows if eval_batches == 0 else min(num_rows, eval_batches * global_batch)


@torch.no_grad()
def _chunk_loss(model, samples, rows, device) -> tuple[float, int]:
    ids, labels, pos = samples.batch(rows)
    pos = None if pos is None else pos.to(device)
    tok = next_token_loss(model, ids.to(device), labels.to(device), pos, reduction="none")
    return float(tok.double().sum()), int((labels[:, 1:] != IGNORE).sum())


def evaluate(model, samples, num_rows: int, chunk: int, device, rank: int, world_size: int) -> tuple[float, int]:
    """(mean token loss, loss tokens) over the first num_rows rows of `samples`; call on every rank."""
    n_chunks = -(-num_rows // chunk)
    total, tokens = 0.0, 0
    was_training = model.training
    model.eval()  # no dropout: eval consumes no RNG, so it cannot change the training trajectory
    try:
        for first in range(0, n_chunks, world_size):
            mine = first + rank
            c = mine if mine < n_chunks else 0
            loss, n = _chunk_loss(model, samples, range(c * chunk, min((c + 1) * chunk, num_rows)), device)
            sums = torch.zeros(2, world_size, dtype=torch.float64)
            if mine < n_chunks:
                sums[0, rank], sums[1, rank] = loss, n
            dist.all_reduce(sums)  # zeros elsewhere: the sum of each column is exactly one rank's value
            for j in range(min(world_size, n_chunks - first)):  # chunk order, whatever W is
                total += float(sums[0, j])
                tokens += int(sums[1, j])
    finally:
        model.train(was_training)
    return total / max(tokens, 1), tokens

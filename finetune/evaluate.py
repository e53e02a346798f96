"""The eval metrics (finetune/eval_metrics.py `EVAL_METRICS`: the loss, next-token accuracy) over an eval set, each
the same number at any world size; and `sample`, greedy completions of a few prompts at the end of training
(train.sample_at_end).

    python -m pytest tests/test_eval.py -q

Eval rows are cut into chunks of a fixed size (data.micro_batch_size, never a function of W) and
chunk c runs on rank c % W, so each chunk's metric sums are computed from the same inputs at any W. The
sums are integers (counts; a loss in fixed point, 2^-24 resolution per chunk), whose addition is
associative: one all-reduce at the end gives the same totals whatever the order or the number of ranks. Every rank runs
the same number of forwards (FSDP all-gathers need all ranks), so a rank without a chunk in the last
round runs chunk 0 again and discards it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from finetune.data import IGNORE
from finetune.eval_metrics import EVAL_METRICS
from finetune.loss import next_token_loss_sum


def token_loss_sum(model, ids, labels, position_ids=None) -> torch.Tensor:
    """Summed next-token loss of a batch (fp32). position_ids carry packed documents' boundaries."""
    logits = model(input_ids=ids, position_ids=position_ids, use_cache=False).logits
    return next_token_loss_sum(logits, labels, IGNORE)


def eval_rows(num_rows: int, global_batch: int, eval_batches: int) -> int:
    return num_rows if eval_batches == 0 else min(num_rows, eval_batches * global_batch)


@torch.no_grad()
def _chunk_sums(model, samples, rows, device) -> list[tuple[int, ...]]:
    """Each eval metric's integers for one chunk of rows, then (its loss tokens,): one forward."""
    ids, labels, pos = samples.batch(rows)
    pos = None if pos is None else pos.to(device)
    labels = labels.to(device)
    logits = model(input_ids=ids.to(device), position_ids=pos, use_cache=False).logits
    return [m.sums(logits, labels) for m in EVAL_METRICS] + [(int((labels[:, 1:] != IGNORE).sum()),)]


def evaluate(model, samples, num_rows: int, chunk: int, device, rank: int, world_size: int
             ) -> tuple[dict[str, float], int]:
    """({metric field: value} for each of EVAL_METRICS, loss tokens) over the first num_rows rows of `samples`;
    call on every rank."""
    n_chunks = -(-num_rows // chunk)
    totals = None
    was_training = model.training
    model.eval()  # no dropout: eval consumes no RNG, so it cannot change the training trajectory
    try:
        for first in range(0, n_chunks, world_size):
            mine = first + rank
            c = mine if mine < n_chunks else 0
            sums = _chunk_sums(model, samples, range(c * chunk, min((c + 1) * chunk, num_rows)), device)
            if totals is None:
                totals = [[0] * len(s) for s in sums]
            if mine < n_chunks:
                totals = [[t + n for t, n in zip(ts, s)] for ts, s in zip(totals, sums)]
    finally:
        model.train(was_training)
    flat = torch.tensor([n for ts in totals for n in ts], dtype=torch.int64)
    if dist.is_initialized():
        dist.all_reduce(flat)  # integers: exact in any order
    flat, summed = flat.tolist(), []
    for ts in totals:
        summed.append(flat[:len(ts)])
        flat = flat[len(ts):]
    return {m.field: m.value(s) for m, s in zip(EVAL_METRICS, summed)}, summed[-1][0]


@torch.no_grad()
def sample(model, tokenizer, prompts: list[str], device, max_new_tokens: int = 16) -> list[str]:
    """Greedy decoding, one prompt at a time. Every rank runs it: FSDP forward needs all ranks. Eager even with
    model.compile: each block's KV-cache entry is a guard of the compiled graph, so every block would compile
    anew, up to dynamo's recompile limit (8) and its warnings, for a few tokens."""
    outs = []
    for prompt in prompts:
        if tokenizer.chat_template:
            text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                                 add_generation_prompt=True)
        else:
            text = prompt
        ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]], device=device)
        new = []
        for _ in range(max_new_tokens):  # fixed length: all ranks do the same number of forwards
            with torch.compiler.set_stance("force_eager"):  # model.compile: see the docstring
                nxt = int(model(input_ids=ids).logits[0, -1].argmax())
            ids = torch.cat([ids, torch.tensor([[nxt]], device=device)], dim=1)
            new.append(nxt)
        if tokenizer.eos_token_id in new:
            new = new[: new.index(tokenizer.eos_token_id)]
        outs.append(tokenizer.decode(new, skip_special_tokens=True))
    return outs

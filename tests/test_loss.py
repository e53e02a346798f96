"""The chunked next-token loss equals the plain formula, in value and in gradient.

    python -m pytest tests/test_loss.py -q
"""

import torch
import torch.nn.functional as F

from finetune.data import IGNORE
from finetune.loss import next_token_loss_sum, shift_labels


def _plain(logits, labels):
    lg = logits.float()
    return F.cross_entropy(lg[:, :-1].reshape(-1, lg.size(-1)), labels[:, 1:].reshape(-1), ignore_index=IGNORE,
                           reduction="sum")


def _batch(dtype, vocab=97, batch=3, seq=11):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(batch, seq, vocab, generator=gen).to(dtype).requires_grad_()
    labels = torch.randint(0, vocab, (batch, seq), generator=gen)
    labels[0, :4] = IGNORE  # a masked prompt
    labels[2, -3:] = IGNORE  # padding
    return logits, labels


def test_shift_labels_targets_the_next_token():
    labels = torch.tensor([[5, 6, 7], [8, IGNORE, 9]])
    assert shift_labels(labels, IGNORE).tolist() == [[6, 7, IGNORE], [IGNORE, 9, IGNORE]]


def test_same_loss_and_gradients_as_the_plain_formula():
    for chunk_elements in (97 * 4, 97 * 7, 10**9):  # chunks that split rows unevenly, and one chunk
        logits, labels = _batch(torch.float32)
        ref = _plain(logits, labels)
        (g_ref,) = torch.autograd.grad(ref * 0.37, logits)
        got = next_token_loss_sum(logits, labels, IGNORE, chunk_elements=chunk_elements)
        (g_got,) = torch.autograd.grad(got * 0.37, logits)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-5)
        torch.testing.assert_close(g_got, g_ref, rtol=1e-6, atol=1e-7)


def test_bf16_logits_get_an_fp32_loss_and_bf16_gradient():
    logits, labels = _batch(torch.bfloat16)
    ref = _plain(logits, labels)
    (g_ref,) = torch.autograd.grad(ref, logits)
    got = next_token_loss_sum(logits, labels, IGNORE, chunk_elements=97 * 5)
    (g_got,) = torch.autograd.grad(got, logits)
    assert g_got.dtype == torch.bfloat16
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(g_got, g_ref)


def test_no_grad_path_gives_the_same_value():
    logits, labels = _batch(torch.float32)
    with torch.no_grad():
        assert torch.allclose(next_token_loss_sum(logits, labels, IGNORE, chunk_elements=97 * 3),
                              _plain(logits, labels), rtol=1e-6)

"""train_step on 2 gloo ranks: gradients accumulate sharded, and the staging wait sits right before the optimizer.

    python -m pytest tests/test_train_step.py -q
"""

import os

import pytest
import torch
import torch.multiprocessing as mp

from conftest import ROOT, start_on_free_port


def _micro_batches(rank: int, n: int, seq: int = 16):
    gen = torch.Generator().manual_seed(100 + rank)
    out = []
    for _ in range(n):
        ids = torch.randint(6, 101, (2, seq), generator=gen)
        labels = ids.clone()
        labels[:, :3] = -100  # a masked prompt
        out.append((ids, labels, None))  # (input_ids, labels, position_ids), as BatchStream yields them
    return out


def _build(seed: int = 0):
    from torch.distributed.device_mesh import init_device_mesh

    from finetune.config import ModelConfig
    from finetune.model import build_sharded_model, init_random
    mesh = init_device_mesh("cpu", (2,))
    model = build_sharded_model(ModelConfig(config_path=os.path.join(ROOT, "assets", "tiny-llama")), mesh,
                                torch.device("cpu"))
    init_random(model, seed, 0.02)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _grad_state(model) -> list:
    """Per parameter: None (no sharded grad: FSDP holds it unsharded), or (grad local shape, param local shape)."""
    return [None if p.grad is None else (tuple(p.grad.to_local().shape), tuple(p.to_local().shape))
            for p in model.parameters()]


def _worker(rank: int, port: int, results: dict) -> None:
    import torch.distributed as dist

    from train_fsdp import train_step
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        out = {}
        for reduce_every in (True, False):
            model, optim = _build()
            seen = []  # gradient state at the start of micro batches 2 and 3
            calls = iter(range(1000))
            model.register_forward_pre_hook(  # prepend: runs before FSDP's own pre-forward (unshard)
                lambda m, a: seen.append(_grad_state(m)) if next(calls) % 3 else None, prepend=True)
            order = []
            p0 = next(model.parameters())
            before = p0.to_local().clone()

            def staging_wait():  # must see finished gradients and untouched parameters
                order.append((all(p.grad is not None for p in model.parameters()),
                              torch.equal(p0.to_local(), before)))
            losses = [train_step(model, optim, _micro_batches(rank, 3, seq=16 + s), torch.device("cpu"), 2, 1.0,
                                 reduce_every, staging_wait)[0] for s in range(3)]
            out[reduce_every] = {"losses": losses, "seen": seen, "order": order,
                                 "moved": not torch.equal(p0.to_local(), before)}
        results[rank] = out
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs():
    results = mp.Manager().dict()
    start_on_free_port(_worker, lambda port: (port, results), nprocs=2)
    return dict(results)


def test_gradients_are_sharded_after_a_non_final_micro_batch_by_default(runs):
    for rank in (0, 1):
        seen = runs[rank][True]["seen"]
        assert len(seen) == 6  # micro batches 2 and 3 of three steps
        for state in seen:
            assert all(s is not None and s[0] == s[1] for s in state), f"rank {rank}: {state}"


def test_no_sync_opt_in_keeps_them_unsharded_and_gives_the_same_losses(runs):
    for rank in (0, 1):
        for state in runs[rank][False]["seen"]:
            assert all(s is None for s in state), "no-sync path should hold grads inside FSDP, unsharded"
        a, b = runs[rank][True]["losses"], runs[rank][False]["losses"]
        assert a == pytest.approx(b, rel=1e-6)
        assert a[2] < a[0]  # the steps did train


def test_staging_wait_runs_after_backward_and_before_the_optimizer_step(runs):
    for rank in (0, 1):
        r = runs[rank][True]
        assert r["order"][0] == (True, True), "staging wait must see all grads and unchanged params"
        assert len(r["order"]) == 3 and r["moved"]

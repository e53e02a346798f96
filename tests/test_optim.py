"""The optimizers (finetune/optim.py): the registry builds each one, its declared state size is the real one and
is what the planner and the staging need count, hyperparameters come from the config at build and after a
resume, and SGD with momentum trains on FSDP2's DTensor shards, checkpoints at W=2 and resumes at W=1.

    python -m pytest tests/test_optim.py -q
"""

import os

import pytest
import torch

from conftest import ROOT, run_train
from ckpt import staging_need
from ckpt.reading import dcp_metadata, read_items
from finetune.config import load_config
from finetune.metrics import read_metrics
from finetune.optim import OPTIMIZERS, build_optimizer, follow_config_schedule, optimizer_kind
from finetune.plan import checkpoint_bytes, gpu_states, model_shapes, shard_numel

TIMEOUT = 240


class Log:
    def __init__(self):
        self.lines = []

    def info(self, line):
        self.lines.append(line)


def train_config(*overrides):
    return load_config(None, list(overrides)).train


def stepped(name: str):
    """An optimizer of `name` over a small model, after one step: its state exists."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    optimizer, scheduler = build_optimizer(model, train_config(f"train.optimizer={name}"))
    model(torch.randn(3, 8)).sum().backward()
    optimizer.step()
    scheduler.step()
    return model, optimizer, scheduler


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_declared_state_size_is_the_optimizers_real_state(name):
    """state_bytes and state_tensors are what the built optimizer holds after a step: the figures the planner,
    the staging need and the /dev/shm preflight read cannot drift from the optimizer."""
    model, optimizer, _ = stepped(name)
    params = list(model.parameters())
    states = [optimizer.state[p] for p in params]
    per_param = sum(t.nbytes for s in states for t in s.values() if t.dim()) / sum(p.numel() for p in params)
    assert per_param == OPTIMIZERS[name].state_bytes
    assert {len(s) for s in states} == {OPTIMIZERS[name].state_tensors}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_config_hyperparameters_at_build_and_after_a_resume(name):
    """build_optimizer writes the config's hyperparameters; after a load (here: groups changed by hand, as a
    checkpoint of another config would leave them), follow_config_schedule writes the current config's again."""
    t = train_config(f"train.optimizer={name}", "train.beta1=0.8", "train.beta2=0.99", "train.weight_decay=0.05")
    model = torch.nn.Linear(4, 4)
    optimizer, scheduler = build_optimizer(model, t)
    want = OPTIMIZERS[name].hyperparameters(t)
    assert want["weight_decay"] == 0.05 and (want.get("momentum") == 0.8 or want.get("betas") == (0.8, 0.99))
    assert {k: optimizer.param_groups[0][k] for k in want} == want
    for group in optimizer.param_groups:
        group.update({k: 0.5 if isinstance(v, float) else (0.5, 0.5) for k, v in want.items()}, lr=1.0)
    follow_config_schedule(optimizer, scheduler, t, Log())
    assert {k: optimizer.param_groups[0][k] for k in want} == want
    assert optimizer.param_groups[0]["lr"] == scheduler.get_last_lr()[0] < t.lr  # in warmup, by the schedule


def test_staging_and_planner_count_each_optimizers_state():
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    n, tensors = sum(p.numel() for p in model.parameters()), len(list(model.parameters()))
    adamw, sgd = staging_need(model, OPTIMIZERS["adamw"]), staging_need(model, OPTIMIZERS["sgd"])
    assert adamw == (4 * tensors, 12 * n + 8 * tensors)  # parameter, exp_avg, exp_avg_sq, step
    assert sgd == (2 * tensors, 8 * n + 8 * tensors)  # parameter, momentum_buffer
    cfg = {name: load_config(os.path.join(ROOT, "configs", "tiny.yaml"), [f"train.optimizer={name}"])
           for name in ("adamw", "sgd")}
    s = model_shapes(cfg["sgd"].model)
    state = {name: dict(gpu_states(c, s, 2)) for name, c in cfg.items()}
    assert [k for k in state["sgd"] if k.startswith("optimizer state")] == ["optimizer state (sgd: 4 B per parameter)"]
    assert sum(state["adamw"].values()) - sum(state["sgd"].values()) == 4 * shard_numel(s.sharded_trainable, 2)
    assert checkpoint_bytes(s, 2, optimizer_kind(cfg["sgd"].train).state_bytes)[0] == 8 * s.trainable


@pytest.fixture(scope="module")
def sgd_runs(tmp_path_factory):
    """SGD at W=2 straight to step 6, saving steps 3 and 6; then step 3 resumed at W=1 to step 6."""
    root = tmp_path_factory.mktemp("sgd")
    steps = ["train.optimizer=sgd", "train.max_steps=6", "ckpt.interval=3", "ckpt.keep_last=0",
             "ckpt.async_mode=off", "train.lr=0.05"]
    run_train(root / "w2", nproc=2, timeout=TIMEOUT, overrides=steps)
    step3 = str(root / "w2" / "checkpoints" / "step-000003")
    run_train(root / "w1", nproc=0, timeout=TIMEOUT, overrides=[*steps, f"ckpt.resume={step3}"])
    return root, step3, steps


def momentum(path: str) -> dict[str, torch.Tensor]:
    keys = [k for k in dcp_metadata(path).state_dict_metadata if k.endswith(".momentum_buffer")]
    return read_items(path, keys)


def test_sgd_trains_sharded_and_resumes_at_another_world_size(sgd_runs):
    """The W=1 continuation of the W=2 step-3 checkpoint matches the straight W=2 run: same losses, same momentum
    at step 6. A momentum reset at the resume would miss 0.9^3 x the step-3 momentum, far above the tolerance."""
    root, step3, _ = sgd_runs
    md = dcp_metadata(step3).state_dict_metadata
    assert not [k for k in md if "exp_avg" in k] and momentum(step3)
    saved = sum(m.properties.dtype.itemsize * m.size.numel() for m in md.values()
                if hasattr(m, "properties") and len(m.size))
    cfg = load_config(os.path.join(ROOT, "configs", "tiny.yaml"), ["train.optimizer=sgd"])
    assert saved == checkpoint_bytes(model_shapes(cfg.model), 2, optimizer_kind(cfg.train).state_bytes)[0]
    straight, resumed = (read_metrics(str(root / w / "metrics.jsonl"))[0] for w in ("w2", "w1"))
    assert sorted(resumed) == [4, 5, 6] and resumed[4]["world_size"] == 1
    for s in (4, 5, 6):
        assert resumed[s]["loss"] == pytest.approx(straight[s]["loss"], rel=1e-4)
    m3 = momentum(step3)
    m6 = {w: momentum(str(root / w / "checkpoints" / "step-000006")) for w in ("w2", "w1")}
    for key, want in m6["w2"].items():
        assert torch.allclose(m6["w1"][key], want, rtol=1e-3, atol=1e-7), key
    decayed = max(float((0.9 ** 3 * m3[k]).abs().max()) for k in m3)
    assert decayed > 1e3 * 1e-7  # what a reset would have lost is well outside atol


def test_resume_with_another_optimizer_is_refused_naming_both(sgd_runs):
    root, step3, steps = sgd_runs
    out = run_train(root / "refused", nproc=0, timeout=TIMEOUT, check=False,
                    overrides=[*steps, f"ckpt.resume={step3}", "train.optimizer=adamw"])
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert out.returncode == 2 and len(errors) == 1, out.stderr[-3000:]
    assert "train.optimizer ('sgd' -> 'adamw'" in errors[0] and "Traceback" not in out.stderr

"""The optimizers: a registry behind `train.optimizer`, the one function that writes the config's hyperparameters
into the param groups, and each optimizer's state size, which the planner and checkpoint staging read.

    python -m pytest tests/test_optim.py -q

- adamw (default): torch.optim.AdamW, fused; betas (train.beta1, train.beta2), decoupled train.weight_decay.
  State per parameter: exp_avg and exp_avg_sq (8 bytes for fp32 masters) and a `step` scalar per tensor.
- sgd: torch.optim.SGD with momentum train.beta1 and train.weight_decay (coupled: L2 added to the gradient).
  State per parameter: momentum_buffer, 4 bytes: a full fine-tune's optimizer memory and checkpoint drop from
  8 to 4 bytes per parameter (checkpoint 12 -> 8).

`write_hyperparameters` is the one place that sets them in the param groups: at build and after a resume (the
checkpoint's param groups are replaced by the current config's, so a changed beta or weight decay takes effect
and an optimizer's own settings never come back from an older run). `build_optimizer` and `follow_config_schedule`
call it; nothing else writes a param group.

A new optimizer is one entry in OPTIMIZERS (finetune/config.py offers the keys as train.optimizer): how to make it,
its hyperparameters from TrainConfig, and its state size. It must work on FSDP2's parameters, which are DTensor
shards (dim 0 of every tensor split over the ranks), so its step may only use ops that DTensor can run shard by
shard: elementwise and _foreach ops on tensors of the parameter's shape. It must not reduce along a dimension
(a row or column norm, a factored second moment): on a sharded dimension the result is a partial sum, and the
in-place update that follows fails. torch.optim.Adafactor does exactly that and fails at the first step with
"aten.pow_.Scalar: in-place operations that require placement changes are not supported ... _NormPartial"
(torch 2.13, 2 ranks, gloo). Fused kernels need a DTensor sharding rule: fused AdamW has one, fused SGD does not
("aten._fused_sgd_.default does not have a sharding strategy registered"), so SGD runs its for-loop/foreach path.
Its state must be tensors of the parameter's shape (DCP saves and reshards them like the parameter) or scalars.
tests/test_optim.py trains each entry on 2 ranks and resumes it on 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from finetune.schedule import lr_factor


@dataclass(frozen=True)
class OptimizerKind:
    make: Callable[[list], torch.optim.Optimizer]  # the optimizer over these parameters (hyperparameters come after)
    hyperparameters: Callable[[object], dict]  # TrainConfig -> what every param group gets, besides the LR
    state_bytes: int  # optimizer state per trainable fp32 parameter: the planner, staging, /dev/shm preflight
    state_tensors: int  # state tensors per parameter tensor (each a staged buffer and an open file in process mode)


OPTIMIZERS = {
    # fused on CUDA and CPU alike (DTensor shards either way): foreach allocates temporaries the size of the
    # shards on CPU; fused gives the same update to within 1 ulp (bench/adamw_cpu.py, docs/performance.md)
    "adamw": OptimizerKind(make=lambda params: torch.optim.AdamW(params, fused=True),
                           hyperparameters=lambda t: {"betas": (t.beta1, t.beta2), "weight_decay": t.weight_decay},
                           state_bytes=8, state_tensors=3),  # exp_avg, exp_avg_sq, step
    "sgd": OptimizerKind(make=lambda params: torch.optim.SGD(params),  # SGD reads its momentum at every step
                         hyperparameters=lambda t: {"momentum": t.beta1, "weight_decay": t.weight_decay},
                         state_bytes=4, state_tensors=1),  # momentum_buffer
}


def optimizer_kind(t) -> OptimizerKind:
    return OPTIMIZERS[t.optimizer]


def write_hyperparameters(optimizer: torch.optim.Optimizer, t, lr: float) -> None:
    """Set every param group's hyperparameters to TrainConfig `t`'s: the LR now (`lr`), the schedule's peak
    (`initial_lr`, which LambdaLR scales) and the optimizer's own (betas, momentum, weight decay)."""
    for group in optimizer.param_groups:
        group.update(lr=lr, initial_lr=t.lr, **optimizer_kind(t).hyperparameters(t))


def build_optimizer(model, t):
    """(optimizer, LR scheduler) over the trainable parameters (LoRA: the adapters only), as TrainConfig `t` says."""
    optimizer = optimizer_kind(t).make([p for p in model.parameters() if p.requires_grad])
    write_hyperparameters(optimizer, t, t.lr)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, t))


def follow_config_schedule(optimizer, scheduler, t, log) -> None:
    """After a load, the optimizer hyperparameters and the LR schedule are the current config's from this step
    on (a raised max_steps or a new lr must not keep the checkpoint's schedule). Unchanged config: same floats."""
    factor = lr_factor(scheduler.last_epoch, t)
    old_lr = optimizer.param_groups[0]["lr"]
    write_hyperparameters(optimizer, t, t.lr * factor)
    scheduler.base_lrs = [t.lr] * len(optimizer.param_groups)
    scheduler._last_lr = [g["lr"] for g in optimizer.param_groups]
    if optimizer.param_groups[0]["lr"] != old_lr:
        log.info(f"resume: LR at step {scheduler.last_epoch + 1} is {t.lr * factor:.4e} by the current config "
                 f"(the checkpoint's schedule had {old_lr:.4e})")

"""Optional loggers fed by the same records as metrics.jsonl: TensorBoard event files and Weights & Biases.

    torchrun --nproc_per_node 2 train_fsdp.py --config configs/tiny.yaml run.tensorboard=true run.wandb=offline
    tensorboard --logdir runs/tiny/tensorboard         # W&B offline: wandb sync runs/tiny/wandb/offline-run-*

Rank 0 only, and only when asked (`run.tensorboard=true`, `run.wandb=offline|online`); training never
needs either package. Scalars: train/loss, train/aux_loss (a MoE router's load-balancing loss, when trained),
train/lr, train/grad_norm, train/tokens_per_s (from consecutive step records), checkpoint/blocking_s and
checkpoint/committed_s, every eval metric of finetune/eval_metrics.py (eval/loss, eval/accuracy), and per rank
every log interval memory/peak_gib/rank_<r> (and memory/peak_reserved_gib/rank_<r> on CUDA), all against the
optimizer step (tests/test_loggers.py checks this list and docs/loggers.md's against SCALARS and PER_RANK).
"""

from __future__ import annotations

import os
import uuid

from finetune.config import ConfigError, to_dict
from finetune.eval_metrics import EVAL_METRICS

# field of a metrics.jsonl record -> scalar name; step records and events ("eval", "checkpoint") alike
SCALARS = {"loss": "train/loss", "aux_loss": "train/aux_loss", "lr": "train/lr", "grad_norm": "train/grad_norm",
           "blocking_s": "checkpoint/blocking_s", "committed_s": "checkpoint/committed_s",
           **{m.field: m.scalar for m in EVAL_METRICS}}  # eval/loss, eval/accuracy: finetune/eval_metrics.py
# field holding a list indexed by rank (finetune/per_rank.py) -> scalar name; each rank's value is <name>/rank_<r>
PER_RANK = {"peak_memory_gib": "memory/peak_gib", "peak_reserved_gib": "memory/peak_reserved_gib"}


class ScalarStream:
    """metrics.jsonl records -> (name, value, step) scalars, with tokens/s from one step record to the next."""

    def __init__(self):
        self._last = None  # (tokens, time) of the previous step record of this process

    def scalars(self, record: dict) -> list[tuple[str, float, int]]:
        step = record.get("step")
        if step is None:
            return []
        out = [(name, float(record[field]), step) for field, name in SCALARS.items()
               if isinstance(record.get(field), (int, float)) and not (field == "loss" and "event" in record)]
        out += [(f"{name}/rank_{r}", float(v), step) for field, name in PER_RANK.items()
                for r, v in enumerate(record.get(field) or ())]
        if "event" not in record and "tokens" in record and "time" in record:
            if self._last is not None and record["time"] > self._last[1]:
                out.append(("train/tokens_per_s", (record["tokens"] - self._last[0]) / (record["time"] - self._last[1]),
                            step))
            self._last = (record["tokens"], record["time"])
        return out


class TensorBoardLogger:
    def __init__(self, run_dir: str):
        from torch.utils.tensorboard import SummaryWriter
        self.path = os.path.join(run_dir, "tensorboard")
        self._writer = SummaryWriter(self.path, flush_secs=10)

    def log(self, scalars: list[tuple[str, float, int]]) -> None:
        for name, value, step in scalars:
            self._writer.add_scalar(name, value, step)

    def close(self) -> None:
        self._writer.close()


class WandbLogger:
    """One W&B run per run.dir: its id is kept in <run.dir>/wandb/run-id, so a resumed job continues it."""

    def __init__(self, run_dir: str, mode: str, project: str, config: dict):
        import wandb

        folder = os.path.join(run_dir, "wandb")
        os.makedirs(folder, exist_ok=True)
        id_file = os.path.join(folder, "run-id")
        if not os.path.exists(id_file):
            with open(id_file, "w") as f:
                f.write(uuid.uuid4().hex[:12])
        with open(id_file) as f:
            run_id = f.read().strip()
        try:
            self._run = wandb.init(project=project, dir=run_dir, mode=mode, id=run_id, resume="allow", config=config,
                                   name=os.path.basename(os.path.abspath(run_dir)),
                                   settings=wandb.Settings(console="off", silent=True))
        except Exception as e:  # noqa: BLE001 - wandb raises many types (no login, no network): one clear line
            raise ConfigError(f"run.wandb={mode}: wandb.init failed: {type(e).__name__}: {e} "
                               "(`wandb login` or WANDB_API_KEY for online; run.wandb=offline needs neither)") from None
        self._run.define_metric("*", step_metric="train/step")
        self.path = self._run.dir

    def log(self, scalars: list[tuple[str, float, int]]) -> None:
        by_step: dict[int, dict] = {}
        for name, value, step in scalars:
            by_step.setdefault(step, {"train/step": step})[name] = value
        for row in by_step.values():
            self._run.log(row)

    def close(self) -> None:
        self._run.finish()


def open_loggers(cfg, rank: int) -> list:
    """The loggers the config asks for, on rank 0; [] elsewhere and by default."""
    if rank != 0:
        return []
    loggers = []
    if cfg.run.tensorboard:
        loggers.append(TensorBoardLogger(cfg.run.dir))
    if cfg.run.wandb != "off":
        loggers.append(WandbLogger(cfg.run.dir, cfg.run.wandb, cfg.run.wandb_project, to_dict(cfg)))
    return loggers

"""Everything resumable, as `Stateful` objects that DCP calls `state_dict()` / `load_state_dict()` on.

    python -m pytest tests/test_ckpt_unit.py

- ModelOptimizer: the sharded model + optimizer through DCP's `get_state_dict` / `set_state_dict`, so the
  keys are FQNs and the shards reshard to any world size on load. Frozen parameters are not saved; a tied
  parameter (lm_head.weight = model.embed_tokens.weight) is saved once, under its first name.
- RNGState: python, numpy, torch CPU and the own CUDA device's generators of ONE rank, saved under a rank-unique key
  (`rng_rank<r>`): the same key on every rank would come back as rank 0's value for all of them.
- A state that grows (fit_to_checkpoint): a Stateful with a `fields_added_later()` method ({field: default})
  resumes a checkpoint written before those fields existed; a field the checkpoint holds that the Stateful no
  longer has (removed or renamed) is refused by name.
"""

from __future__ import annotations

import pickle
import random

import numpy as np
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from .errors import CheckpointError
from .reading import tied_aliases


class ModelOptimizer:
    """Only what training changes: frozen parameters (a LoRA base) are left out of the saved state, and
    loading does not expect them (they come from the base model, which meta.json fingerprints).

    A tied parameter is one tensor under two names; the model's state dict lists both (and DCP would write
    the tensor twice: 0.54 GB more per Qwen2.5-0.5B checkpoint). It is saved under its source name only, as
    save_pretrained does, and on load the alias is given the source's tensor, so the tie survives a resume.
    Checkpoints written before this hold the alias too: a load reads the source and ignores the copy."""
    MODEL, OPTIM = "model", "optim"  # its two sub-dicts: saved keys are "<its key>.model.<FQN>", "<its key>.optim...."

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        self.model, self.optimizer = model, optimizer
        self.has_frozen = any(not p.requires_grad for p in model.parameters())
        self.aliases = tied_aliases(model)  # {alias: source}, e.g. {"lm_head.weight": "model.embed_tokens.weight"}

    def state_dict(self) -> dict:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer,
                                            options=StateDictOptions(ignore_frozen_params=True))
        for alias in self.aliases:
            model_sd.pop(alias, None)
        return {self.MODEL: model_sd, self.OPTIM: optim_sd}

    def load_state_dict(self, state: dict) -> None:
        model_sd = dict(state[self.MODEL])
        for alias, source in self.aliases.items():  # the one tensor, loaded once, under both names
            if source in model_sd:
                model_sd[alias] = model_sd[source]
        # strict would demand the frozen weights too; the caller checks every trainable key is present
        set_state_dict(self.model, self.optimizer, model_state_dict=model_sd,
                       optim_state_dict=state[self.OPTIM],
                       options=StateDictOptions(strict=not self.has_frozen, ignore_frozen_params=True))


# ---------------------------------------------------------------- a train state that grows

class _OlderCheckpoint:
    """A growing Stateful as an older checkpoint sees it: DCP is asked only for the fields the checkpoint holds
    (so its strict load still catches everything else), and the fields added later get their defaults."""

    def __init__(self, stateful, defaults: dict):
        self.stateful, self.defaults = stateful, defaults

    def state_dict(self) -> dict:
        return {k: v for k, v in self.stateful.state_dict().items() if k not in self.defaults}

    def load_state_dict(self, state: dict) -> None:
        self.stateful.load_state_dict({**state, **self.defaults})


def fit_to_checkpoint(state: dict, saved_keys, path: str) -> tuple[dict, dict[str, object]]:
    """`state` as the checkpoint at `path` (holding DCP keys `saved_keys`) can fill it, and {"key.field": default}
    for each field a growing Stateful added after that checkpoint was written. Raises CheckpointError naming a field
    the checkpoint holds that the Stateful no longer has, or one it lacks that declares no default."""
    fitted, filled = dict(state), {}
    for key, stateful in state.items():
        added = getattr(stateful, "fields_added_later", None)
        if added is None:
            continue
        saved = {k[len(key) + 1:].split(".")[0] for k in saved_keys if k.startswith(key + ".")}
        current, defaults = set(stateful.state_dict()), added()
        gone, lacking = sorted(saved - current), sorted(current - saved)
        if gone:
            raise CheckpointError(f"checkpoint {path} holds '{key}.{gone[0]}', which this train state no longer has "
                                  "(a removed or renamed field): resume it with the code that wrote it, or start "
                                  "a new run (ckpt.resume=none)")
        undeclared = [f for f in lacking if f not in defaults]
        if undeclared:
            raise CheckpointError(f"checkpoint {path} has no '{key}.{undeclared[0]}': a field added to the train "
                                  "state resumes older checkpoints only with a default (fields_added_later)")
        if lacking:
            fitted[key] = _OlderCheckpoint(stateful, {f: defaults[f] for f in lacking})
            filled.update({f"{key}.{f}": defaults[f] for f in lacking})
    return fitted, filled


def staging_need(model: torch.nn.Module, optimizer_state) -> tuple[int, int]:
    """(tensors, bytes) this rank stages per checkpoint: each local parameter shard, its optimizer state and a
    scalar's allowance per parameter tensor. `optimizer_state`: any object with `state_bytes` (per fp32 parameter:
    AdamW's two moments are 8, so 12 x params / W in all) and `state_tensors` (per parameter tensor: AdamW's 3).
    Frozen parameters (a LoRA base) are not saved, so not staged."""
    params = [p for p in model.parameters() if p.requires_grad]
    shards = [p.to_local() if hasattr(p, "to_local") else p for p in params]
    local_bytes = sum(s.nbytes for s in shards) + optimizer_state.state_bytes * sum(s.numel() for s in shards)
    return (1 + optimizer_state.state_tensors) * len(params), local_bytes + 8 * len(params)


def rng_key(rank: int) -> str:
    return f"rng_rank{rank}"


class RNGState:
    """One blob per rank; pickled so DCP stores it as a single bytes item instead of 600 tuple entries."""

    def state_dict(self) -> dict:
        state = {
            "python": random.getstate(),
            "numpy": np.random.get_state(),
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,  # this rank's own GPU
        }
        return {"blob": pickle.dumps(state)}

    def load_state_dict(self, state: dict) -> None:
        s = pickle.loads(state["blob"])
        random.setstate(s["python"])
        np.random.set_state(s["numpy"])
        torch.set_rng_state(s["torch"])
        if s["cuda"] is not None and torch.cuda.is_available():
            # one state, onto the current device: restoring all by index goes wrong when GPUs per node change
            cuda = s["cuda"]
            if isinstance(cuda, list):  # checkpoints before this change saved every visible GPU
                cuda = cuda[torch.cuda.current_device()] if torch.cuda.current_device() < len(cuda) else None
            if cuda is not None:
                torch.cuda.set_rng_state(cuda)


# ---------------------------------------------------------------- the RNG rule of a resume (the one place)
# If the checkpoint holds per-rank RNG of exactly this many ranks (meta.json `rng_world_size`, default
# `world_size`; `python -m ckpt reshard` keeps the original's), rank r restores `rng_rank<r>`. Otherwise every
# rank reseeds python/numpy/torch with derived_seed(seed, rank, step). A fresh start seeds with step 0.

DERIVED_SEED = "seed*1000 + rank + 7919*step"  # in words, for the resume log and `python -m ckpt inspect`


def rng_world_size(meta: dict) -> int | None:
    """How many ranks' RNG blobs (rng_rank<r>) the checkpoint holds: a reshard keeps the original's."""
    return meta.get("rng_world_size", meta.get("world_size"))


def restores_rng(meta: dict, world_size: int) -> bool:
    """Whether a resume at `world_size` ranks restores each rank's saved RNG (else: derived_seed)."""
    return rng_world_size(meta) == world_size


def derived_seed(seed: int, rank: int, step: int = 0) -> int:
    """Each rank's RNG seed at a fresh start (step 0), or after a resume that cannot restore the saved
    per-rank RNG (another world size): DERIVED_SEED."""
    return seed * 1000 + rank + 7919 * step


def reseed_all(seed: int) -> None:
    """Deterministic RNG for every library; used at start and when a resume changes world size."""
    random.seed(seed)
    np.random.seed(seed % (1 << 32))
    torch.manual_seed(seed)

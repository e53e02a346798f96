"""What model.py and lora.py share, below both: parameters drawn the same at any world size, and ModelError.

    python -m pytest tests/test_model_init.py tests/test_lora.py -q

A parameter's values come from a generator seeded by (seed, parameter name): the full tensor is drawn and
each rank keeps its shard of it, so W=1 and W=8 start from the same weights. Imports torch only.
"""

from __future__ import annotations

import hashlib

import torch
from torch.distributed.tensor import DTensor, distribute_tensor


class ModelError(ValueError):
    """The model cannot be built or sharded as asked; the message names the model class."""


def seed_for(seed: int, name: str) -> int:
    """The generator seed of parameter `name`: independent of the world size and of the other parameters."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") & ((1 << 63) - 1)


def local_shard(param: torch.Tensor) -> torch.Tensor:
    """This rank's part of a parameter (the parameter itself when it is not sharded)."""
    return param.to_local() if isinstance(param, DTensor) else param


def copy_full_into(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy the full tensor `full` into `param`, of which this rank keeps only its shard."""
    if isinstance(param, DTensor):
        shard = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
        param.to_local().copy_(shard.to_local())
    else:
        param.copy_(full)

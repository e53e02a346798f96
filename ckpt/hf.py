"""Hugging Face weights in: read a local safetensors model straight into the sharded model.

    python -m pytest tests/test_hf.py

Each rank reads only the slices of its own shards (DCP HuggingFaceStorageReader plans reads per
shard), so the full model is never materialised on one rank.
"""

from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict


def load_hf_weights(model: torch.nn.Module, hf_dir: str) -> None:
    sd = get_model_state_dict(model)
    dcp.load(sd, storage_reader=HuggingFaceStorageReader(hf_dir), planner=DefaultLoadPlanner(allow_partial_load=True))
    set_model_state_dict(model, sd, options=StateDictOptions(strict=False))

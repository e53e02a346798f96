"""Sharded, async, committed and verified checkpoints for FSDP2 with torch.distributed.checkpoint.

    python -m ckpt --help

The training script imports CheckpointManager and the Statefuls; nothing here imports the training
config, so the package drops into any FSDP2 training loop.
"""

from .commit import VerifyError, verify_checkpoint
from .layout import step_dir
from .manager import CheckpointError, CheckpointManager, DiskFullError, collective_timed_out, latest_committed_step, \
    on_rank0_then_share, read_meta, read_saved_config
from .state import ModelOnly, ModelOptimizer, RNGState, reseed_all, rng_key, staging_need

__all__ = ["CheckpointError", "CheckpointManager", "DiskFullError", "ModelOnly", "ModelOptimizer", "RNGState",
           "VerifyError", "collective_timed_out", "latest_committed_step", "on_rank0_then_share", "read_meta",
           "read_saved_config", "reseed_all", "rng_key", "staging_need", "step_dir", "verify_checkpoint"]

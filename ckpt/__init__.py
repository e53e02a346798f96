"""Sharded, async, committed and verified checkpoints for FSDP2 with torch.distributed.checkpoint.

    python -m ckpt --help

The training loop calls TrainingCheckpoints (loop.py: when to save, what a failure means), which drives
CheckpointManager (manager.py: how; its parts are saver.py, committer.py, lock.py and resume.py). Nothing
here imports the training config: the trainer hands over plain objects, its options, and a CheckpointSchema
(schema.py) naming what its checkpoints hold.
docs/design.md draws the flow and says which file owns which rule.
"""

from .manifest import VerifyError, verify_checkpoint
from .errors import CheckpointError, DiskFullError, collective_timed_out
from .layout import read_meta, read_saved_config, step_dir
from .loop import TrainingCheckpoints, check_staging
from .manager import CheckpointManager, latest_committed_step
from .schema import CheckpointSchema
from .state import ModelOptimizer, RNGState, reseed_all, rng_key, staging_need

__all__ = ["CheckpointError", "CheckpointManager", "CheckpointSchema", "DiskFullError", "ModelOptimizer", "RNGState",
           "TrainingCheckpoints", "VerifyError", "check_staging", "collective_timed_out", "latest_committed_step", "read_meta",
           "read_saved_config", "reseed_all", "rng_key", "staging_need", "step_dir", "verify_checkpoint"]

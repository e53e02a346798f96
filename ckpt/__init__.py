"""Sharded, async, committed and verified checkpoints for FSDP2 with torch.distributed.checkpoint.

    python -m ckpt --help

Owns how to checkpoint, and every failure rule. A training loop opens one handle, TrainingCheckpoints
(loop.py, `open_checkpoints`: resume, when to save, what a failure means, finish, export), which drives
CheckpointManager (manager.py: how; its parts are saver.py, committer.py, lock.py and resume.py), and with
ckpt.memory_interval a second one for node-local memory (memory.py, the memory tier; replicate.py copies it to
peer nodes, recover.py resumes from it, peers.py moves files between nodes). Offline
tools: `python -m ckpt` (verify, inspect: describe.py, reshard, export). Nothing here imports the training
config: the trainer hands over plain objects, its options, an event sink, and a CheckpointSchema (schema.py)
naming what its checkpoints hold.
May import: common/, torch, the standard library, and third-party packages (safetensors, yaml; transformers
and peft lazily, in the export). Never finetune/ or train_fsdp.py. docs/design.md draws the layers.
"""

from .manifest import VerifyError, verify_checkpoint
from .errors import CheckpointError, DiskFullError, collective_timed_out
from .layout import latest_committed_step, read_meta, read_saved_config, step_dir
from .loop import TrainingCheckpoints, open_checkpoints
from .manager import CheckpointManager
from .schema import CheckpointSchema
from .state import ModelOptimizer, RNGState, reseed_all, rng_key, staging_need

__all__ = ["CheckpointError", "CheckpointManager", "CheckpointSchema", "DiskFullError", "ModelOptimizer", "RNGState",
           "TrainingCheckpoints", "VerifyError", "collective_timed_out", "latest_committed_step", "open_checkpoints",
           "read_meta",
           "read_saved_config", "reseed_all", "rng_key", "staging_need", "step_dir", "verify_checkpoint"]

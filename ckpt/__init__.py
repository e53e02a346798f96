"""Sharded, async, committed and verified checkpoints for FSDP2 with torch.distributed.checkpoint.

    python -m ckpt --help

Owns how to checkpoint, and every failure rule. Its parts, top to bottom:
- the handle a training loop holds: loop.py (`open_checkpoints` -> TrainingCheckpoints: resume, when to save,
  what a failure means, finish, export); the offline tools: `python -m ckpt` (__main__.py; describe.py inspect,
  reshard.py, verify, export).
- memory_tier/ (node-local memory, replicated to peer nodes) and hf/ (HF weights in, HF folders out): each
  imports the core below, never the other, and only the layer above imports them.
- the core, flat in this folder: the save path (manager.py -> saver.py -> uploader.py -> save_plan.py,
  prestage.py), the commit protocol (commit_protocol.py: when a checkpoint counts as complete; committer.py runs
  it, retention.py after it), the resume path (resume.py, state.py), the job lock (lock.py), and what they share
  (layout.py, checksum.py, errors.py, faults.py, schema.py, reading.py, lora_base.py).
- storage/ (base.py's contract, local.py, s3.py, azure.py, the job lock's classes): a local folder or an object
  store, one class per store behind the operations the protocol needs; it imports nothing else of ckpt/.
Nothing here imports the training config: the trainer hands over plain objects, its options, an event sink, and
a CheckpointSchema (schema.py) naming what its checkpoints hold.
May import: common/, torch, the standard library, and third-party packages (safetensors, yaml; transformers
and peft lazily, in the export). Never finetune/ or train_fsdp.py. docs/design.md draws the layers and says
which file to change for what; tests/test_layers.py checks the arrows.
"""

from .commit_protocol import VerifyError, verify_checkpoint
from .errors import CheckpointError, DiskFullError, collective_timed_out, lost_a_rank
from .layout import latest_committed_step, read_meta, read_saved_config, step_dir
from .loop import TrainingCheckpoints, open_checkpoints
from .manager import CheckpointManager, settle_alone
from .schema import CheckpointSchema
from .state import ModelOptimizer, RNGState, reseed_all, rng_key, staging_need

__all__ = ["CheckpointError", "CheckpointManager", "CheckpointSchema", "DiskFullError", "ModelOptimizer", "RNGState",
           "TrainingCheckpoints", "VerifyError", "collective_timed_out", "latest_committed_step", "lost_a_rank",
           "open_checkpoints", "read_meta", "read_saved_config", "reseed_all", "rng_key", "settle_alone", "staging_need",
           "step_dir", "verify_checkpoint"]

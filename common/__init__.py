"""The bottom layer: what ckpt/ and finetune/ both need, so neither imports the other for it.

    python -m pytest tests/test_layers.py -q      # the import rules, checked from the source

Owns: rank-0 helpers (rank 0 runs and every rank gets the result or the error), a small all-reduce, a free local
port, the world-size divisibility rule (dist.py), one rank builds while the others wait through the job's store
(handoff.py), whether a folder is one folder on every node (shared_paths.py), the one name -> dtype map of configs and the command line (dtypes.py), the start and end
lines of a long phase (progress.py), the one plural rule of printed counts (words.py), and the torch and
transformers releases supported (versions.py).
May import: torch and the standard library only; nothing of this project outside common/.
"""

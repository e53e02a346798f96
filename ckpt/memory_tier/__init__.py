"""The memory tier: the disk tier's checkpoint every ckpt.memory_interval steps into node-local memory
(/dev/shm), copied to peer nodes, and resumed from there when it is newer than the disk's (docs/memory-tier.md).

    python -m pytest tests/test_memory_tier.py tests/test_memory_replicas.py -q

- tier.py: `MemoryTier`, what the trainer's handle (loop.py) drives: its budget, its saves, the choice of tier on
  resume.
- replicate.py: one save across nodes (`TierWriter`, `NodeCommitter`): a step counts on a node once its marker
  is written, after every rank's files have their copies; per-node retention.
- recover.py: `TierRecovery`: the newest step the live nodes can rebuild, checked, fetched where a node lacks it.
- peers.py: which ranks share a node, the ring of replicas, files sent between nodes over gloo.

May import: ckpt/'s core modules (manager, saver, uploader, committer, commit_protocol, resume, retention,
checksum, writeback, layout, errors, faults, preflight), common/, torch. Nothing in ckpt/ imports this package but
the handle the trainer holds (loop.py).
"""

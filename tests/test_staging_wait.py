"""Background staging (the CUDA path, run here on CPU): the training thread's wait before the optimizer step
is measured and reported in the checkpoint event.

    python -m pytest tests/test_staging_wait.py -q
"""

import time

import torch
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from ckpt import CheckpointManager


class SlowStager(DefaultStager):
    """Async staging on CPU (no stream, no pinned memory) that takes 0.5 s, like a big device-to-host copy."""

    def __init__(self):
        super().__init__(StagingOptions(use_pinned_memory=False, use_shared_memory=False, use_async_staging=True,
                                        use_non_blocking_copy=False))

    def _stage(self, state_dict, **kwargs):
        time.sleep(0.5)
        return super()._stage(state_dict, **kwargs)


def test_staging_wait_is_measured_and_reported(tmp_path):
    events = []
    mgr = CheckpointManager(str(tmp_path), "thread", keep_last=0, on_event=lambda name, **kw: events.append(kw))
    mgr._stager = SlowStager()
    try:
        state = {"w": torch.arange(1000.0)}
        blocking = mgr.save(1, state, {"meta.json": "{}"})
        assert blocking < 0.4  # save() returns while staging still runs
        time.sleep(0.2)  # forward and backward would run here, hiding part of the copy
        t0 = time.perf_counter()
        mgr.wait_for_staging()
        waited = time.perf_counter() - t0
        mgr.wait()
        (ev,) = events
        assert 0.1 < ev["staging_wait_s"] <= waited + 0.05
        assert abs(ev["blocking_s"] - (blocking + ev["staging_wait_s"])) < 1e-6
    finally:
        mgr.close()

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
    mgr._stager._stager = SlowStager()  # the manager's ReusedStager holds it (ckpt/prestage.py)
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


def test_first_save_finds_its_buffers_allocated_and_stages_the_live_values(tmp_path):
    """prepare_staging allocates the host buffers in the background; the first save then only copies into
    them (no new buffer: the training thread does not pay for the allocation) and saves the current values."""
    import torch.distributed.checkpoint as dcp

    mgr = CheckpointManager(str(tmp_path), "thread", keep_last=0)
    try:
        state = {"w": torch.randn(300_000), "v": torch.randn(50, 7)}
        mgr.prepare_staging(state)
        stager = mgr._stager.ready()  # ready(): allocation joined
        before = {id(buf) for buf in stager.buffers()}
        assert len(before) == 2
        state["w"].add_(1.0)  # training goes on between the allocation and the save
        mgr.save(1, state, {"meta.json": "{}"})
        mgr.wait()
        assert {id(buf) for buf in stager.buffers()} == before  # nothing allocated by the save
        loaded = {"w": torch.zeros(300_000), "v": torch.zeros(50, 7)}
        dcp.load(loaded, checkpoint_id=str(tmp_path / "step-000001"))
        assert torch.equal(loaded["w"], state["w"]) and torch.equal(loaded["v"], state["v"])
    finally:
        mgr.close()


def test_a_steady_save_copies_into_the_same_staged_tensors():
    """Every save after the first returns the staged tensors of the one before (no tensor built, no buffer
    allocated: DCP's own stager deep-copies each tensor on every save), holding the values of now; two views of
    the same bytes are copied once and stay views of one buffer; the small values are copies."""
    from ckpt.prestage import make_stager

    stager = make_stager("thread")
    try:
        w = torch.randn(4, 5)
        state = {"m": {"w": w, "same": w.view(20), "col": w[:, 1]},
                 "opt": [{"step": torch.tensor(3.0), "lr": 0.1, "betas": (0.9, 0.95)}]}
        first = stager.stage(state)
        w.add_(1.0)
        state["opt"][0]["lr"] = 0.2
        second = stager.stage(state)
        assert second["m"]["w"] is first["m"]["w"] and second["opt"][0]["step"] is first["opt"][0]["step"]
        assert torch.equal(second["m"]["w"], w) and torch.equal(second["m"]["col"], w[:, 1])
        assert torch.equal(second["m"]["same"], w.view(20))
        buffer = second["m"]["w"].untyped_storage().data_ptr()
        assert second["m"]["same"].untyped_storage().data_ptr() == buffer  # not contiguous: the whole storage
        assert second["m"]["col"].untyped_storage().data_ptr() == buffer
        assert len(stager.buffers()) == 2  # w and its views, the step counter
        assert second["m"]["w"].untyped_storage().data_ptr() != w.untyped_storage().data_ptr()
        assert second["opt"][0]["lr"] == 0.2 and second["opt"][0]["betas"] == (0.9, 0.95)
    finally:
        stager.close()


def test_a_contiguous_part_of_a_storage_is_staged_as_only_its_bytes(tmp_path):
    """FSDP2's last shard of an uneven dim 0 is a view of a padded storage. DCP clones such a tensor before it
    writes it (its storage holds more than its bytes): the staged copy holds only the view's bytes, so it does not,
    and the file holds the view's values."""
    import torch.distributed.checkpoint as dcp

    from ckpt.prestage import make_stager

    padded = torch.randn(1195 * 8)
    shard = padded[8:].view(1194, 8)  # a contiguous part that starts inside the storage
    stager = make_stager("thread")
    try:
        staged = stager.stage({"w": shard, "whole": padded})
        assert staged["w"].untyped_storage().nbytes() == shard.nbytes and staged["w"].storage_offset() == 0
        assert torch.equal(staged["w"], shard)
        assert sorted(b.nbytes() for b in stager.buffers()) == [shard.nbytes, padded.nbytes]
        shard.add_(1.0)
        staged = stager.stage({"w": shard, "whole": padded})
        assert torch.equal(staged["w"], shard) and torch.equal(staged["whole"], padded)
        dcp.save(staged, checkpoint_id=str(tmp_path), no_dist=True)
        loaded = {"w": torch.zeros(1194, 8), "whole": torch.zeros(1195 * 8)}
        dcp.load(loaded, checkpoint_id=str(tmp_path), no_dist=True)
        assert torch.equal(loaded["w"], shard) and torch.equal(loaded["whole"], padded)
    finally:
        stager.close()


def test_process_mode_buffers_are_shared_memory():
    """Process mode's uploader reads the staged copy from shared memory: the early buffers must be shared too."""
    from ckpt.prestage import allocate_in_background, make_stager

    stager = make_stager("process")
    try:
        w = torch.randn(1000)  # the cache holds its buffer only while the source tensor lives
        allocate_in_background(stager, {"w": w}).join()
        (buf,) = stager.buffers()
        assert buf.is_shared() and buf.size() == 4000
        assert stager.stage({"w": w})["w"].untyped_storage().data_ptr() == buf.data_ptr()
    finally:
        stager.close()


def test_staging_starts_after_the_compute_streams_writes(tmp_path, monkeypatch):
    """DCP's staging stream does not wait for the compute stream: a save right after `optimizer.step()` must make
    the copy wait for it (ckpt/saver.py wait_for_state_writes). Here CUDA is pretended, and the order in which the
    current stream is synchronised and the stager copies is recorded (tests/test_gpu.py checks the values)."""
    order = []

    class Stream:
        def synchronize(self):
            order.append("synchronize")

    class Recording(SlowStager):
        def _stage(self, state_dict, **kwargs):
            order.append("stage")
            return super()._stage(state_dict, **kwargs)

    mgr = CheckpointManager(str(tmp_path), "thread", keep_last=0)
    mgr._stager._stager = Recording()
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *_a: Stream())
    try:
        mgr.save(1, {"w": torch.arange(10.0)}, {"meta.json": "{}"})
        mgr.wait()
    finally:
        mgr.close()
    assert order[:2] == ["synchronize", "stage"], order

"""The GPU-path fixes that can be observed without a GPU (tests/test_gpu.py runs the real thing on CUDA).

    python -m pytest tests/test_gpu_mechanisms.py -q
"""

import os
import pickle
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import filesystem
from torch.distributed.checkpoint.api import CheckpointException

import ckpt.loop
import train_fsdp
from ckpt.uploader import CheckpointWriter
from ckpt.state import RNGState
from conftest import ROOT, free_port, start_on_free_port
from finetune.model import build_mesh


def test_uploader_never_takes_the_cuda_stream_loader(tmp_path, monkeypatch):
    """DCP's _OverlappingCpuLoader (the CUDA path, which opens a context on GPU 0) is chosen when CUDA is
    available and per_thread_copy_ahead > 0; our writer sets it to 0, so the staged host copy is written
    directly. Pretend CUDA is there and make that loader fail."""
    def no_cuda_loader(*_a, **_k):
        raise AssertionError("the upload took DCP's CUDA loader")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(filesystem, "_OverlappingCpuLoader", no_cuda_loader)
    dcp.save({"w": torch.arange(10.0)}, storage_writer=CheckpointWriter(str(tmp_path / "ok"), 1), no_dist=True)
    with pytest.raises(CheckpointException, match="CUDA loader"):  # the check can fail: DCP's default writer
        dcp.save({"w": torch.arange(10.0)}, storage_writer=filesystem.FileSystemWriter(str(tmp_path / "default")),
                 no_dist=True)


class FakeCuda:
    """Two GPUs with distinct generator states; this process's device is `current`."""

    def __init__(self, current: int):
        self.current, self.states = current, {0: torch.tensor([10], dtype=torch.uint8),
                                               1: torch.tensor([11], dtype=torch.uint8)}

    def install(self, monkeypatch):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: self.current)
        monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device="cuda": self.states[self.current].clone())
        monkeypatch.setattr(torch.cuda, "set_rng_state",
                            lambda s, device="cuda": self.states.__setitem__(self.current, s))


def test_rng_saves_and_restores_only_this_ranks_device(monkeypatch):
    FakeCuda(current=1).install(monkeypatch)
    blob = RNGState().state_dict()
    assert int(pickle.loads(blob["blob"])["cuda"][0]) == 11  # one state: the rank's own device
    other = FakeCuda(current=0)  # same rank, now on GPU 0 (e.g. 2 nodes x 4 GPUs -> 1 node x 8)
    other.install(monkeypatch)
    RNGState().load_state_dict(blob)
    assert int(other.states[0][0]) == 11 and int(other.states[1][0]) == 11  # GPU 1 untouched (was 11)


def test_rng_reads_the_old_all_devices_format(monkeypatch):
    fake = FakeCuda(current=1)
    fake.install(monkeypatch)
    state = pickle.loads(RNGState().state_dict()["blob"])
    state["cuda"] = [torch.tensor([20], dtype=torch.uint8), torch.tensor([21], dtype=torch.uint8)]
    RNGState().load_state_dict({"blob": pickle.dumps(state)})
    assert int(fake.states[1][0]) == 21 and int(fake.states[0][0]) == 10


def _mesh_timeouts(rank: int, port: int, out) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=42))
    try:
        for timeout in (None, timedelta(seconds=42)):
            mesh = build_mesh(torch.device("cpu"), 2, 2, timeout)  # HSDP: 2 replicas x 1 shard
            got = [mesh.get_group(d)._get_backend(torch.device("cpu")).options._timeout for d in range(mesh.ndim)]
            if rank == 0:
                out.put((timeout, got))
        # rank 0's process holds the store: gone early, it reset rank 1's last lookup of its own size-1 group (a
        # full coverage run failed here, "Connection reset by peer")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_hsdp_mesh_groups_get_the_collective_timeout():
    """model.replicas > 1: torch splits the mesh groups off with its default timeout (30 min), not the default
    group's; build_mesh gives them train.collective_timeout_minutes."""
    queue = torch.multiprocessing.get_context("spawn").SimpleQueue()
    start_on_free_port(_mesh_timeouts, lambda port: (port, queue), nprocs=2)
    (_, torch_default), (_, ours) = queue.get(), queue.get()
    assert timedelta(minutes=30) in torch_default, "what torch does unasked (the size-1 shard group): can fail"
    assert ours == [timedelta(seconds=42)] * 2


def test_the_final_export_waits_on_the_checkpoint_group(monkeypatch):
    """export.at_end with LoRA: rank 0 merges while the others wait in a collective; that wait gets the checkpoint
    group's timeout (ckpt.timeout_minutes), not the default group's training one (10 min, short of a 70B merge)."""
    seen = {}
    monkeypatch.setattr(ckpt.loop, "export_final", lambda *a, **kw: seen.update(kw) or "exported")
    save_group = object()
    fake = SimpleNamespace(mgr=SimpleNamespace(last_saved_step=5, dir="ck", pg=save_group),
                           log=SimpleNamespace(info=lambda _m: None))
    ckpt.loop.TrainingCheckpoints.export(fake, 5, "out", "auto")
    assert seen.get("group") is save_group


@pytest.mark.parametrize("ends,graceful", [("returns", True), ("raises", False)])
def test_an_error_aborts_the_process_group_a_finished_run_destroys_it(monkeypatch, tmp_path, ends, graceful):
    """NCCL's graceful shutdown (destroy_process_group) flushes work; after an error peers may never match it."""
    for key, value in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1").items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    called = []
    real_destroy, real_abort = dist.destroy_process_group, dist.distributed_c10d._abort_process_group
    monkeypatch.setattr(dist, "destroy_process_group", lambda *a: called.append("destroy") or real_destroy(*a))
    monkeypatch.setattr(dist.distributed_c10d, "_abort_process_group",
                        lambda *a: called.append("abort") or real_abort(*a))

    def train(*_a):
        if ends == "raises":
            raise OSError("CUDA out of memory (standing for)")
        return 0
    monkeypatch.setattr(train_fsdp, "train", train)
    argv = ["--config", f"{ROOT}/configs/tiny.yaml", f"run.dir={tmp_path}"]
    # an exception is this rank's own error: main prints it and returns 77 (common/launcher.py), after the abort
    assert train_fsdp.main(argv) == (0 if graceful else train_fsdp.EXIT_FAILED)
    assert called == (["destroy"] if graceful else ["abort"]) and not dist.is_initialized()


class FakeNvml:
    """libnvidia-ml as ctypes calls it: GPU i has contexts[i] compute processes."""

    def __init__(self, contexts):
        self.contexts, self.shut = contexts, False

    def nvmlInit_v2(self):
        return 0

    def nvmlShutdown(self):
        self.shut = True
        return 0

    def nvmlDeviceGetCount_v2(self, count):
        count._obj.value = len(self.contexts)
        return 0

    def nvmlDeviceGetHandleByIndex_v2(self, i, handle):
        handle._obj.value = 100 + i
        return 0

    def nvmlDeviceGetComputeRunningProcesses_v3(self, handle, count, infos):
        assert infos is None and count._obj.value == 0, "asked for the count alone"
        count._obj.value = self.contexts[handle.value - 100]
        return 7 if count._obj.value else 0  # NVML_ERROR_INSUFFICIENT_SIZE when there are any


def test_gpu_contexts_counts_nvmls_compute_processes_per_gpu():
    """Issue 58 point 9: tests/test_gpu.py counts CUDA contexts per GPU (NVML's compute processes, which a
    container's PID namespace does not hide), not processes holding /dev/nvidia<N> open, which driver
    initialisation alone may do. Here NVML is a stand-in with 2 contexts on GPU 0 and none on GPU 1."""
    from conftest import gpu_contexts
    nvml = FakeNvml([2, 0])
    assert gpu_contexts(nvml) == {0: 2, 1: 0} and nvml.shut
    assert gpu_contexts(FakeNvml([])) == {}

"""The GPU suite: what the CPU tests cannot show. Skipped, with the reason printed, where CUDA is absent.

    python -m pytest tests/test_gpu.py -v -rs                 # every tier the machine's GPUs allow
    python -m pytest tests/test_gpu.py -v -rs -k "not 2gpu and not two_gpus"    # the single-GPU tier alone

Most tests are the CPU tests' twins, run at 1 GPU (torchrun --nproc_per_node 1: FSDP2 on a one-rank mesh,
cpu:gloo,cuda:nccl) and, on a machine with two, at 2 GPUs:
- bf16 compute with fp32 masters trains the tiny job and its loss falls (tests/test_train_e2e.py);
- async saves in thread and process modes, killed and resumed: bit-identical losses (train.deterministic=true);
- during process-mode saves every GPU has exactly one compute process (the uploader opens no CUDA context), the
  number of open files stays flat from one save to the next, and the pinned staging buffers are reused;
- a bf16 export loads with from_pretrained and gives the fp32 export's logits to bf16 precision;
- a tiny Gemma3 (a non-persistent buffer inside a module with weights) gives from_pretrained's logits;
- model.compile=true (Triton kernels) follows the eager losses, and its checkpoint resumes eager.
One GPU only: a checkpoint crosses between the GPU and 2 CPU ranks both ways (tests/test_world_size.py); a rank
killed under torchrun --max-restarts 1 resumes from the memory tier bit for bit (tests/test_memory_tier.py);
packed documents under flash_attention_2 (needs the flash_attn package) each get their own loss.
Two GPUs only: the 2-GPU checkpoint resumes on 1 GPU.
bash bench/gpu_check.sh runs the single-GPU tier and then bench/gpu_bench.py; see docs/gpu.md.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
from torch.distributed.checkpoint import FileSystemReader

from conftest import (GPUS, NO_CUDA, ON_CPU, ROOT, assert_loss_falls, children, events, gpu_contexts, kill_after_commit,
                      kill_workers, losses, one_gpu, run_train, start_on_free_port, two_gpus)
from finetune.metrics import read_metrics
from test_memory_tier import K, final_items, kill_after_memory_step, same_item, with_memory

pytestmark = pytest.mark.skipif(GPUS == 0, reason=NO_CUDA)
# each test that runs at any number of GPUs: once per count the machine has (ids 1gpu, 2gpu)
GPU_COUNTS = [pytest.param(1, marks=one_gpu, id="1gpu"), pytest.param(2, marks=two_gpus, id="2gpu")]

RUN = ["train.max_steps=12", "ckpt.interval=6", "ckpt.keep_last=0", "train.deterministic=true"]
# Each test's own bound, seconds (BOUND_S, else DEFAULT_BOUND_S): past it its processes are killed and it fails, and
# the tier goes on with the next test. The tests come in order of what only a GPU shows, most first, so a tier cut
# short by bench/gpu_check.sh's budget loses the CPU tests' twins; gpu_bench lists the tests that did not run.
DEFAULT_BOUND_S = 60
BOUND_S = {"test_a_save_right_after_the_optimizer_step_stages_its_values": 30,
           "test_kill_during_async_save_and_resume_is_bit_identical": 90,
           "test_a_killed_rank_resumes_from_the_memory_tier_bit_for_bit": 90,
           "test_compiled_blocks_follow_eager_and_resume_eager": 150,
           "test_a_compiled_block_keeps_the_straggler_events_out_of_its_graphs": 90}


@pytest.fixture(autouse=True)
def own_bound(request):
    bound = BOUND_S.get(request.function.__name__, DEFAULT_BOUND_S)

    def over(_signum, _frame):
        for child in children(os.getpid()):
            kill_workers(child)  # torchrun's ranks, in sessions of their own
        kill_workers(os.getpid())
        pytest.fail(f"over its bound of {bound} s (tests/test_gpu.py BOUND_S): its processes were killed",
                    pytrace=False)
    previous = signal.signal(signal.SIGALRM, over)
    signal.alarm(bound)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@one_gpu
def test_a_save_right_after_the_optimizer_step_stages_its_values(tmp_path):
    """`optim.step(); mgr.save()` with no synchronisation: the update is still queued behind a long kernel on the
    compute stream when the save starts; DCP's staging stream must not copy before it (ckpt/saver.py)."""
    import torch.distributed.checkpoint as dcp

    from ckpt import CheckpointManager
    w = torch.zeros(1 << 20, device="cuda")
    mgr = CheckpointManager(str(tmp_path), "thread", keep_last=0)
    try:
        torch.cuda._sleep(2 ** 31)  # about a second of GPU time ahead of the update
        w.add_(1.0)
        mgr.save(1, {"w": w}, {"meta.json": "{}"})
        mgr.wait()
    finally:
        mgr.close()
    loaded = {"w": torch.zeros(1 << 20)}
    dcp.load(loaded, checkpoint_id=str(tmp_path / "step-000001"), no_dist=True)
    assert torch.equal(loaded["w"], w.cpu()), "the staged copy was taken before the update it followed"


def _flight_record_worker(rank: int, port: int, folder: str) -> None:
    import torch.distributed as dist

    from finetune.flight_record import dump_flight_records
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))
    t = torch.ones(1024, device="cuda")
    for _ in range(3):
        dist.all_reduce(t)
    torch.cuda.synchronize()
    written = dump_flight_records(folder, 0)
    dist.destroy_process_group()
    assert any(p.endswith("nccl_rank_0") for p in written), written


@one_gpu
def test_a_hang_keeps_nccls_flight_record_and_torchs_analyser_reads_it(tmp_path):
    """Issue 58 point 4 on NCCL: the CUDA build has _dump_nccl_trace; after 3 all_reduces the hang exit's dump
    (finetune/flight_record.py dump_flight_records) holds them, and torch's analyser (torchfrtrace) reads the folder."""
    import pickle

    import torch._C._distributed_c10d as c10d
    assert hasattr(c10d, "_dump_nccl_trace"), "this CUDA build of torch has no NCCL flight recorder"
    start_on_free_port(_flight_record_worker, lambda port: (port, str(tmp_path)), nprocs=1)
    folder = tmp_path / "hang" / "flight-attempt0"
    with open(folder / "nccl_rank_0", "rb") as f:
        record = pickle.load(f)
    names = [e["profiling_name"] for e in record["entries"]]
    assert names.count("nccl:all_reduce") >= 3, names
    out = subprocess.run([sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", str(folder), "--prefix",
                          "nccl_rank_"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]


@one_gpu
def test_a_compiled_block_keeps_the_straggler_events_out_of_its_graphs():
    """Issue 58 point 8 on CUDA: dynamo treats torch.cuda.Event as an in-graph class; the straggler monitor's hooks
    (finetune/stragglers.py, torch._dynamo.disable) stay out of the block's inductor graph: one frame, no graph
    break, and the events still time the block's forward."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from finetune.stragglers import StragglerMonitor
    block = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.GELU()).cuda()
    monitor = StragglerMonitor(0.2, 1, 0, 2, torch.device("cuda"), None)  # world 2: on
    monitor.watch_blocks([block])
    block.compile()
    torch._dynamo.reset()
    counters.clear()
    monitor.in_step = True
    for _ in range(4):
        block(torch.randn(64, 256, device="cuda"))
    torch.cuda.synchronize()
    assert dict(counters["frames"]) == {"total": 1, "ok": 1} and not counters["graph_break"], \
        (dict(counters["frames"]), dict(counters["graph_break"]))
    assert monitor._device_compute_s() > 0
    torch._dynamo.reset()


def _gpu_contexts() -> dict[int, int] | None:
    """{GPU: processes with a CUDA context} from NVML (conftest.gpu_contexts), else nvidia-smi's compute apps counted
    per GPU (counted, not identified: in a container their pids are the host's or missing); None if neither."""
    counts = gpu_contexts()
    if counts is not None or shutil.which("nvidia-smi") is None:
        return counts
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=gpu_uuid", "--format=csv,noheader"],
                         capture_output=True, text=True)
    if out.returncode != 0:
        return None
    uuids = [line.strip() for line in out.stdout.splitlines() if line.strip()]
    return {i: uuids.count(u) for i, u in enumerate(sorted(set(uuids)))}


def master_dtypes(ckpt_path) -> set:
    """The dtypes of the model's parameters in a checkpoint (the fp32 masters, whatever the compute dtype)."""
    md = FileSystemReader(str(ckpt_path)).read_metadata().state_dict_metadata
    return {m.properties.dtype for k, m in md.items() if k.startswith("app.model.")}


@pytest.mark.parametrize("gpus", GPU_COUNTS)
def test_process_mode_saves_one_process_per_gpu(tmp_path, gpus):
    """The CUDA contexts per GPU (NVML's compute processes), sampled during a run that saves every 2 steps in
    process mode: never more than one per GPU above what was there before the run (DCP's uploader must not open a
    context on GPU 0; its dist.barrier() initialises the driver, which may open the device nodes but makes no
    context). Skipped, saying so, where NVML and nvidia-smi count nothing (then nothing was measured)."""
    before = _gpu_contexts()
    if before is None:
        pytest.skip("neither NVML (libnvidia-ml.so.1) nor nvidia-smi answers: no context can be counted")
    samples, done = [], threading.Event()

    def sample():
        while not done.is_set():
            samples.append(_gpu_contexts() or {})
            time.sleep(0.2)
    t = threading.Thread(target=sample)
    t.start()
    try:
        run_train(tmp_path / "r", nproc=gpus, overrides=["train.max_steps=30", "ckpt.interval=2",
                                                        "ckpt.async_mode=process"])
    finally:
        done.set()
        t.join()
    assert len(events(tmp_path / "r", "checkpoint")) >= 10
    added = [{g: n - before.get(g, 0) for g, n in counts.items()} for counts in samples]
    busy = [a for a in added if any(n > 0 for n in a.values())]
    if not busy:
        pytest.skip(f"no context counted on any GPU during the run (before: {before}): nothing measured")
    assert all(n <= 1 for a in busy for n in a.values()), f"more than one new context on a GPU: {busy} (before {before})"
    assert max(sum(n > 0 for n in a.values()) for a in busy) == gpus


def _staged_pointers(staged) -> dict:
    """{index: (data_ptr, pinned)} of the staged copy's tensors above 1 KiB (DCP pins those), in a fixed order.
    On CUDA the stager stages in the background: the copy is a Future's result (done once the save is)."""
    staged = staged.result() if hasattr(staged, "result") else staged
    found = []

    def walk(obj):
        if isinstance(obj, dict):
            for k in sorted(obj, key=str):
                walk(obj[k])
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                walk(v)
        elif isinstance(obj, torch.Tensor) and obj.nbytes > 1024:
            found.append((obj.data_ptr(), obj.is_pinned()))
    walk(staged)
    return dict(enumerate(found))


def _fd_worker(rank: int, port: int, world: int, mode: str, ckpt_dir: str, out: dict) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from ckpt import CheckpointManager, ModelOptimizer
    from finetune.config import ModelConfig
    from finetune.model import build_sharded_model, init_random

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank))
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("cpu:gloo,cuda:nccl", rank=rank, world_size=world, device_id=device)
    try:
        model = build_sharded_model(ModelConfig(config_path=os.path.join(ROOT, "assets", "tiny-llama")),
                                    init_device_mesh("cuda", (world,)), device)
        init_random(model, 0, 0.02)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        mgr = CheckpointManager(ckpt_dir, mode, keep_last=1)
        state = {"app": ModelOptimizer(model, optim)}
        counts, staged = [], []
        for step in range(1, 6):
            ids = torch.randint(6, 101, (2, 16), device=device)
            model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
            mgr.wait_for_staging()
            optim.step()
            optim.zero_grad()
            mgr.save(step, state, {"meta.json": "{}"})
            mgr.wait()
            counts.append(len(os.listdir("/proc/self/fd")))
            staged.append(_staged_pointers(mgr.staged[1]))
        mgr.close()
        out[rank] = counts, staged
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("gpus", GPU_COUNTS)
@pytest.mark.parametrize("mode", ["thread", "process"])
def test_open_files_stay_flat_and_pinned_staging_is_reused(tmp_path, mode, gpus):
    """5 async saves: after the first, open files stay flat; every save stages into the same pinned host
    buffers (DCP's stager caches them per source storage: only the first save allocates and pins)."""
    out = mp.Manager().dict()
    start_on_free_port(_fd_worker, lambda port: (port, gpus, mode, str(tmp_path / "ck"), out), nprocs=gpus)
    assert sorted(out) == list(range(gpus))
    for rank, (counts, staged) in out.items():
        assert max(counts[1:]) - min(counts[1:]) <= 2, f"rank {rank}: open files grow with saves: {counts}"
        assert staged[0] and all(pinned for _, pinned in staged[0].values()), f"rank {rank}: staging not pinned"
        assert all(s == staged[0] for s in staged[1:]), f"rank {rank}: a save staged into new buffers"


@pytest.mark.parametrize("gpus", GPU_COUNTS)
def test_bf16_export_gives_the_fp32_exports_logits(tmp_path, gpus):
    from transformers import AutoModelForCausalLM
    run = tmp_path / "r"
    run_train(run, nproc=gpus, overrides=["train.max_steps=4", "ckpt.interval=0", "ckpt.async_mode=thread"])
    ckpt = sorted((run / "checkpoints").glob("step-*"))[-1]
    for dtype in ("fp32", "bf16"):
        subprocess.run([sys.executable, "-m", "ckpt", "export", "--dtype", dtype, str(ckpt), str(tmp_path / dtype)],
                       cwd=ROOT, check=True)
    ids = torch.randint(6, 101, (2, 24), generator=torch.Generator().manual_seed(0)).cuda()
    with torch.no_grad():
        full = AutoModelForCausalLM.from_pretrained(tmp_path / "fp32", dtype=torch.float32).cuda()(input_ids=ids).logits
        half = AutoModelForCausalLM.from_pretrained(tmp_path / "bf16", dtype=torch.bfloat16).cuda()
        half = half(input_ids=ids).logits
    assert half.dtype == torch.bfloat16
    err = (half.float() - full).abs().max() / full.abs().max()
    assert err < 0.05, f"bf16 export logits off by {err:.3f} of the largest logit"


def _gemma_worker(rank: int, port: int, world: int, path: str, out: dict) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM

    from ckpt.hf.load import load_hf_weights
    from finetune.config import ModelConfig
    from finetune.model import build_sharded_model

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("cpu:gloo,cuda:nccl", rank=rank, world_size=world, device_id=device)
    try:
        # fp32 compute on both sides, so the comparison is exact up to kernel rounding
        model = build_sharded_model(ModelConfig(name_or_path=path, param_dtype="fp32"),
                                    init_device_mesh("cuda", (world,)), device)
        load_hf_weights(model, path)
        ids = torch.randint(3, 101, (2, 24), generator=torch.Generator().manual_seed(7)).to(device)
        with torch.no_grad():
            ours = model(input_ids=ids, use_cache=False).logits
            ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device)(input_ids=ids).logits
        out[rank] = float((ours - ref).abs().max())
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("gpus", GPU_COUNTS)
def test_gemma3_tiny_gives_from_pretrained_logits(tmp_path, gpus):
    from test_model_init import save_tiny
    path = save_tiny(str(tmp_path / "gemma3"), "gemma3")
    out = mp.Manager().dict()
    start_on_free_port(_gemma_worker, lambda port: (port, gpus, path, out), nprocs=gpus)
    assert sorted(out) == list(range(gpus))
    assert max(out.values()) < 1e-3, dict(out)


def _token_losses(model, ids, labels, pos) -> torch.Tensor:
    """Loss of every labelled token of a one-row batch, in order."""
    from finetune.data import IGNORE
    logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits.float()
    keep = labels[0, 1:] != IGNORE
    return torch.nn.functional.cross_entropy(logits[0, :-1][keep], labels[0, 1:][keep], reduction="none")


@one_gpu
@torch.no_grad()
def test_flash_attention_packed_loss_is_each_documents_own_loss():
    """model.attn_implementation=flash_attention_2 on the padding-free packed layout train_fsdp.py uses with it
    (one row, per-document position ids: transformers' varlen path): every token's loss equals its document's
    loss computed alone, to bf16 rounding, and is far from the loss of the same row without position ids
    (documents attending to each other). Checked on CPU/SDPA in bf16: 0.001 vs 0.45 max per-token difference."""
    from finetune.config import ModelConfig
    from finetune.data import Samples
    from finetune.model import ModelError, causal_lm_from_config, check_attn_implementation, init_random
    from test_eval import _cache
    cfg = ModelConfig(config_path=os.path.join(ROOT, "assets", "tiny-llama"), attn_implementation="flash_attention_2")
    try:
        check_attn_implementation(cfg)
    except ModelError as e:
        pytest.skip(str(e))
    with torch.device("cuda"):
        model = causal_lm_from_config(cfg)
    init_random(model, seed=0, std=0.02)
    model = model.to(torch.bfloat16).eval()
    rng = np.random.default_rng(0)
    docs = [rng.integers(3, 100, n).tolist() for n in (5, 9, 12, 5, 13, 4)]  # 48 tokens, one document cut in two
    ids, labels, pos = (t.cuda() for t in Samples(_cache(docs), seq_len=24, pack=True, padding_free=True).batch([0, 1]))
    packed, leaky = _token_losses(model, ids, labels, pos), _token_losses(model, ids, labels, None)
    starts = (pos[0] == 0).nonzero().flatten().tolist() + [ids.shape[1]]
    alone = torch.cat([_token_losses(model, ids[:, a:b], ids[:, a:b], None) for a, b in zip(starts[:-1], starts[1:])])
    assert len(packed) == len(alone) == 48 - 7
    err, leak = float((packed - alone).abs().max()), float((leaky - alone).abs().max())
    assert err < 0.05 and leak > 10 * err, f"packed vs alone {err:.4f}, without position ids {leak:.4f}"
    assert torch.allclose(packed.sum(), alone.sum(), rtol=1e-3)


@pytest.mark.parametrize("gpus", GPU_COUNTS)
@pytest.mark.parametrize("mode", ["thread", "process"])
def test_kill_during_async_save_and_resume_is_bit_identical(tmp_path, mode, gpus):
    straight, run = tmp_path / "straight", tmp_path / "resumed"
    run_train(straight, nproc=gpus, overrides=[*RUN, f"ckpt.async_mode={mode}"])
    killed = run_train(run, nproc=gpus, overrides=[*RUN, f"ckpt.async_mode={mode}"],
                       env={"CKPT_FAULT": kill_after_commit(run, 6, 8)}, check=False)
    assert killed.returncode != 0 and max(losses(run)) == 8
    run_train(run, nproc=gpus, overrides=[*RUN, f"ckpt.async_mode={mode}"])
    assert [e["step"] for e in events(run, "resume")] == [6]
    a, b = losses(straight), losses(run)
    assert sorted(b) == list(range(1, 13))
    assert all(a[k] == b[k] for k in a), {k: (a[k], b[k]) for k in a if a[k] != b[k]}
    for e in events(straight, "checkpoint"):
        assert e["blocking_s"] >= e.get("staging_wait_s", 0.0)


@pytest.mark.parametrize("gpus", GPU_COUNTS)
def test_bf16_compute_with_fp32_masters_trains(tmp_path, gpus):
    """The default on CUDA (model.param_dtype=auto): bf16 compute, fp32 master shards; the tiny job learns."""
    run = tmp_path / "r"
    proc = run_train(run, nproc=gpus, overrides=["train.max_steps=40", "ckpt.interval=20"])
    assert "device cuda" in proc.stdout, proc.stdout[-2000:]
    assert_loss_falls(run)
    assert master_dtypes(run / "checkpoints" / "step-000040") == {torch.float32}


@one_gpu
def test_a_killed_rank_resumes_from_the_memory_tier_bit_for_bit(tmp_path):
    """tests/test_memory_tier.py's kill on the GPU: the one rank SIGKILLed after memory step K + 1 under torchrun
    --max-restarts 1 resumes from memory step K; losses and final state equal the uninterrupted run's."""
    det = ["train.deterministic=true"]
    a, b = tmp_path / "a", tmp_path / "b"
    run_train(a, 1, [*with_memory(a), *det])
    proc = run_train(b, 1, [*with_memory(b), *det], restarts=1,
                     env={"CKPT_FAULT": kill_after_memory_step(b, K, rank=0, attempt=0)})
    assert [(e["step"], e["tier"]) for e in events(b, "resume")] == [(K, "memory")], proc.stdout[-3000:]
    assert losses(b) == losses(a) and sorted(losses(b)) == list(range(1, 13))
    before, after = final_items(a), final_items(b)
    assert sorted(before) == sorted(after)
    for k in before:
        assert same_item(before[k], after[k]), f"{k} differs from the uninterrupted run's final state"


RANKS = {"gpu": (1, {}), "cpu": (2, ON_CPU)}  # (torchrun ranks, env): the GPU, or 2 CPU ranks on the same machine


@one_gpu
@pytest.mark.parametrize("saved_on,resumed_on", [("gpu", "cpu"), ("cpu", "gpu")])
def test_a_checkpoint_crosses_between_the_gpu_and_cpu_ranks(tmp_path, saved_on, resumed_on):
    """A checkpoint saved on the GPU resumes on 2 CPU ranks, and one saved by 2 CPU ranks on the GPU: the same
    samples in the same order, and losses within 1e-3 relative of the saving run's. fp32 compute on both sides
    (model.param_dtype=fp32), so the gap is kernel rounding (GPU and CPU sum in other orders), not bf16's."""
    run = [*RUN, "model.param_dtype=fp32", "ckpt.async_mode=thread"]
    first, then = tmp_path / saved_on, tmp_path / f"{resumed_on}-resumed"
    nproc, env = RANKS[saved_on]
    run_train(first, nproc=nproc, overrides=run, env=env)
    nproc, env = RANKS[resumed_on]
    proc = run_train(then, nproc=nproc, overrides=[*run, f"ckpt.resume={first / 'checkpoints' / 'step-000006'}"],
                     env=env)
    assert f"device {'cuda' if resumed_on == 'gpu' else 'cpu'}" in proc.stdout, proc.stdout[-2000:]
    assert [e["step"] for e in events(then, "resume")] == [6]
    a, b = read_metrics(str(first / "metrics.jsonl"))[0], read_metrics(str(then / "metrics.jsonl"))[0]
    assert sorted(b) == list(range(7, 13))
    for s in range(7, 13):
        assert b[s]["sample_ids"] == a[s]["sample_ids"], f"step {s}: another batch"
        assert b[s]["loss"] == pytest.approx(a[s]["loss"], rel=1e-3), f"step {s}: loss left the {saved_on} run's"


@pytest.mark.parametrize("gpus", GPU_COUNTS)
def test_compiled_blocks_follow_eager_and_resume_eager(tmp_path, gpus):
    """model.compile=true on the GPUs (Triton kernels): the losses follow the eager run's, and the compiled run's step-4
    checkpoint resumes eager on the compiled run's losses. fp32 compute on both sides, so the comparison is to kernel
    rounding (CPU: ~1e-7 relative, tests/test_compile.py); bf16 is checked by hand (docs/gpu.md, one GPU)."""
    run = ["train.max_steps=8", "ckpt.interval=4", "ckpt.keep_last=0", "model.param_dtype=fp32"]
    eager, compiled, resumed = tmp_path / "eager", tmp_path / "compiled", tmp_path / "resumed"
    run_train(eager, nproc=gpus, overrides=run)
    run_train(compiled, nproc=gpus, overrides=[*run, "model.compile=true"], timeout=900)  # compiling: minutes
    run_train(resumed, nproc=gpus, overrides=[*run, f"ckpt.resume={compiled / 'checkpoints' / 'step-000004'}"])
    a, b, c = losses(eager), losses(compiled), losses(resumed)
    assert sorted(b) == list(range(1, 9)) and sorted(c) == list(range(5, 9))
    for s in range(1, 9):
        assert b[s] == pytest.approx(a[s], rel=1e-3), f"step {s}: the compiled loss left eager's"
    for s in range(5, 9):
        assert c[s] == pytest.approx(b[s], rel=1e-3), f"step {s}: eager, resumed from the compiled checkpoint"


@two_gpus
def test_resume_two_gpus_on_one(tmp_path):
    """The 2-GPU run's step-6 checkpoint, resumed on 1 GPU, trains steps 7..12 on the 2-GPU run's samples and
    follows its losses (to float reduction order: 2 ranks sum in another order than 1, as in test_world_size.py)."""
    two = tmp_path / "two"
    run_train(two, nproc=2, overrides=[*RUN, "ckpt.async_mode=thread"])
    one = tmp_path / "one"
    run_train(one, nproc=1, overrides=[*RUN, f"ckpt.resume={two / 'checkpoints' / 'step-000006'}"])
    assert [e["step"] for e in events(one, "resume")] == [6]
    a, b = read_metrics(str(two / "metrics.jsonl"))[0], read_metrics(str(one / "metrics.jsonl"))[0]
    assert sorted(b) == list(range(7, 13))
    for s in range(7, 13):
        assert b[s]["world_size"] == 1 and b[s]["sample_ids"] == a[s]["sample_ids"], f"step {s}: another batch"
        assert b[s]["loss"] == pytest.approx(a[s]["loss"], rel=1e-4), f"step {s}: loss left the 2-GPU run's"

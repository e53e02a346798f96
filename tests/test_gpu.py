"""The GPU suite: what the CPU tests cannot show. Skipped, with the reason printed, where CUDA is absent.

    python -m pytest tests/test_gpu.py -v -rs          # on a machine with 2+ GPUs (most tests need 2)

- 2-GPU training with async saves in thread and process modes, killed and resumed: bit-identical losses
  (train.deterministic=true), and a resume of the 2-GPU checkpoint on 1 GPU;
- during process-mode saves every GPU has exactly one compute process (the uploader opens no CUDA
  context), and the number of open files stays flat from one save to the next;
- a bf16 export loads with from_pretrained and gives the fp32 export's logits to bf16 precision;
- a tiny Gemma3 (a non-persistent buffer inside a module with weights) gives from_pretrained's logits;
- packed documents under flash_attention_2 (1 GPU, needs the flash_attn package) each get their own loss;
- model.compile=true (Triton kernels) follows the eager losses, and its checkpoint resumes eager.
See docs/gpu.md for the same checks by hand.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from conftest import ROOT, events, start_on_free_port, kill_after_commit, losses, run_train
from finetune.metrics import read_metrics

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
NO_CUDA = "CUDA is not available (torch.cuda.is_available() is False): the GPU suite runs on a GPU machine"
pytestmark = pytest.mark.skipif(GPUS == 0, reason=NO_CUDA)
two_gpus = pytest.mark.skipif(GPUS < 2, reason=NO_CUDA if GPUS == 0 else f"needs 2 GPUs, found {GPUS}")

RUN = ["train.max_steps=12", "ckpt.interval=6", "ckpt.keep_last=0", "train.deterministic=true"]


def _compute_apps() -> list[tuple[int, str]]:
    """(pid, gpu uuid) of every process with a CUDA context, from nvidia-smi."""
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,gpu_uuid", "--format=csv,noheader"],
                         capture_output=True, text=True, check=True).stdout
    return [(int(p), u.strip()) for p, u in (line.split(",") for line in out.strip().splitlines() if line.strip())]


@two_gpus
@pytest.mark.parametrize("mode", ["thread", "process"])
def test_two_gpu_kill_and_resume_is_bit_identical(tmp_path, mode):
    straight, run = tmp_path / "straight", tmp_path / "resumed"
    run_train(straight, nproc=2, overrides=[*RUN, f"ckpt.async_mode={mode}"])
    killed = run_train(run, nproc=2, overrides=[*RUN, f"ckpt.async_mode={mode}"],
                       env={"CKPT_FAULT": kill_after_commit(run, 6, 8)}, check=False)
    assert killed.returncode != 0 and max(losses(run)) == 8
    run_train(run, nproc=2, overrides=[*RUN, f"ckpt.async_mode={mode}"])
    assert [e["step"] for e in events(run, "resume")] == [6]
    a, b = losses(straight), losses(run)
    assert sorted(b) == list(range(1, 13))
    assert all(a[k] == b[k] for k in a), {k: (a[k], b[k]) for k in a if a[k] != b[k]}
    for e in events(straight, "checkpoint"):
        assert e["blocking_s"] >= e.get("staging_wait_s", 0.0)


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


@two_gpus
def test_compiled_blocks_follow_eager_and_resume_eager(tmp_path):
    """model.compile=true on 2 GPUs (Triton kernels): the losses follow the eager run's, and the compiled run's step-4
    checkpoint resumes eager on the compiled run's losses. fp32 compute on both sides, so the comparison is to kernel
    rounding (CPU: ~1e-7 relative, tests/test_compile.py); bf16 is checked by hand (docs/gpu.md, checklist 9)."""
    run = ["train.max_steps=8", "ckpt.interval=4", "ckpt.keep_last=0", "model.param_dtype=fp32"]
    eager, compiled, resumed = tmp_path / "eager", tmp_path / "compiled", tmp_path / "resumed"
    run_train(eager, nproc=2, overrides=run)
    run_train(compiled, nproc=2, overrides=[*run, "model.compile=true"], timeout=900)  # compiling: minutes
    run_train(resumed, nproc=2, overrides=[*run, f"ckpt.resume={compiled / 'checkpoints' / 'step-000004'}"])
    a, b, c = losses(eager), losses(compiled), losses(resumed)
    assert sorted(b) == list(range(1, 9)) and sorted(c) == list(range(5, 9))
    for s in range(1, 9):
        assert b[s] == pytest.approx(a[s], rel=1e-3), f"step {s}: the compiled loss left eager's"
    for s in range(5, 9):
        assert c[s] == pytest.approx(b[s], rel=1e-3), f"step {s}: eager, resumed from the compiled checkpoint"


@two_gpus
def test_process_mode_saves_one_process_per_gpu(tmp_path):
    """nvidia-smi, sampled during a run that saves every 2 steps in process mode: never more than one
    process per GPU (DCP's uploader must not open a context on GPU 0)."""
    if shutil.which("nvidia-smi") is None:
        pytest.skip("nvidia-smi not found")
    samples, done = [], threading.Event()

    def sample():
        while not done.is_set():
            samples.append(_compute_apps())
            time.sleep(0.2)
    t = threading.Thread(target=sample)
    t.start()
    try:
        run_train(tmp_path / "r", nproc=2, overrides=["train.max_steps=30", "ckpt.interval=2",
                                                        "ckpt.async_mode=process"])
    finally:
        done.set()
        t.join()
    assert len(events(tmp_path / "r", "checkpoint")) >= 10
    busy = [s for s in samples if s]
    assert busy, "nvidia-smi never saw the training processes"
    for apps in busy:
        per_gpu = {}
        for pid, uuid in apps:
            per_gpu.setdefault(uuid, set()).add(pid)
        assert all(len(p) == 1 for p in per_gpu.values()), f"more than one process on a GPU: {apps}"


def _fd_worker(rank: int, port: int, ckpt_dir: str, out: dict) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from ckpt import CheckpointManager, ModelOptimizer
    from finetune.config import ModelConfig
    from finetune.model import build_sharded_model, init_random

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank))
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("cpu:gloo,cuda:nccl", rank=rank, world_size=2, device_id=device)
    try:
        model = build_sharded_model(ModelConfig(config_path=os.path.join(ROOT, "assets", "tiny-llama")),
                                    init_device_mesh("cuda", (2,)), device)
        init_random(model, 0, 0.02)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        mgr = CheckpointManager(ckpt_dir, "process", keep_last=1)
        state = {"app": ModelOptimizer(model, optim)}
        counts = []
        for step in range(1, 6):
            ids = torch.randint(6, 101, (2, 16), device=device)
            model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
            mgr.wait_for_staging()
            optim.step()
            optim.zero_grad()
            mgr.save(step, state, {"meta.json": "{}"})
            mgr.wait()
            counts.append(len(os.listdir("/proc/self/fd")))
        mgr.close()
        out[rank] = counts
    finally:
        dist.destroy_process_group()


@two_gpus
def test_open_files_stay_flat_across_process_mode_saves(tmp_path):
    out = mp.Manager().dict()
    start_on_free_port(_fd_worker, lambda port: (port, str(tmp_path / "ck"), out), nprocs=2)
    for rank, counts in out.items():
        assert max(counts[1:]) - min(counts[1:]) <= 2, f"rank {rank}: open files grow with saves: {counts}"


@two_gpus
def test_bf16_export_gives_the_fp32_exports_logits(tmp_path):
    from transformers import AutoModelForCausalLM
    run = tmp_path / "r"
    run_train(run, nproc=2, overrides=["train.max_steps=4", "ckpt.interval=0", "ckpt.async_mode=thread"])
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


def _gemma_worker(rank: int, port: int, path: str, out: dict) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM

    from ckpt.hf_load import load_hf_weights
    from finetune.config import ModelConfig
    from finetune.model import build_sharded_model

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("cpu:gloo,cuda:nccl", rank=rank, world_size=2, device_id=device)
    try:
        # fp32 compute on both sides, so the comparison is exact up to kernel rounding
        model = build_sharded_model(ModelConfig(name_or_path=path, param_dtype="fp32"), init_device_mesh("cuda", (2,)),
                                    device)
        load_hf_weights(model, path)
        ids = torch.randint(3, 101, (2, 24), generator=torch.Generator().manual_seed(7)).to(device)
        with torch.no_grad():
            ours = model(input_ids=ids, use_cache=False).logits
            ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device)(input_ids=ids).logits
        out[rank] = float((ours - ref).abs().max())
    finally:
        dist.destroy_process_group()


@two_gpus
def test_gemma3_tiny_gives_from_pretrained_logits(tmp_path):
    from test_model_init import save_tiny
    path = save_tiny(str(tmp_path / "gemma3"), "gemma3")
    out = mp.Manager().dict()
    start_on_free_port(_gemma_worker, lambda port: (port, path, out), nprocs=2)
    assert max(out.values()) < 1e-3, dict(out)


def _token_losses(model, ids, labels, pos) -> torch.Tensor:
    """Loss of every labelled token of a one-row batch, in order."""
    from finetune.data import IGNORE
    logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits.float()
    keep = labels[0, 1:] != IGNORE
    return torch.nn.functional.cross_entropy(logits[0, :-1][keep], labels[0, 1:][keep], reduction="none")


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

"""The planner and the presets: every configs/*.yaml parses and its header's plan command fits as it says.

    python -m pytest tests/test_plan.py -q
"""

from __future__ import annotations

import glob
import os
import re
import shlex

import pytest
import torch
import torch.distributed as dist

from conftest import ROOT, run_train

import train_fsdp
from finetune.config import load_config
from finetune.optim import optimizer_kind
from finetune.plan import GIB, checkpoint_bytes, model_shapes, shard_numel

PRESETS = sorted(p for p in glob.glob(os.path.join(ROOT, "configs", "*.yaml")) if not p.endswith("tiny.yaml"))
# Parameter counts as published for each architecture: the shipped config.json must reproduce them.
PUBLISHED = {"llama3.1-8b": 8_030_261_248, "llama3.1-70b": 70_553_706_496, "qwen2.5-7b": 7_615_616_512}


def header(path: str) -> str:
    lines = []
    for line in open(path):
        if not line.startswith("#"):
            break
        lines.append(line)
    return "".join(lines)


@pytest.fixture(autouse=True)
def _at_repo_root(monkeypatch):
    monkeypatch.chdir(ROOT)  # presets name assets/ relative to the repository root


def plan(capsys, args: list[str]) -> tuple[int, str, str]:
    rc = train_fsdp.main(args)
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_shipped_architectures_have_their_published_sizes(name):
    cfg = load_config(None, [f"model.config_path={os.path.join(ROOT, 'assets', name)}"])
    assert model_shapes(cfg.model).params == PUBLISHED[name]


@pytest.mark.parametrize("preset", PRESETS, ids=os.path.basename)
def test_preset_header_plan_runs_and_fits_as_stated(preset, capsys):
    assert len(PRESETS) >= 2
    head = header(preset)
    for word in ("GPU", "Memory per GPU", "Checkpoint:"):
        assert word in head, f"{preset}: the header must state {word}"
    command = re.search(r"plan:\s+python train_fsdp.py (.*)", head).group(1)
    rc, out, err = plan(capsys, shlex.split(command))
    assert rc == 0, out + err
    assert not dist.is_initialized(), "--plan must not start a process group"
    assert "OK: the plan fits" in out and "model.name_or_path" in out  # planned from the shipped config.json
    total = float(re.search(r"total\s+([\d.]+) GiB", out).group(1))
    stated = int(re.search(r"Memory per GPU \(planner estimate\): ~(\d+) GiB", head).group(1))
    assert abs(total - stated) <= 1, f"header says ~{stated} GiB, the planner {total} GiB"
    planned = re.search(r"checkpoint: ([\d.]+) (GiB|MiB) per save", out)
    stated = re.search(r"Checkpoint: (\d+) (GiB|MiB) per save", head)
    assert (round(float(planned.group(1))), planned.group(2)) == (int(stated.group(1)), stated.group(2))


def test_plan_says_why_it_does_not_fit(capsys):
    preset = os.path.join(ROOT, "configs", "llama3-8b-sft.yaml")
    rc, out, err = plan(capsys, ["--config", preset, "--plan", "--gpu-memory", "24"])
    assert rc == 1 and "does not fit: GPU memory" in err and "--gpu-memory 24 GiB" in err
    rc, out, err = plan(capsys, ["--config", preset, "--plan", "--gpus-per-node", "3"])
    assert rc == 1 and "not divisible by world size 3" in err and "[1, 2, 4, 8, 16, 32, 64]" in err
    rc, out, err = plan(capsys, ["--config", preset, "--plan", "--host-memory", "64"])
    assert rc == 1 and "does not fit: host memory" in err
    more, _, _ = plan(capsys, ["--config", preset, "--plan", "--gpu-memory", "24", "--nodes", "4"])
    assert more == 0  # 32 GPUs shard the states four times further


def test_plan_refuses_to_plan_a_model_it_cannot_see(capsys):
    rc, out, err = plan(capsys, ["--config", os.path.join(ROOT, "configs", "tiny.yaml"), "--plan",
                                 "model.name_or_path=/nowhere/model"])
    assert rc == 2 and err.startswith("error: model.name_or_path=/nowhere/model is not on this machine")


def test_lora_plan_counts_the_adapters_peft_adds(tmp_path):
    """The planner adds the adapters with training's own code: r x (in + out) per targeted Linear."""
    cfg = load_config(os.path.join(ROOT, "configs", "qwen2.5-7b-lora.yaml"))
    s = model_shapes(cfg.model)
    per_layer = 16 * ((3584 + 3584) * 2 + (3584 + 512) * 2 + (3584 + 18944) * 3)  # q, o; k, v; gate, up, down
    assert s.trainable == 28 * per_layer and s.params == PUBLISHED["qwen2.5-7b"]
    full = load_config(os.path.join(ROOT, "configs", "qwen2.5-7b-lora.yaml"), ["model.lora.r=0"])
    assert checkpoint_bytes(s, 4, 8)[0] * 150 < checkpoint_bytes(model_shapes(full.model), 4, 8)[0]


def test_fsdp_shards_are_padded_on_dim0():
    assert shard_numel([(101, 101 * 64)], 8) == 13 * 64  # ceil(101 / 8) rows
    assert shard_numel([(1, 1)], 8) == 1


def test_planned_checkpoint_size_is_what_a_run_saves(tmp_path):
    """The planner's 12 bytes per parameter, against the tensors a real W=2 checkpoint of the tiny model holds."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    run_train(tmp_path / "r", nproc=2, overrides=["train.max_steps=1", "ckpt.interval=0"])
    md = FileSystemReader(str(tmp_path / "r" / "checkpoints" / "step-000001")).read_metadata().state_dict_metadata
    saved = sum(m.properties.dtype.itemsize * m.size.numel() for m in md.values()
                if isinstance(m, TensorStorageMetadata) and len(m.size))  # not AdamW's 0-dim step counters
    cfg = load_config(os.path.join(ROOT, "configs", "tiny.yaml"), [])
    planned, per_rank = checkpoint_bytes(model_shapes(cfg.model), 2, optimizer_kind(cfg.train).state_bytes)
    assert saved == planned and planned < 2 * per_rank < planned * 1.1
    assert planned < GIB


def test_plan_knows_hsdp_and_no_sync_accumulation(capsys):
    """HSDP shards one copy over a node (W / model.replicas), and no-sync accumulation holds every grad."""
    preset = os.path.join(ROOT, "configs", "llama3-8b-sft.yaml")

    def total(*extra):
        rc, out, err = plan(capsys, ["--config", preset, "--plan", *extra])
        return float(re.search(r"total\s+([\d.]+) GiB", out).group(1)), out
    one_node, _ = total("--nodes", "1")
    four_fsdp, _ = total("--nodes", "4")
    four_hsdp, _ = total("--nodes", "4", "model.replicas=4")
    assert four_fsdp < four_hsdp and abs(four_hsdp - one_node) < 0.5  # activations may differ with the batch
    no_sync, out = total("--nodes", "1", "data.micro_batch_size=1", "train.reduce_every_micro_batch=false")
    assert "unsharded gradients between micro batches" in out
    synced, _ = total("--nodes", "1", "data.micro_batch_size=1")
    assert no_sync - synced == pytest.approx(4 * 8.03e9 / GIB, rel=0.01)  # fp32 grads of all 8B params


def test_the_memory_tier_counts_against_host_memory(capsys):
    """Its steps in /dev/shm and its staging buffers are RAM: a --host-memory that fits the job without the tier
    does not with it, on GPU and CPU ranks; with a memory_dir outside /dev/shm only its staging counts."""
    preset, tier = os.path.join(ROOT, "configs", "llama3-8b-sft.yaml"), "ckpt.memory_interval=1"
    rc, out, _ = plan(capsys, ["--config", preset, "--plan", tier])
    staged = float(re.search(r"host per node: ([\d.]+) GiB", out).group(1))
    steps, own = map(float, re.search(r"memory tier .*: ([\d.]+) GiB per node.* and ([\d.]+) GiB of RAM", out).groups())
    fits = ["--host-memory", str(staged + own + 1)]
    assert plan(capsys, ["--config", preset, "--plan", *fits, tier, "ckpt.memory_dir=/nvme/m"])[0] == 0
    rc, _, err = plan(capsys, ["--config", preset, "--plan", *fits, tier])
    needed = re.search(r"host memory: ([\d.]+) GiB per node needed", err)
    assert rc == 1 and float(needed.group(1)) == pytest.approx(staged + own + steps, abs=0.02)
    rc, out, _ = plan(capsys, ["--config", preset, "--plan", "--cpu", "--gpus-per-node", "2"])
    node = float(re.search(r"per node: 2 ranks\s+([\d.]+) GiB", out).group(1))
    assert plan(capsys, ["--config", preset, "--plan", "--cpu", "--gpus-per-node", "2", "--host-memory",
                         str(node + 1)])[0] == 0
    rc, out, err = plan(capsys, ["--config", preset, "--plan", "--cpu", "--gpus-per-node", "2", "--host-memory",
                                 str(node + 1), tier])
    assert rc == 1 and "does not fit: host memory" in err and "2 ranks + memory tier" in out


def test_cpu_plan_counts_staging_in_each_rank_and_no_cuda_context(capsys):
    """--plan --cpu: one per-rank total for a CPU process (fp32 compute, the async staging buffers in the rank's own
    memory, no CUDA context), a node's sum checked against --host-memory, and no CUDA context opened."""
    preset = os.path.join(ROOT, "configs", "llama3-8b-sft.yaml")
    rc, out, err = plan(capsys, ["--config", preset, "--plan", "--cpu", "--gpus-per-node", "2", "ckpt.async_mode=process"])
    assert rc == 0, err
    assert "CPU ranks = world size 2" in out and "CUDA context" not in out
    staged = re.search(r"async staging buffers \(ckpt.async_mode=process: shared memory\)\s+([\d.]+) GiB", out)
    ckpt = re.search(r"([\d.]+) GiB per rank;", out)
    assert staged and float(staged.group(1)) == float(ckpt.group(1))  # one rank's part of the checkpoint, once
    total = float(re.search(r"^\s+total\s+([\d.]+) GiB", out, re.M).group(1))
    node = float(re.search(r"per node: 2 ranks\s+([\d.]+) GiB", out).group(1))
    assert node == pytest.approx(2 * total, abs=0.02)
    rc_off, out_off, _ = plan(capsys, ["--config", preset, "--plan", "--cpu", "--gpus-per-node", "2", "ckpt.async_mode=off"])
    total_off = float(re.search(r"^\s+total\s+([\d.]+) GiB", out_off, re.M).group(1))
    assert total - total_off == pytest.approx(float(staged.group(1)), abs=0.02)
    rc, out, err = plan(capsys, ["--config", preset, "--plan", "--cpu", "--gpus-per-node", "2",
                                 "--host-memory", str(int(node) - 1)])
    assert rc == 1 and "does not fit: host memory" in err
    assert not torch.cuda.is_initialized()

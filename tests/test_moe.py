"""Mixture-of-Experts models in the Hub's layout: loaded, trained, resumed and exported as transformers writes them.

    python -m pytest tests/test_moe.py -q

transformers 5 fuses experts in memory (`mlp.experts.gate_up_proj`, [experts, 2 * width, hidden]) and its
save_pretrained writes one tensor per expert; ckpt/hf/convert.py follows its own conversion rules both ways.
- layout: the name maps agree with what from_pretrained / save_pretrained do to the same tensors;
- load at W=2: the gathered parameters equal from_pretrained's bit for bit (each rank reading its own experts);
- train at W=2 from a folder save_pretrained wrote, resume at W=1 with the same losses, export to the same tensor
  names and values save_pretrained writes, loaded back by from_pretrained with equal logits.
"""

from __future__ import annotations

import glob
import os

import pytest
import torch
from safetensors.torch import load_file

from conftest import start_on_free_port
from tiny_moe import MOE_FAMILIES, save_tiny_moe


def read_tensors(path: str) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        out.update(load_file(f))
    return out


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    # Mixtral in bf16 over several files (the dtype converted on load, experts split across files), Qwen3-MoE fp32
    return {"mixtral": save_tiny_moe(str(root / "mixtral"), "mixtral", torch.bfloat16, "20KB"),
            "qwen3_moe": save_tiny_moe(str(root / "qwen3_moe"), "qwen3_moe")}


# ---------------------------------------------------------------- the name maps, no process group

@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_layout_maps_agree_with_transformers(moe_models, family):
    from transformers import AutoModelForCausalLM

    from ckpt.hf.convert import hub_to_memory, memory_to_hub

    files = read_tensors(moe_models[family])
    assert MOE_FAMILIES[family][1] in files, sorted(files)[:8]
    model = AutoModelForCausalLM.from_pretrained(moe_models[family], dtype=torch.float32)
    memory = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight" or "lm_head.weight" in files}
    shapes = {k: tuple(v.shape) for k, v in memory.items()}
    placements, composed, unmapped = hub_to_memory(model, {k: tuple(v.shape) for k, v in files.items()}, shapes)
    assert unmapped == [] and composed == shapes
    assert any(len(ps) > 1 for ps in placements.values()), "no fused tensor: nothing was converted"
    for name, ps in placements.items():  # the parts tile the fused tensor exactly as from_pretrained filled it
        full = torch.full(shapes[name], float("nan"))
        for p in ps:
            full[tuple(slice(s, s + n) for s, n in zip(p.start, p.size))] = files[p.key].float().reshape(p.size)
        assert torch.equal(full, memory[name]), name
    written = memory_to_hub(model, shapes)
    assert sorted(p.key for p in written) == sorted(files)
    for p in written:
        part = memory[p.name][tuple(slice(s, s + n) for s, n in zip(p.start, p.size))].reshape(p.shape)
        assert torch.equal(part.to(files[p.key].dtype), files[p.key]), p.key


def test_unsupported_rule_is_refused_in_one_line():
    from transformers.core_model_loading import Transpose, WeightConverter

    from ckpt import CheckpointError
    from ckpt.hf.convert import _run, _Stacked

    rule = WeightConverter("a.weight", "b.weight", operations=[Transpose(0, 1)])
    rule.add_tensor("b.weight", "a.weight", "a.weight", _Stacked.leaf("a.weight", (2, 3)))

    class Model:
        config = None

    with pytest.raises(CheckpointError, match="Transpose, which the sharded load and export cannot follow"):
        _run(rule, "b.weight", Model())


# ---------------------------------------------------------------- load at W=2, bit for bit

def _load_worker(rank: int, port: int, models: dict) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM

    from ckpt.hf.load import load_hf_weights
    from finetune.config import Config
    from finetune.model import build_sharded_model

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        for family, path in models.items():
            cfg = Config()
            cfg.model.name_or_path = path
            model = build_sharded_model(cfg.model, mesh, torch.device("cpu"))
            load_hf_weights(model, path)
            want = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()
            for name, param in model.named_parameters():
                assert torch.equal(param.full_tensor(), want[name]), f"{family}: {name}"
            experts = model.model.layers[0].mlp.experts.gate_up_proj
            assert experts.to_local().shape[0] == 2, "FSDP should shard the expert dim: 2 of 4 experts per rank"
    finally:
        dist.destroy_process_group()


def test_load_hub_layout_w2_bit_exact(moe_models):
    start_on_free_port(_load_worker, lambda port: (port, moe_models), nprocs=2, start_method="fork")

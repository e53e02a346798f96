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

import os

import pytest
import torch

from conftest import read_hf_tensors, start_on_free_port
from finetune.metrics import read_metrics
from tiny_moe import MOE_FAMILIES, save_tiny_moe


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    # Mixtral in bf16 over several files (the dtype converted on load, experts split across files), Qwen3-MoE fp32
    return {"mixtral": save_tiny_moe(str(root / "mixtral"), "mixtral", torch.bfloat16, "20KB"),
            "qwen3_moe": save_tiny_moe(str(root / "qwen3_moe"), "qwen3_moe", output_router_logits=True,
                                       router_aux_loss_coef=0.05)}  # its router's aux loss trained


# ---------------------------------------------------------------- the name maps, no process group

@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_layout_maps_agree_with_transformers(moe_models, family):
    from transformers import AutoModelForCausalLM

    from ckpt.hf.convert import hub_to_memory, memory_to_hub

    files = read_hf_tensors(moe_models[family])
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

def _load_worker(rank: int, port: int, models: dict, ckpt_root: str) -> None:
    import json

    import torch.distributed as dist
    import yaml
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM

    from ckpt import CheckpointManager
    from ckpt.hf.load import load_hf_weights
    from finetune.config import Config
    from finetune.model import build_sharded_model

    import ckpt.hf.load

    read, real_open = [], ckpt.hf.load.safe_open  # the expert tensors this rank reads

    class Recording:
        def __init__(self, path, framework):
            self.file = real_open(path, framework=framework)

        def get_slice(self, key):
            read.append(key)
            return self.file.get_slice(key)

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        for family, path in models.items():
            cfg = Config()
            cfg.model.name_or_path = path
            model = build_sharded_model(cfg.model, mesh, torch.device("cpu"))
            read.clear()
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(ckpt.hf.load, "safe_open", Recording)
                load_hf_weights(model, path)
            experts = {int(k.split(".experts.")[1].split(".")[0]) for k in read}
            assert experts == {2 * rank, 2 * rank + 1}, f"{family}: rank {rank} read experts {sorted(experts)}"
            assert len(read) == 2 * 2 * 3, f"{family}: 2 layers x 2 experts x 3 tensors, read {len(read)}"
            want = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()
            for name, param in model.named_parameters():
                assert torch.equal(param.full_tensor(), want[name]), f"{family}: {name}"
            experts = model.model.layers[0].mlp.experts.gate_up_proj
            assert experts.to_local().shape[0] == 2, "FSDP should shard the expert dim: 2 of 4 experts per rank"
            mgr = CheckpointManager(os.path.join(ckpt_root, family), "off", keep_last=0)  # as training saves
            beside = {"meta.json": json.dumps({"step": 1, "world_size": 2, "model": path}),
                      "config.yaml": yaml.safe_dump({"model": {"name_or_path": path}})}
            mgr.save(1, {"app": {"model": get_model_state_dict(model)}}, beside, blocking=True)
            mgr.close()
    finally:
        dist.destroy_process_group()


def test_load_hub_layout_w2_then_export_as_save_pretrained(moe_models, tmp_path):
    """Load at W=2 equals from_pretrained; its W=2 checkpoint exports (two writer processes for Mixtral) to exactly
    the tensors, names and dtypes save_pretrained wrote."""
    from ckpt.hf.export import export_checkpoint

    ckpt_root = str(tmp_path / "ckpts")
    # from the fork server (conftest.start_on_free_port): a fork of a pytest process that has run OpenMP (any earlier
    # test's matmul) can hang in OpenMP
    start_on_free_port(_load_worker, lambda port: (port, moe_models, ckpt_root), nprocs=2)
    for family, path in moe_models.items():
        out = str(tmp_path / f"export-{family}")
        info = export_checkpoint(os.path.join(ckpt_root, family, "step-000001"), out, "auto", max_shard_size="20KB",
                                 jobs=2 if family == "mixtral" else 1)
        src, dst = read_hf_tensors(path), read_hf_tensors(out)
        assert sorted(dst) == sorted(src) and info["tensors"] == len(src), family
        for name, tensor in src.items():
            assert dst[name].dtype == tensor.dtype and torch.equal(dst[name], tensor), f"{family}: {name}"


# ---------------------------------------------------------------- train at W=2, resume at W=1, export

STEPS = ["train.max_steps=4", "ckpt.interval=2", "ckpt.keep_last=0"]


def aux_losses(run_dir) -> dict[int, float]:
    steps, _ = read_metrics(os.path.join(str(run_dir), "metrics.jsonl"))
    return {s: r["aux_loss"] for s, r in steps.items() if "aux_loss" in r}


def _trained(hf_dir: str, ckpt_path: str):
    """The checkpoint's weights in a plain HF model (DCP reads them in place): what the export must equal."""
    import torch.distributed.checkpoint as dcp
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(hf_dir), dtype=torch.float32)
    dcp.load({"app.model." + k: v for k, v in model.state_dict().items()}, checkpoint_id=ckpt_path, no_dist=True)
    return model.eval()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_train_w2_resume_w1_export_like_save_pretrained(moe_models, family, tmp_path):
    from transformers import AutoModelForCausalLM

    from conftest import losses, run_train

    src = moe_models[family]
    first = run_train(tmp_path / "a", 2, [f"model.name_or_path={src}", *STEPS, "export.at_end=true"])
    step2 = str(tmp_path / "a" / "checkpoints" / "step-000002")
    run_train(tmp_path / "b", 0, [f"model.name_or_path={src}", *STEPS, f"ckpt.resume={step2}"])
    a, b = losses(tmp_path / "a"), losses(tmp_path / "b")
    assert sorted(b) == [3, 4] and all(b[s] == pytest.approx(a[s], rel=1e-5) for s in b), (a, b)
    aux_a, aux_b = (aux_losses(tmp_path / run) for run in "ab")  # logged apart from the LM loss, when trained
    said = "router aux loss on: loss = LM loss + 0.05 x aux_loss" if family == "qwen3_moe" else "router aux loss off"
    assert said in first.stdout
    if family == "qwen3_moe":
        assert all(v > 0 for v in aux_a.values()) and all(aux_b[s] == pytest.approx(aux_a[s], rel=1e-5) for s in b)
    else:
        assert aux_a == {} and aux_b == {}, "output_router_logits is false: no aux loss"

    # the export: save_pretrained's names, dtype (the source's: bf16 Mixtral) and values, and the trained logits
    trained = _trained(src, str(tmp_path / "a" / "checkpoints" / "step-000004"))
    dtype = next(iter(read_hf_tensors(src).values())).dtype
    trained.to(dtype).save_pretrained(str(tmp_path / "reference"))
    want, got = read_hf_tensors(str(tmp_path / "reference")), read_hf_tensors(str(tmp_path / "a" / "hf"))
    assert MOE_FAMILIES[family][1] in got and sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
    batch = torch.randint(3, 101, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference = trained(input_ids=batch).logits
        loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "a" / "hf"), dtype=dtype).eval()
        assert torch.equal(loaded(input_ids=batch).logits, reference)


# ---------------------------------------------------------------- the router's aux loss in train_step

def _aux_worker(rank: int, port: int, root: str, results: dict) -> None:
    """train_step with SGD(lr=1), no clipping, one micro batch at W=1: the parameters move by exactly the gradient
    of the optimized loss, compared with transformers' own `loss` (LM mean + coef x aux_loss) of the same batch."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM

    from ckpt.hf.load import load_hf_weights
    from finetune.config import Config
    from finetune.model import build_sharded_model
    from train_fsdp import train_step

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=1)
    try:
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(6, 101, (2, 12), generator=gen)
        labels = ids.clone()
        labels[:, :3] = -100
        for asks in (True, False):
            path = save_tiny_moe(os.path.join(root, str(asks)), "mixtral", output_router_logits=asks,
                                 router_aux_loss_coef=0.5)
            cfg = Config()
            cfg.model.name_or_path = path
            model = build_sharded_model(cfg.model, init_device_mesh("cpu", (1,)), torch.device("cpu"))
            load_hf_weights(model, path)
            before = {n: p.full_tensor().clone() for n, p in model.named_parameters()}
            done = train_step(model, torch.optim.SGD(model.parameters(), lr=1.0), [(ids, labels, None)],
                              torch.device("cpu"), 1, 0.0)
            ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
            out = ref(input_ids=ids, labels=labels)
            out.loss.backward()
            grads = {n: p.grad for n, p in ref.named_parameters()}
            moved = max((before[n] - p.full_tensor() - grads[n]).abs().max().item()
                        for n, p in model.named_parameters())
            results[asks] = {"done": tuple(done), "hf_loss": out.loss.item(),
                             "hf_aux": None if out.aux_loss is None else out.aux_loss.item(), "moved_minus_grad": moved}
    finally:
        dist.destroy_process_group()


def test_router_aux_loss_is_trained_when_the_config_asks(tmp_path):
    import torch.multiprocessing as mp

    results = mp.Manager().dict()
    start_on_free_port(_aux_worker, lambda port: (port, str(tmp_path), results), nprocs=1)  # as above
    on, off = results[True], results[False]
    loss, _, _, aux = on["done"]
    assert aux > 0 and aux == pytest.approx(on["hf_aux"], rel=1e-5)
    assert loss + 0.5 * aux == pytest.approx(on["hf_loss"], rel=1e-5)  # logged LM loss; optimized lm + coef x aux
    assert on["moved_minus_grad"] < 1e-5, "the update is not the gradient of lm + coef x aux"
    loss, _, _, aux = off["done"]
    assert aux is None and off["hf_aux"] is None and loss == pytest.approx(off["hf_loss"], rel=1e-5)
    assert off["moved_minus_grad"] < 1e-5


# ---------------------------------------------------------------- the planner's MoE widths

@pytest.mark.parametrize("family, width", [("mixtral", 2 * 48), ("qwen3_moe", 2 * 24), ("qwen2_moe", 2 * 24 + 40)])
def test_plan_uses_top_k_expert_width_and_says_every_expert_is_gathered(tmp_path, capsys, family, width):
    """Activations scale with top-k x the expert width (+ a shared expert: Qwen2-MoE), not the dense width."""
    import train_fsdp
    from finetune.config import load_config
    from finetune.plan import model_shapes
    from tiny_moe import tiny_moe_config

    if family == "qwen2_moe":
        from transformers import Qwen2MoeConfig

        config = Qwen2MoeConfig(vocab_size=101, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                num_key_value_heads=2, intermediate_size=64, moe_intermediate_size=24, num_experts=4,
                                num_experts_per_tok=2, shared_expert_intermediate_size=40)
    else:
        config = tiny_moe_config(family)
    config.save_pretrained(str(tmp_path))
    s = model_shapes(load_config(None, [f"model.config_path={tmp_path}"]).model)
    assert (s.intermediate, s.experts, s.experts_per_token) == (width, 4, 2)
    assert train_fsdp.main(["--config", "configs/tiny.yaml", f"model.config_path={tmp_path}", "--plan"]) == 0
    assert "every expert of a block is gathered on every rank (no expert parallelism)" in capsys.readouterr().out


# ---------------------------------------------------------------- LoRA on a MoE model

def test_lora_on_moe_experts_is_refused_and_attention_lora_says_experts_stay_frozen(moe_models):
    """peft 0.21 turns all-linear on a transformers 5 MoE into target_parameters on the fused experts and the router:
    refused in one line that says what to target instead; attention LoRA trains, the experts frozen, said in one
    line."""
    from finetune.config import Config
    from finetune.lora import add_adapters, unadapted_experts
    from finetune.model import causal_lm_from_config
    from finetune.shards import ModelError

    def meta_model(targets: str):
        cfg = Config()
        cfg.model.name_or_path, cfg.model.lora.r, cfg.model.lora.target_modules = moe_models["qwen3_moe"], 4, targets
        with torch.device("meta"):
            model = causal_lm_from_config(cfg.model)
        assert unadapted_experts(model) is None  # before LoRA: nothing frozen, nothing to say
        add_adapters(model, cfg.model.lora, moe_models["qwen3_moe"], torch.float32)
        return model

    with pytest.raises(ModelError, match=r"all-linear.*adapts the MoE experts' fused 3-D weights and routers "
                                         r"\('model.layers.0.mlp.experts'.*target_modules=q_proj,k_proj,v_proj,o_proj"):
        meta_model("all-linear")
    model = meta_model("q_proj,k_proj,v_proj,o_proj")
    adapted = {n.split(".lora_A.")[0] for n, _ in model.named_parameters() if ".lora_A." in n}
    assert "model.layers.0.self_attn.q_proj" in adapted and not any("mlp" in n for n in adapted)
    assert not model.model.layers[0].mlp.experts.gate_up_proj.requires_grad
    line = unadapted_experts(model)
    assert line.startswith("LoRA: the 4 fused 3-D expert weights (model.layers.0.mlp.experts.gate_up_proj, ...)")
    assert "target_parameters" in line and "\n" not in line


def test_a_folder_that_does_not_fit_is_refused_in_one_line(moe_models):
    """An expert's tensor missing, or one expert too many: one line naming the folder, the class and the tensor."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from ckpt import CheckpointError
    from ckpt.hf.load import check_hf_keys
    from ckpt.reading import safetensors_headers

    path = moe_models["mixtral"]
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    headers = safetensors_headers(path)
    check_hf_keys(model, model.state_dict(), headers, path)  # fits as saved
    missing = {k: v for k, v in headers.items() if k != "model.layers.1.block_sparse_moe.experts.3.w1.weight"}
    with pytest.raises(CheckpointError, match=r"does not fit MixtralForCausalLM: the tensors of the files that make "
                                              r".*'model.layers.1.mlp.experts.gate_up_proj' do not fit together"):
        check_hf_keys(model, model.state_dict(), missing, path)
    extra = {**headers, "model.layers.0.block_sparse_moe.experts.4.w2.weight":
             headers["model.layers.0.block_sparse_moe.experts.0.w2.weight"]}
    with pytest.raises(CheckpointError, match=r"does not fit MixtralForCausalLM: 'model.layers.0.mlp.experts.down_proj'"
                                              r" is \[5, 32, 48\] in the files .* but \[4, 32, 48\] in the model"):
        check_hf_keys(model, model.state_dict(), extra, path)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_attention_lora_on_a_hub_layout_moe_trains_and_merges_to_the_same_layout(moe_models, tmp_path):
    """LoRA on q/v of a Qwen3-MoE saved by save_pretrained: the base loads, and the merged export has the base's
    names (per expert), its experts unchanged, the adapted weights changed, and loads with from_pretrained."""
    from transformers import AutoModelForCausalLM

    from ckpt.hf.export import export_checkpoint
    from conftest import run_train

    base = moe_models["qwen3_moe"]
    proc = run_train(tmp_path / "run", 0, [f"model.name_or_path={base}", "model.lora.r=4", "model.lora.dropout=0",
                                           "model.lora.target_modules=q_proj,v_proj", "train.max_steps=2"])
    assert "fused 3-D expert weights (model.layers.0.mlp.experts.gate_up_proj, ...) are not adapted" in proc.stdout
    info = export_checkpoint(str(tmp_path / "run" / "checkpoints" / "step-000002"), str(tmp_path / "merged"))
    src, out = read_hf_tensors(base), read_hf_tensors(str(tmp_path / "merged"))
    assert sorted(out) == sorted(src) and info["tensors"] == len(src)
    changed = sorted(k for k in src if not torch.equal(src[k], out[k]))
    assert changed == [f"model.layers.{i}.self_attn.{m}_proj.weight" for i in (0, 1) for m in "qv"]
    AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"))

"""LoRA with FSDP2: adapter-only checkpoints that resume exactly, at any world size, and export for peft.

    python -m pytest tests/test_lora.py -q

The base is the HF export of a short tiny full run (W=1). LoRA runs use r=8 on every attention and MLP
projection at W=2 (gloo, CPU): dropout on for the kill/resume runs (so the restored per-rank RNG matters),
off for the world-size changes (there each rank's RNG is re-derived, see the README's RNG rule).
"""

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint import FileSystemReader

from ckpt import verify_checkpoint
from ckpt.__main__ import main as ckpt_cli
from conftest import FAST, ROOT, events, kill_after_commit, losses, run_train, token_cache
from finetune.config import load_config
from finetune.data import cache_path, open_samples
from finetune.metrics import read_metrics
from finetune.model import load_tokenizer

LORA = ["model.lora.r=8", "model.lora.alpha=16", "train.lr=1e-2"]
KILL_RUN = [*LORA, "model.lora.dropout=0.1", "train.max_steps=12", "ckpt.interval=6", "ckpt.keep_last=0"]
WS_RUN = [*LORA, "train.max_steps=16", "ckpt.interval=8", "ckpt.keep_last=0"]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """base/hf: a tiny full run's export; other/: the same architecture with other weights."""
    root = tmp_path_factory.mktemp("lora")
    # 200 steps: past the loss plateau of the reversal task, so a few adapter steps show measurable learning
    run_train(root / "base", 0, ["train.max_steps=200", "data.micro_batch_size=12", "export.at_end=true",
                                 "ckpt.interval=0"])
    other = root / "other"
    os.makedirs(other)
    for name in os.listdir(root / "base" / "hf"):
        src = root / "base" / "hf" / name
        if name.endswith(".safetensors"):
            save_file({k: v + 0.01 for k, v in load_file(str(src)).items()}, str(other / name), metadata={"format": "pt"})
        else:
            (other / name).write_bytes(src.read_bytes())
    return root


def base_of(root) -> str:
    return str(root / "base" / "hf")


@pytest.fixture(scope="module")
def straight(root):
    """W=2 with dropout, 12 steps, checkpoints at 6 and 12: the reference every kill/resume must match."""
    run = root / "straight"
    run_train(run, 2, [f"model.name_or_path={base_of(root)}", *KILL_RUN, "ckpt.async_mode=off"])
    return run


def flat_items(ckpt_path) -> dict:
    """Every tensor and bytes item of a checkpoint, loaded in this process."""
    from ckpt.reading import read_items

    return read_items(str(ckpt_path), list(FileSystemReader(str(ckpt_path)).read_metadata().state_dict_metadata))


# ---------------------------------------------------------------- training and checkpoint contents

def batch_loss(logits: torch.Tensor, labels: torch.Tensor) -> float:
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), labels[:, 1:].reshape(-1),
                                             ignore_index=-100).item()


def test_lora_learns_and_saves_only_adapters(root, straight, capsys):
    """The adapters lower the loss on the samples they trained on; the checkpoint holds nothing else."""
    from transformers import AutoModelForCausalLM

    records = read_metrics(str(straight / "metrics.jsonl"))[0]
    assert sorted(records) == list(range(1, 13))
    rows = [i for s in range(1, 13) for i in records[s]["sample_ids"]]
    cfg = load_config(os.path.join(ROOT, "configs", "tiny.yaml"),
                      [*FAST, f"model.name_or_path={base_of(root)}", f"data.cache_dir={token_cache()}"])
    cache = cache_path(cfg.data, load_tokenizer(cfg.model))  # the training set's cache, not the eval set's
    ids, labels, _ = open_samples(cache, cfg.data).batch(rows)  # the rows train_fsdp.py trained on
    with torch.no_grad():
        before = batch_loss(AutoModelForCausalLM.from_pretrained(base_of(root)).eval()(input_ids=ids).logits, labels)
    after = batch_loss(trained_logits(base_of(root), straight / "checkpoints" / "step-000012", ids), labels)
    assert after < before - 0.03, (before, after)  # measured: 2.21 -> 2.13 without dropout

    ckpt = straight / "checkpoints" / "step-000012"
    keys = list(FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata)
    model_keys = [k for k in keys if k.startswith("app.model.")]
    assert model_keys and all(".lora_A." in k or ".lora_B." in k for k in model_keys), model_keys[:5]
    assert len(model_keys) == 2 * 2 * 7  # A and B for q,k,v,o,gate,up,down in each of the 2 blocks
    assert not any("embed_tokens" in k or "base_layer" in k or "norm" in k for k in keys)
    meta = json.loads((ckpt / "meta.json").read_text())
    assert meta["lora"]["r"] == 8 and meta["lora"]["base"] == base_of(root)
    assert meta["lora"]["base_fingerprint"].startswith("sha256:")
    full = root / "base" / "checkpoints" / "step-000200"
    size = lambda d: sum(f.stat().st_size for f in d.iterdir() if f.suffix == ".distcp")  # noqa: E731
    assert size(ckpt) < size(full) / 2, (size(ckpt), size(full))

    capsys.readouterr()
    assert ckpt_cli(["inspect", str(ckpt)]) == 0  # python -m ckpt inspect
    out = capsys.readouterr().out
    assert "LoRA checkpoint: adapters r=8" in out and "% of a full fine-tuning checkpoint" in out, out


@pytest.mark.parametrize("mode", ["off", "thread", "process"])
def test_kill_and_resume_is_bit_identical(root, straight, tmp_path, mode):
    run, overrides = tmp_path / "b", [f"model.name_or_path={base_of(root)}", *KILL_RUN, f"ckpt.async_mode={mode}"]
    killed = run_train(run, 2, overrides, env={"CKPT_FAULT": kill_after_commit(run, 6, 8)}, check=False)
    assert killed.returncode != 0 and max(losses(run)) == 8
    run_train(run, 2, overrides)
    assert [e["step"] for e in events(run, "resume")] == [6]
    a, b = losses(straight), losses(run)
    assert sorted(b) == list(range(1, 13))
    assert all(a[k] == b[k] for k in a), {k: (a[k], b[k]) for k in a if a[k] != b[k]}  # bit for bit, dropout on
    final_a = flat_items(straight / "checkpoints" / "step-000012")
    final_b = flat_items(run / "checkpoints" / "step-000012")
    assert final_a.keys() == final_b.keys() and any(k.startswith("app.optim.state") for k in final_a)
    for k, v in final_a.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(v, final_b[k]), f"{k} differs after resume"
    verify_checkpoint(str(run / "checkpoints" / "step-000012"))


@pytest.mark.parametrize("world_size", [1, 3])
def test_resume_at_another_world_size(root, world_size):
    """A (W=2, dropout off) to 16; its step-8 checkpoint resumed at W'=1 and W'=3 continues A's samples and losses."""
    a_run = root / "ws_a"
    if not (a_run / "checkpoints" / "step-000016").exists():
        run_train(a_run, 2, [f"model.name_or_path={base_of(root)}", *WS_RUN])
    run = root / f"ws_{world_size}"
    run_train(run, 0 if world_size == 1 else world_size,
              [f"model.name_or_path={base_of(root)}", *WS_RUN, f"ckpt.resume={a_run}/checkpoints/step-000008"])
    a, r = read_metrics(str(a_run / "metrics.jsonl"))[0], read_metrics(str(run / "metrics.jsonl"))[0]
    assert sorted(r) == list(range(9, 17))
    for s in range(9, 17):
        assert r[s]["world_size"] == world_size and r[s]["sample_ids"] == a[s]["sample_ids"], s
        assert r[s]["loss"] == pytest.approx(a[s]["loss"], rel=1e-4), s


# ---------------------------------------------------------------- a checkpoint belongs to its base

def test_resume_on_another_base_is_refused(root, straight, tmp_path):
    ckpt = straight / "checkpoints" / "step-000006"
    proc = run_train(tmp_path / "r", 0, [f"model.name_or_path={root / 'other'}", *KILL_RUN, f"ckpt.resume={ckpt}"],
                     check=False)  # plain python: torchrun would report the worker's exit 2 as its own 1
    assert proc.returncode == 2, proc.stderr[-2000:]
    line = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
    assert len(line) == 1 and base_of(root) in line[0] and str(root / "other") in line[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    verify_checkpoint(str(ckpt))  # the committed checkpoint is untouched


def test_resume_on_a_moved_copy_of_the_base_continues(root, straight, tmp_path):
    """The base copied to another path (the run continued on another machine): the same content, so the resume
    goes on and the path change is logged as applied (meta.json's model_content), not refused."""
    moved = tmp_path / "moved-base"
    shutil.copytree(base_of(root), moved)
    ckpt = straight / "checkpoints" / "step-000006"
    proc = run_train(tmp_path / "r", 0, [f"model.name_or_path={moved}", *KILL_RUN, f"ckpt.resume={ckpt}",
                                         "train.max_steps=7"], check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"model.name_or_path: '{base_of(root)}' -> '{moved}' (applied: the same files at another path" in proc.stdout
    assert max(losses(tmp_path / "r")) == 7


def test_check_same_base_rules(tmp_path):
    from ckpt import CheckpointError
    from ckpt.lora_base import check_same_base

    lora = {"r": 8, "base": "/m/a", "base_fingerprint": "sha256:aa"}
    (tmp_path / "meta.json").write_text(json.dumps({"step": 1, "lora": lora}))
    check_same_base(str(tmp_path), dict(lora))
    with pytest.raises(CheckpointError, match=r"/m/a \(sha256:aa\).*/m/b \(sha256:bb\)"):
        check_same_base(str(tmp_path), {**lora, "base": "/m/b", "base_fingerprint": "sha256:bb"})
    with pytest.raises(CheckpointError, match="but this run does full fine-tuning"):
        check_same_base(str(tmp_path), None)
    (tmp_path / "meta.json").write_text(json.dumps({"step": 1}))
    with pytest.raises(CheckpointError, match="is a full fine-tuning checkpoint"):
        check_same_base(str(tmp_path), lora)


def test_fingerprint_sees_weights_not_sharding(root, tmp_path):
    from transformers import AutoModelForCausalLM

    from ckpt.lora_base import base_fingerprint

    a, other = base_fingerprint(base_of(root)), base_fingerprint(str(root / "other"))
    assert a["fingerprint"] != other["fingerprint"] and a["params"] == other["params"]
    resharded = tmp_path / "resharded"  # the same weights saved in several files: the same base
    AutoModelForCausalLM.from_pretrained(base_of(root)).save_pretrained(str(resharded), max_shard_size="100KB")
    assert len(list(resharded.glob("*.safetensors"))) > 1
    assert base_fingerprint(str(resharded))["fingerprint"] == a["fingerprint"]


def test_adapters_on_meta_freeze_the_base_in_the_compute_dtype(tmp_path):
    """peft layers on every projection, only they train, the frozen base in bf16 (ties kept), all on meta."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    from finetune.config import LoRAConfig
    from finetune.lora import add_adapters, base_file_name

    config = Qwen2Config(vocab_size=101, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    add_adapters(model, LoRAConfig(r=4), str(tmp_path), base_dtype=torch.bfloat16)
    params = dict(model.named_parameters())
    trainable = {n for n, p in params.items() if p.requires_grad}
    assert trainable and all(".lora_A.default." in n or ".lora_B.default." in n for n in trainable)
    assert {n.split(".")[-4] for n in trainable} == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                     "down_proj"}
    assert all(p.dtype == (torch.float32 if n in trainable else torch.bfloat16) for n, p in params.items())
    assert model.lm_head.weight is model.model.embed_tokens.weight, "tie lost"
    assert base_file_name("model.layers.0.mlp.up_proj.base_layer.weight") == "model.layers.0.mlp.up_proj.weight"
    assert base_file_name("model.layers.0.mlp.up_proj.lora_A.default.weight") is None


def test_qlora_is_refused_clearly(tmp_path):
    from finetune.config import ConfigError, load_config
    from finetune.lora import check_not_quantized
    from finetune.model import ModelError

    with pytest.raises(ConfigError, match="QLoRA .* not supported"):
        load_config(None, ["model.name_or_path=x", "model.lora.r=8", "model.lora.quantize=4bit"])
    with pytest.raises(ConfigError, match="model.lora.r=8.*needs model.name_or_path"):
        load_config(None, ["model.lora.r=8"])
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "bitsandbytes"}}))
    with pytest.raises(ModelError, match=r"quantized model \(bitsandbytes\).*QLoRA.*not supported"):
        check_not_quantized(str(tmp_path))
    y = tmp_path / "c.yaml"
    y.write_text("model:\n  name_or_path: m\n  lora:\n    r: 4\n    target_modules: q_proj,v_proj\n")
    cfg = load_config(str(y), ["model.lora.alpha=8"])
    assert (cfg.model.lora.r, cfg.model.lora.alpha, cfg.model.lora.target_modules) == (4, 8.0, "q_proj,v_proj")
    with pytest.raises(ConfigError, match="model.lora.rank"):
        load_config(None, ["model.lora.rank=4"])


# ---------------------------------------------------------------- exports: PEFT adapter and merged model

def trained_logits(base: str, ckpt, batch: torch.Tensor) -> torch.Tensor:
    """The trained model, rebuilt by hand: HF base + peft's LoRA layers + the adapter tensors of the checkpoint."""
    import torch.distributed.checkpoint as dcp
    from peft import LoraConfig, inject_adapter_in_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    inject_adapter_in_model(LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"), model)
    state = {"app.model." + k: v for k, v in model.state_dict().items() if ".lora_" in k}
    dcp.load(state, checkpoint_id=str(ckpt), no_dist=True)  # in place: the state dict aliases the params
    with torch.no_grad():
        return model.eval()(input_ids=batch).logits


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_adapter_and_merged_exports(root, straight, tmp_path, capsys):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    ckpt, base = straight / "checkpoints" / "step-000012", base_of(root)
    batch = torch.randint(3, 101, (3, 20), generator=torch.Generator().manual_seed(0))
    want = trained_logits(base, ckpt, batch)

    adapter = tmp_path / "adapter"  # python -m ckpt export ... --adapter, its main() called here
    capsys.readouterr()
    code, printed = ckpt_cli(["export", str(ckpt), str(adapter), "--adapter"]), capsys.readouterr()
    assert code == 0 and printed.out.startswith("OK:"), printed
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), str(adapter))
    with torch.no_grad():
        got = peft_model.eval()(input_ids=batch).logits
    assert torch.equal(got, want)
    assert not torch.equal(got, AutoModelForCausalLM.from_pretrained(base).eval()(input_ids=batch).logits.detach())

    # --adapter of a full checkpoint: one error line
    full = root / "base" / "checkpoints" / "step-000200"
    capsys.readouterr()
    code, printed = ckpt_cli(["export", str(full), str(tmp_path / "x"), "--adapter"]), capsys.readouterr()
    assert code == 2 and printed.err.startswith("error:") and "full fine-tuning checkpoint" in printed.err, printed

    merged = tmp_path / "merged"
    capsys.readouterr()
    code, printed = ckpt_cli(["export", str(ckpt), str(merged)]), capsys.readouterr()
    assert code == 0 and "merged" in printed.out, printed
    merged_model = AutoModelForCausalLM.from_pretrained(str(merged)).eval()
    assert not any(".lora_" in k or "base_layer" in k for k in merged_model.state_dict())
    with torch.no_grad():
        got = merged_model(input_ids=batch).logits
    diff = (got - want).abs().max().item()
    print(f"merged export: max |logits - trained logits| = {diff:.3g}")  # docs/lora.md quotes it
    assert diff <= 1e-5, diff  # docs/lora.md: "within 1e-5", absolute, no relative slack
    # the merged weights are peft's own merge_and_unload of the same adapter
    reference = peft_model.merge_and_unload().state_dict()
    for k, v in load_file(str(merged / "model.safetensors")).items():
        assert torch.allclose(v, reference[k], rtol=0, atol=1e-6), k
    assert_merged_is_peft_merge(base, adapter, merged, batch)


def assert_merged_is_peft_merge(base: str, adapter, merged, batch: torch.Tensor) -> None:
    """from_pretrained(merged export) gives the logits of PeftModel.from_pretrained(base, adapter).merge_and_unload(),
    within fp32 rounding, and they are not the base's (the adapters changed something)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    reference = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                                          str(adapter)).merge_and_unload().eval()
    with torch.no_grad():
        want = reference(input_ids=batch).logits
        got = AutoModelForCausalLM.from_pretrained(str(merged)).eval()(input_ids=batch).logits
        plain = AutoModelForCausalLM.from_pretrained(base).eval()(input_ids=batch).logits
    diff, moved = (got - want).abs().max().item(), (plain - want).abs().max().item()
    print(f"merged export vs peft merge_and_unload: max |logits diff| = {diff:.3g} (the base is {moved:.3g} away)")
    assert diff <= 1e-5, diff  # fp32 rounding
    assert moved > 1e-3, moved  # else a merge that skipped the adapters would pass


def random_base(folder, config) -> str:
    """A base model folder: `config` with random weights (seed 0) and the tiny tokenizer."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(str(folder))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(os.path.join(ROOT, "assets", "tiny-llama", name), folder)
    return str(folder)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.filterwarnings("ignore:fan_in_fan_out is set to False")
def test_merged_export_of_a_gpt2_model_is_peft_merge(tmp_path, capsys):
    """GPT-2's projections are transformers' Conv1D, weight stored (in, out): peft merges their delta transposed
    (fan_in_fan_out), and so must the export, for c_attn (64 -> 192, a crash before) and the square c_proj alike."""
    from transformers import GPT2Config

    base = random_base(tmp_path / "gpt2", GPT2Config(vocab_size=101, n_embd=64, n_layer=2, n_head=4, n_positions=128,
                                                      bos_token_id=1, eos_token_id=2, pad_token_id=0))
    run_train(tmp_path / "run", 0, [f"model.name_or_path={base}", "model.config_path=", *LORA, "train.max_steps=4",
                                    "ckpt.interval=4"])
    ckpt = tmp_path / "run" / "checkpoints" / "step-000004"
    for out, flags in ((tmp_path / "adapter", ["--adapter"]), (tmp_path / "merged", [])):
        capsys.readouterr()
        code, printed = ckpt_cli(["export", str(ckpt), str(out), *flags]), capsys.readouterr()
        assert code == 0 and printed.out.startswith("OK:"), printed
    batch = torch.randint(3, 101, (3, 20), generator=torch.Generator().manual_seed(0))
    assert_merged_is_peft_merge(base, tmp_path / "adapter", tmp_path / "merged", batch)


def test_a_layer_the_merge_has_no_rule_for_is_refused_by_name(tmp_path):
    """peft can put LoRA on an Embedding (delta (B @ A).T, other tensor names), which neither the weight import
    nor the merged export handle: training refuses it in one line naming the layer, and so would the export."""
    from transformers import AutoConfig

    from ckpt import CheckpointError
    from ckpt.hf.adapter import merge_rules
    from ckpt.reading import meta_model

    config = AutoConfig.from_pretrained(os.path.join(ROOT, "assets", "tiny-llama"))
    base = random_base(tmp_path / "llama", config)
    proc = run_train(tmp_path / "r", 0, [f"model.name_or_path={base}", *LORA,
                                         "model.lora.target_modules=embed_tokens,q_proj"], check=False)
    err = [x for x in proc.stderr.splitlines() if x.strip()]
    assert proc.returncode == 2 and len(err) == 1, proc.stderr[-2000:]
    assert err[0].startswith("error: ") and "'model.embed_tokens (Embedding)' is not supported" in err[0], err
    adapters = {"model.embed_tokens": (torch.zeros(8, 101), torch.zeros(64, 8)),
                "model.layers.0.self_attn.q_proj": (torch.zeros(8, 64), torch.zeros(64, 8))}
    with pytest.raises(CheckpointError, match=r"cannot merge LoRA into 'model\.embed_tokens \(Embedding\)': .*--adapt"):
        merge_rules("ckpt", meta_model(config), adapters)

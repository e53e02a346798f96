"""Hugging Face weights in and out: tiny Llama / Qwen2 / Mistral models built from configs (nothing downloaded).

    python -m pytest tests/test_hf.py -x -q

- import at W=2 (two gloo processes, FSDP2 on CPU): gathered params equal the HF files bit for bit;
- round trip: import -> checkpoint at W=2 -> export in one process gives the input tensors back exactly;
- train_fsdp.py at W=2 from HF weights: step-0 loss equals from_pretrained's; export.at_end and
  `python -m ckpt export` folders load with from_pretrained and give the trained model's logits.
"""

from __future__ import annotations

import glob
import json
import os
import shutil

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import yaml
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from conftest import FAST, ROOT, read_hf_tensors, start_on_free_port, run_train, token_cache
from finetune.config import load_config
from finetune.data import cache_path, open_samples
from finetune.metrics import read_metrics
from finetune.model import load_tokenizer

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
# family -> (dtype of the saved files, max shard size): bf16 files test the dtype conversion both ways,
# Qwen2 ties its embeddings, Mistral is one unsharded file.
FAMILIES = {"llama": (torch.bfloat16, "100KB"), "qwen2": (torch.float32, "60KB"), "mistral": (torch.float32, "5GB")}


def tiny_config(family: str):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    common = dict(vocab_size=101, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if family == "llama":
        return LlamaConfig(**common)
    if family == "qwen2":
        return Qwen2Config(**common, tie_word_embeddings=True)
    return MistralConfig(**common)


def save_tiny_hf(path: str, family: str) -> str:
    """A randomly initialised tiny model saved with save_pretrained, plus the repo's tiny tokenizer."""
    from transformers import AutoModelForCausalLM

    dtype, shard = FAMILIES[family]
    torch.manual_seed(len(family))
    model = AutoModelForCausalLM.from_config(tiny_config(family))
    with torch.no_grad():
        for p in model.parameters():  # norms and biases too, so a skipped or swapped tensor shows
            p.normal_(0.0, 0.1)
    model.to(dtype).save_pretrained(path, max_shard_size=shard)
    for name in TOKENIZER_FILES:
        shutil.copy(os.path.join(ROOT, "assets", "tiny-llama", name), path)
    return path


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    models = {family: save_tiny_hf(str(root / family), family) for family in FAMILIES}
    # a Mistral folder with one tensor removed: loading it must fail, naming the class and the tensor
    broken = root / "broken"
    shutil.copytree(models["mistral"], broken)
    tensors = load_file(str(broken / "model.safetensors"))
    del tensors["model.norm.weight"]
    save_file(tensors, str(broken / "model.safetensors"), metadata={"format": "pt"})
    models["broken"] = str(broken)
    return models


# ---------------------------------------------------------------- pure logic, no process group

@pytest.mark.parametrize("seed", range(20))
def test_chunk_runs_cover_exactly_the_chunk(seed):
    """Any saved chunk (FSDP dim-0 shards, or split on later dims) lands on exactly its own elements."""
    from ckpt.hf.export import chunk_runs

    gen = np.random.default_rng(seed)
    shape = tuple(int(d) for d in gen.integers(1, 6, size=gen.integers(1, 4)))
    offsets = [int(gen.integers(0, d)) for d in shape]
    sizes = [int(gen.integers(1, d - o + 1)) for d, o in zip(shape, offsets)]
    full = np.arange(int(np.prod(shape))).reshape(shape)
    chunk = full[tuple(slice(o, o + n) for o, n in zip(offsets, sizes))].reshape(-1)
    starts, run = chunk_runs(offsets, sizes, shape)
    placed = np.concatenate([full.reshape(-1)[st:st + run] for st in starts])
    assert np.array_equal(placed, chunk)


def test_parse_size_and_stray_files(hf_models, tmp_path):
    from ckpt import CheckpointError
    from ckpt.hf.files import parse_size
    from ckpt.reading import check_safetensors_files

    assert parse_size("2GB") == 2 * 10**9 and parse_size("100KiB") == 102400 and parse_size("512") == 512
    with pytest.raises(ValueError, match="2GB"):
        parse_size("two gigs")
    stray = tmp_path / "stray"
    shutil.copytree(hf_models["llama"], stray)
    shutil.copy(os.path.join(hf_models["mistral"], "model.safetensors"), stray)
    with pytest.raises(CheckpointError, match="index.json lists"):
        check_safetensors_files(str(stray))


# ---------------------------------------------------------------- import at W=2, bit for bit, and round trip

def _import_worker(rank: int, port: int, models: dict, ckpt_root: str) -> None:
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM

    from ckpt import CheckpointError, CheckpointManager
    from ckpt.hf.load import load_hf_weights
    from finetune.config import Config
    from finetune.model import build_sharded_model

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        for family in FAMILIES:
            cfg = Config()
            cfg.model.name_or_path = models[family]
            model = build_sharded_model(cfg.model, mesh, torch.device("cpu"))
            load_hf_weights(model, models[family])
            files = read_hf_tensors(models[family])
            for name, param in model.named_parameters():
                full = param.full_tensor()
                assert full.dtype == torch.float32, name  # fp32 masters, whatever the files hold
                assert torch.equal(full, files[name].float()), f"{family}: {name} differs from the HF file"
            if family == "qwen2":
                assert model.lm_head.weight is model.model.embed_tokens.weight, "tie lost"
                assert "lm_head.weight" not in files
            reference = AutoModelForCausalLM.from_config(model.config)  # rotary buffers as HF computes them
            assert torch.equal(model.model.rotary_emb.inv_freq, reference.model.rotary_emb.inv_freq)
            # save at W=2 exactly as training does, for the single-process export in the parent
            mgr = CheckpointManager(os.path.join(ckpt_root, family), "off", keep_last=0)
            beside = {"meta.json": json.dumps({"step": 1, "world_size": 2, "model": models[family]}),
                     "config.yaml": yaml.safe_dump({"model": {"name_or_path": models[family]}})}
            mgr.save(1, {"app": {"model": get_model_state_dict(model)}}, beside, blocking=True)
            mgr.close()
        cfg = Config()
        cfg.model.name_or_path = models["broken"]
        model = build_sharded_model(cfg.model, mesh, torch.device("cpu"))
        with pytest.raises(CheckpointError, match=r"MistralForCausalLM.*missing 'model.norm.weight'"):
            load_hf_weights(model, models["broken"])
    finally:
        dist.destroy_process_group()


def test_import_w2_bit_exact_then_export_round_trip(hf_models, tmp_path):
    from ckpt.hf.export import export_checkpoint

    ckpt_root = str(tmp_path / "ckpts")
    start_on_free_port(_import_worker, lambda port: (port, hf_models, ckpt_root), nprocs=2, start_method="fork")
    for family, (dtype, shard) in FAMILIES.items():
        out = str(tmp_path / f"export-{family}")
        # dtype auto: the source's torch_dtype (bf16 llama, fp32 others); two writer processes for llama
        info = export_checkpoint(os.path.join(ckpt_root, family, "step-000001"), out, "auto", max_shard_size=shard,
                                 jobs=2 if family == "llama" else 1)
        assert info["dtype"] == {torch.bfloat16: "bf16", torch.float32: "fp32"}[dtype]
        src, dst = read_hf_tensors(hf_models[family]), read_hf_tensors(out)
        assert sorted(dst) == sorted(src), family
        for name, tensor in src.items():
            assert dst[name].dtype == tensor.dtype and torch.equal(dst[name], tensor), f"{family}: {name}"
        n_in = len(glob.glob(os.path.join(hf_models[family], "*.safetensors")))
        assert info["files"] == n_in, f"{family}: {info['files']} files written, the input had {n_in}"
        assert os.path.isfile(os.path.join(out, "model.safetensors.index.json")) == (n_in > 1)


# ---------------------------------------------------------------- train from HF weights, export, load back

def _batch_loss(model, input_ids: np.ndarray, labels: np.ndarray) -> float:
    """train_fsdp.train_step's loss: summed token cross entropy over non-ignored labels / their count."""
    ids, lab = torch.from_numpy(input_ids.astype(np.int64)), torch.from_numpy(labels.astype(np.int64))
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()
    tok = F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), lab[:, 1:].reshape(-1), ignore_index=-100,
                          reduction="sum")
    return tok.item() / int((lab[:, 1:] != -100).sum())


def _trained_model(hf_dir: str, ckpt_path: str):
    """The trained weights as plain DCP reads them from the checkpoint: the reference for the export."""
    import torch.distributed.checkpoint as dcp
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(hf_dir), dtype=torch.float32)
    state = {"app.model." + k: v for k, v in model.state_dict().items()}
    dcp.load(state, checkpoint_id=ckpt_path, no_dist=True)  # in place: the state dict aliases the params
    return model.eval()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_train_from_hf_then_export(hf_models, tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ckpt.__main__ import main as ckpt_cli
    from ckpt.hf.export import export_cli

    llama, run = hf_models["llama"], tmp_path / "run"
    run_train(run, 2, [f"model.name_or_path={llama}", "train.max_steps=2", "export.at_end=true", "export.dtype=fp32"])

    # step-0 loss (the step-1 record, computed before the update) == from_pretrained's on the same rows
    steps, _ = read_metrics(str(run / "metrics.jsonl"))
    cfg = load_config(os.path.join(ROOT, "configs", "tiny.yaml"),
                      [*FAST, f"model.name_or_path={llama}", f"data.cache_dir={token_cache()}"])
    samples = open_samples(cache_path(cfg.data, load_tokenizer(cfg.model)), cfg.data)  # the run's token cache
    input_ids, labels, _ = samples.batch(steps[1]["sample_ids"])
    hf_model = AutoModelForCausalLM.from_pretrained(llama, dtype=torch.float32).eval()
    assert steps[1]["loss"] == pytest.approx(_batch_loss(hf_model, input_ids.numpy(), labels.numpy()), rel=1e-5)

    # export.at_end: fp32 logits exactly the trained model's
    ckpt = str(run / "checkpoints" / "step-000002")
    batch = samples.batch([0, 1, 2, 3])[0].long()
    with torch.no_grad():
        want = _trained_model(llama, ckpt)(input_ids=batch).logits
        got = AutoModelForCausalLM.from_pretrained(str(run / "hf")).eval()(input_ids=batch).logits
    assert got.dtype == torch.float32 and torch.equal(got, want)
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert os.path.isfile(run / "hf" / name), name
    text = "reverse: hello"
    assert AutoTokenizer.from_pretrained(str(run / "hf"))(text)["input_ids"] == \
        AutoTokenizer.from_pretrained(llama)(text)["input_ids"]

    # the command line (python -m ckpt export: its main() called here), no process group: bf16, sharded with an
    # index, logits within bf16 tolerance
    out = tmp_path / "hf-bf16"
    capsys.readouterr()
    code, printed = ckpt_cli(["export", ckpt, str(out), "--dtype", "bf16", "--max-shard-size", "100KB"]), \
        capsys.readouterr()
    assert code == 0 and printed.out.startswith("OK:"), printed
    parallel = tmp_path / "hf-bf16-jobs3"  # three writer processes: the same bytes in every file
    code, printed = ckpt_cli(["export", ckpt, str(parallel), "--max-shard-size", "100KB", "--jobs", "3"]), \
        capsys.readouterr()
    assert code == 0 and "MiB bf16" in printed.out, printed  # auto: llama's files are bf16
    for f in glob.glob(str(out / "*.safetensors")):
        assert open(f, "rb").read() == open(parallel / os.path.basename(f), "rb").read(), f
    index = json.load(open(out / "model.safetensors.index.json"))
    assert len(set(index["weight_map"].values())) > 1
    with safe_open(str(out / index["weight_map"]["lm_head.weight"]), "pt") as f:
        assert torch.equal(f.get_tensor("lm_head.weight"), _trained_model(llama, ckpt).lm_head.weight.bfloat16())
    with torch.no_grad():
        bf16 = AutoModelForCausalLM.from_pretrained(str(out)).eval()
        assert bf16.dtype == torch.bfloat16
        got = bf16.float()(input_ids=batch).logits
    assert (got - want).abs().max() <= 0.02 * want.abs().max()

    # a non-empty destination is refused with one line, exit status 1
    assert export_cli(ckpt, str(out), "fp32", "2GB") == 2

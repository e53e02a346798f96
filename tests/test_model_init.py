"""Model build on meta -> fully_shard -> to_empty: every buffer set, HF weights give HF's logits, HSDP mesh.

    python -m pytest tests/test_model_init.py -q

- a tiny Gemma3 (embed_scale: a non-persistent buffer in a module that also owns a weight) and a tiny
  Llama (rotary inv_freq) saved with save_pretrained, loaded at W=2 through model.name_or_path: logits
  and loss equal `from_pretrained`'s on the same batch;
- random init of Gemma3 takes HF's zero-centred norms;
- the root keeps its parameters (embedding, final norm, lm_head) gathered after forward, since backward
  needs them at once, while each block reshards (torch's default for the root, torchtitan's choice).
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch
import torch.multiprocessing as mp

from conftest import ROOT, start_on_free_port

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def tiny_config(family: str):
    from transformers import Gemma3TextConfig, LlamaConfig

    common = dict(vocab_size=101, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=128, pad_token_id=0, bos_token_id=1,
                  eos_token_id=2)
    if family == "gemma3":
        return Gemma3TextConfig(**common, sliding_window=8, layer_types=["sliding_attention", "full_attention"])
    return LlamaConfig(**common)


def save_tiny(path: str, family: str) -> str:
    """Random weights from HF's own init (norms perturbed too), the repo's character tokenizer beside them."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(family))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(path)
    for name in TOKENIZER_FILES:
        shutil.copy(os.path.join(ROOT, "assets", "tiny-llama", name), path)
    return path


def _batch():
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(3, 101, (2, 24), generator=gen)
    return ids, ids.clone()


def _loss(logits, labels):
    from finetune.data import IGNORE
    from finetune.loss import next_token_loss_sum
    return float(next_token_loss_sum(logits, labels, IGNORE)) / (labels[:, 1:] != IGNORE).sum().item()


def _gathered(module) -> bool:
    from torch.distributed.fsdp._fully_shard._fsdp_param import ShardedState
    return all(p.sharded_state == ShardedState.UNSHARDED for p in module._get_fsdp_state()._fsdp_param_group.fsdp_params)


def _worker(rank: int, port: int, dirs: dict, results: dict) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM

    from ckpt.hf.load import load_hf_weights
    from finetune.config import ModelConfig
    from finetune.model import build_sharded_model, decoder_blocks, init_random

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        ids, labels = _batch()
        out = {}
        for family, path in dirs.items():
            model = build_sharded_model(ModelConfig(name_or_path=path), mesh, torch.device("cpu"))
            load_hf_weights(model, path)
            with torch.no_grad():
                ours = model(input_ids=ids, use_cache=False).logits
                ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)(input_ids=ids).logits
            out[family] = {"max_diff": float((ours - ref).abs().max()), "loss": _loss(ours, labels),
                           "ref_loss": _loss(ref, labels)}
        model = build_sharded_model(ModelConfig(config_path=dirs["gemma3"]), mesh, torch.device("cpu"))
        init_random(model, 1, 0.02)
        out["gemma3_random_norms"] = [float(p.full_tensor().abs().max()) for n, p in model.named_parameters()
                                      if "norm" in n]
        model(input_ids=ids, use_cache=False).logits.sum()  # a training forward; backward not yet run
        out["gathered_after_forward"] = {"root": _gathered(model), "block": _gathered(decoder_blocks(model)[0])}
        results[rank] = out
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    dirs = {f: save_tiny(str(root / f), f) for f in ("gemma3", "llama")}
    results = mp.Manager().dict()
    start_on_free_port(_worker, lambda port: (port, dirs, results), nprocs=2)
    return dict(results)


@pytest.mark.parametrize("family", ["gemma3", "llama"])
def test_loaded_model_gives_from_pretrained_logits_and_loss(loaded, family):
    for rank in (0, 1):
        r = loaded[rank][family]
        assert r["max_diff"] < 1e-4, f"{family} rank {rank}: logits differ by {r['max_diff']}"
        assert r["loss"] == pytest.approx(r["ref_loss"], rel=1e-6)


def test_gemma3_random_init_uses_its_zero_centred_norms(loaded):
    norms = loaded[0]["gemma3_random_norms"]
    assert norms and max(norms) == 0.0


def test_root_stays_gathered_after_forward_and_blocks_reshard(loaded):
    """Resharding the root after forward would free the embedding and lm_head only to all-gather them again
    at once for backward (~4 GB at vocab 128k x 8192 in bf16). Fails if the root is given
    reshard_after_forward=True, or if a block stops resharding (its memory would then stay gathered)."""
    for rank in (0, 1):
        assert loaded[rank]["gathered_after_forward"] == {"root": True, "block": False}

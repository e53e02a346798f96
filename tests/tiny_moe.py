"""Tiny Mixture-of-Experts models for the tests: a config per family and a folder saved by transformers' own
save_pretrained (the Hub's per-expert layout), with the repo's tiny tokenizer. Nothing is downloaded.

    python -m pytest tests/test_moe.py -q

MOE_FAMILIES names each family's config class and the per-expert tensor name its save_pretrained writes.
"""

from __future__ import annotations

import os
import shutil

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
# family -> (config class, one tensor of expert 0 of layer 0 as save_pretrained names it)
MOE_FAMILIES = {"mixtral": ("MixtralConfig", "model.layers.0.block_sparse_moe.experts.0.w1.weight"),
                "qwen3_moe": ("Qwen3MoeConfig", "model.layers.0.mlp.experts.0.gate_proj.weight")}


def tiny_moe_config(family: str, **overrides):
    """4 experts, 2 per token, 2 layers, hidden 32; vocab 101 (the tiny tokenizer's). `overrides` on top, e.g.
    output_router_logits=True."""
    import transformers

    common = dict(vocab_size=101, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2, num_experts_per_tok=2)
    if family == "mixtral":
        common.update(intermediate_size=48, num_local_experts=4)
    else:
        common.update(intermediate_size=64, moe_intermediate_size=24, num_experts=4, head_dim=8)
    return getattr(transformers, MOE_FAMILIES[family][0])(**{**common, **overrides})


def save_tiny_moe(path: str, family: str, dtype: torch.dtype = torch.float32, max_shard_size: str = "5GB",
                  **overrides) -> str:
    """A randomly initialised tiny MoE (every parameter normal(0, 0.1): a swapped expert shows) saved with
    save_pretrained, plus the repo's tiny tokenizer."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(len(family))
    model = AutoModelForCausalLM.from_config(tiny_moe_config(family, **overrides))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.1)
    model.to(dtype).save_pretrained(path, max_shard_size=max_shard_size)
    for name in TOKENIZER_FILES:
        shutil.copy(os.path.join(ROOT, "assets", "tiny-llama", name), path)
    return path

"""Generate the embedded default: a character tokenizer, a tiny Llama config and a learnable chat data set; and
one tiny config per model family the project supports (FAMILIES, checked by tests/test_families.py).

    python -m finetune.tiny_assets            # rewrites assets/tiny-llama/, assets/families/ and data/tiny/

The outputs are committed, so nothing is downloaded; this script documents how they were made and is
deterministic (same files every time). The task is string reversal ("reverse: abc" -> "cba"): a
2-layer model learns it in a few hundred CPU steps, so a run visibly does something.
"""

from __future__ import annotations

import json
import os
import random
import string
from collections.abc import Callable
from dataclasses import dataclass

SPECIAL = ["<pad>", "<unk>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]
CHARS = list(string.printable[:95])  # digits, letters, punctuation, space
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def build_tokenizer():
    """A character-level fast tokenizer: one token per printable ASCII char plus chat specials."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL + CHARS)}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    core.add_special_tokens(SPECIAL)
    core.decoder = decoders.Fuse()  # join characters back without spaces
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", unk_token="<unk>", eos_token="<|end|>",
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def model_config(vocab_size: int) -> dict:
    from transformers import LlamaConfig

    cfg = LlamaConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128,
        tie_word_embeddings=False, pad_token_id=0, eos_token_id=2, bos_token_id=None,
    )
    return cfg.to_dict()


@dataclass(frozen=True)
class Family:
    """A model family in the conformance list: its tiny config (the character tokenizer's 101 ids) and the training
    overrides it needs, e.g. an attention kernel other than sdpa; and what LoRA adapts in its check (a MoE's fused
    3-D experts are refused with all-linear: docs/moe.md)."""
    config: Callable[[], object]
    overrides: tuple[str, ...] = ()
    lora_targets: str = "all-linear"


def _common(**kw) -> dict:
    """The tiny dimensions every family shares: 2 blocks of width 64, 4 heads of 16 (2 KV heads), 101 ids."""
    return {"vocab_size": 101, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 128,
            "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, **kw}


def _transformers(cls_name: str, **kw) -> Callable[[], object]:
    """A config class of transformers, by name (imported when used: this module is imported without it)."""
    def make():
        import transformers
        return getattr(transformers, cls_name)(**kw)
    return make


_TWO_KINDS = {"sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]}
# The conformance list: one entry per family; tests/test_families.py runs the same checks for each (random init equal
# at W=1 and W=2, a save_pretrained folder loads, train W=2 -> resume W=1, export = save_pretrained, LoRA).
ATTENTION = "q_proj,k_proj,v_proj,o_proj"  # LoRA targets of a MoE family: its experts stay frozen
FAMILIES = {
    "llama": Family(_transformers("LlamaConfig", **_common())),
    "qwen2": Family(_transformers("Qwen2Config", **_common())),  # q/k/v biases
    "qwen3": Family(_transformers("Qwen3Config", **_common())),  # q/k norms
    "gemma3": Family(_transformers("Gemma3TextConfig", **_common(), **_TWO_KINDS)),  # 1 + weight norms, embed_scale
    "mistral": Family(_transformers("MistralConfig", **_common())),
    "phi3": Family(_transformers("Phi3Config", **_common())),  # fused qkv and gate_up
    "gpt2": Family(_transformers("GPT2Config", vocab_size=101, n_embd=64, n_layer=2, n_head=4, n_positions=128,
                                 pad_token_id=0, bos_token_id=1, eos_token_id=2, resid_pdrop=0.0, embd_pdrop=0.0,
                                 attn_pdrop=0.0)),  # Conv1D, learned positions, tied; no dropout: exact losses
    "qwen3_moe": Family(_transformers("Qwen3MoeConfig", **_common(), num_experts=4, num_experts_per_tok=2,
                                      moe_intermediate_size=32), lora_targets=ATTENTION),  # fused 3-D experts, router
    "mixtral": Family(_transformers("MixtralConfig", **_common(intermediate_size=32), num_local_experts=4,
                                    num_experts_per_tok=2), lora_targets=ATTENTION),
    "gpt_oss": Family(_transformers("GptOssConfig", **_common(intermediate_size=32, max_position_embeddings=131072),
                                    num_local_experts=4, num_experts_per_tok=2, **_TWO_KINDS),
                      overrides=("model.attn_implementation=eager",),  # attention sinks: no sdpa in transformers
                      lora_targets=ATTENTION),
}


def family_dir(root: str, name: str) -> str:
    return os.path.join(root, "assets", "families", name)


def write_family(root: str, name: str) -> str:
    """assets/families/<name>/config.json (model.config_path; the tokenizer is tiny-llama's)."""
    path = family_dir(root, name)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(FAMILIES[name].config().to_dict(), f, indent=2, sort_keys=True)
    return path


def reversal_examples(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        word = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(3, 8)))
        out.append({"messages": [
            {"role": "user", "content": f"reverse: {word}"},
            {"role": "assistant", "content": word[::-1]},
        ]})
    return out


def main(root: str = ".") -> None:
    tok = build_tokenizer()
    model_dir = os.path.join(root, "assets", "tiny-llama")
    os.makedirs(model_dir, exist_ok=True)
    tok.save_pretrained(model_dir)
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(model_config(len(tok)), f, indent=2, sort_keys=True)
    for name in FAMILIES:
        write_family(root, name)
    data_dir = os.path.join(root, "data", "tiny")
    os.makedirs(data_dir, exist_ok=True)
    for name, n, seed in (("train.jsonl", 4096, 0), ("eval.jsonl", 64, 1)):
        with open(os.path.join(data_dir, name), "w") as f:
            for ex in reversal_examples(n, seed):
                f.write(json.dumps(ex) + "\n")
    print(f"wrote {model_dir}, {family_dir(root, '*')} and {data_dir}")


if __name__ == "__main__":
    import argparse
    parser = argparse.ArgumentParser(prog="python -m finetune.tiny_assets", description=__doc__.splitlines()[0])
    parser.add_argument("--root", default=".", help="repository root to write assets/ and data/ into")
    main(parser.parse_args().root)

"""Generate the embedded default: a character tokenizer, a tiny Llama config and a learnable chat data set.

    python -m finetune.tiny_assets            # rewrites assets/tiny-llama/ and data/tiny/

The outputs are committed, so nothing is downloaded; this script documents how they were made and is
deterministic (same files every time). The task is string reversal ("reverse: abc" -> "cba"): a
2-layer model learns it in a few hundred CPU steps, so a run visibly does something.
"""

from __future__ import annotations

import json
import os
import random
import string

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
    data_dir = os.path.join(root, "data", "tiny")
    os.makedirs(data_dir, exist_ok=True)
    for name, n, seed in (("train.jsonl", 4096, 0), ("eval.jsonl", 64, 1)):
        with open(os.path.join(data_dir, name), "w") as f:
            for ex in reversal_examples(n, seed):
                f.write(json.dumps(ex) + "\n")
    print(f"wrote {model_dir} and {data_dir}")


if __name__ == "__main__":
    import argparse
    parser = argparse.ArgumentParser(prog="python -m finetune.tiny_assets", description=__doc__.splitlines()[0])
    parser.add_argument("--root", default=".", help="repository root to write assets/ and data/ into")
    main(parser.parse_args().root)

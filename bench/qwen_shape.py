"""The Qwen2.5-0.5B shape (random init, no download) at any number of blocks, for the real-size benchmarks.

    python bench/qwen_shape.py /tmp/qwen8 --layers 8     # writes config.json: the 8-block 255M version

24 blocks is the real model (494M parameters); 8 blocks (255M) is what a test on a 2-core, 24 GiB machine
can afford at 2 ranks. The vocabulary (151,936, tied embeddings) dominates either way.
"""

from __future__ import annotations

import argparse

QWEN05B = dict(hidden_size=896, intermediate_size=4864, num_attention_heads=14, num_key_value_heads=2,
               vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=32768, rope_theta=1000000.0,
               rms_norm_eps=1e-6)


def write_qwen_config(path: str, layers: int, vocab: int | None = None) -> str:
    """Save a Qwen2Config of the 0.5B shape with `layers` blocks into `path`; returns `path`."""
    from transformers import Qwen2Config

    shape = dict(QWEN05B, num_hidden_layers=layers)
    if vocab:
        shape["vocab_size"] = vocab
    Qwen2Config(**shape).save_pretrained(path)
    return path


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("path")
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--vocab", type=int, default=None)
    a = p.parse_args()
    print(write_qwen_config(a.path, a.layers, a.vocab))

"""The Qwen2.5-0.5B shape (random init, no download) at any number of blocks, for the real-size benchmarks; and the
1.5B and 3B shapes (bench/gpu_bench.py).

    python bench/qwen_shape.py /tmp/qwen8 --layers 8     # writes config.json: the 8-block 255M version
    python bench/qwen_shape.py /tmp/qwen15 --shape 1.5b  # the Qwen2.5-1.5B shape, its 28 blocks

24 blocks is the real model (494M parameters); 8 blocks (255M) is what a test on a 2-core, 24 GiB machine
can afford at 2 ranks. The vocabulary (151,936, tied embeddings) dominates either way.
"""

from __future__ import annotations

import argparse

QWEN05B = dict(hidden_size=896, intermediate_size=4864, num_attention_heads=14, num_key_value_heads=2,
               vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=32768, rope_theta=1000000.0,
               rms_norm_eps=1e-6)
# The published Qwen2.5 configs' sizes (tied embeddings in all three); "layers" is each model's own block count.
SHAPES = {"0.5b": dict(QWEN05B, num_hidden_layers=24),
          "1.5b": dict(QWEN05B, hidden_size=1536, intermediate_size=8960, num_attention_heads=12, num_hidden_layers=28),
          "3b": dict(QWEN05B, hidden_size=2048, intermediate_size=11008, num_attention_heads=16, num_hidden_layers=36)}


def write_qwen_config(path: str, layers: int | None = None, vocab: int | None = None, shape: str = "0.5b") -> str:
    """Save a Qwen2Config of `shape` (SHAPES) with `layers` blocks (default: the model's own) into `path`."""
    from transformers import Qwen2Config

    shape = dict(SHAPES[shape], **({"num_hidden_layers": layers} if layers else {}))
    if vocab:
        shape["vocab_size"] = vocab
    Qwen2Config(**shape).save_pretrained(path)
    return path


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("path")
    p.add_argument("--layers", type=int, default=None, help="decoder blocks (default: the shape's own)")
    p.add_argument("--vocab", type=int, default=None)
    p.add_argument("--shape", choices=sorted(SHAPES), default="0.5b")
    a = p.parse_args()
    print(write_qwen_config(a.path, a.layers, a.vocab, a.shape))

"""`python -m finetune.data prepare`: tokenize a config's training (and eval) data ahead of the job.

    python -m finetune.data prepare --config configs/tiny.yaml [key=value ...]
    python -m pytest tests/test_data.py -q -k prepare

The cache it builds is the one the training job then finds committed (same config, same cache key).
"""

from __future__ import annotations

import argparse
import sys

from finetune.config import ConfigError, load_config
from finetune.data.cache import build_cache
from finetune.data.errors import DataError
from finetune.data.samples import open_samples
from finetune.model import ModelError, load_tokenizer


def prepare(argv: list[str]) -> int:
    """Tokenize the training (and eval) data of a config ahead of the job, e.g. on a CPU node."""
    p = argparse.ArgumentParser(prog="python -m finetune.data prepare", description=prepare.__doc__)
    p.add_argument("--config", default=None, help="the YAML preset the training job will use")
    p.add_argument("overrides", nargs="*", help="key=value, exactly as given to train_fsdp.py")
    args = p.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        tokenizer = load_tokenizer(cfg.model)
        for eval_set in (False, True) if cfg.data.eval_path else (False,):
            cache = build_cache(cfg.data, tokenizer, eval_set)
            samples = open_samples(cache, cfg.data)
            meta = samples.cache.meta
            print(f"{'eval' if eval_set else 'train'}: {cache} | {meta['n_docs']:,} documents | "
                  f"{meta['n_tokens']:,} tokens | {len(samples):,} samples of {cfg.data.seq_len}")
    except (ConfigError, DataError, ModelError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["prepare"]:
        sys.exit(prepare(sys.argv[2:]))
    asked = sys.argv[1:2] in (["-h"], ["--help"])
    print(f"usage: python -m finetune.data prepare --config <yaml> [key=value ...]\n\n{prepare.__doc__}\n"
          "python -m finetune.data prepare --help lists the options.", file=sys.stdout if asked else sys.stderr)
    sys.exit(0 if asked else 2)

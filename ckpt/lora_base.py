"""Which base a LoRA checkpoint belongs to: the fingerprint of a HF weights folder, the checkpoint's "lora" entry,
and the rule that refuses a resume or an export against another base (naming both).

    python -m pytest tests/test_lora.py -q

Below both the resume (resume.py check_same_base) and the exports (hf/adapter.py), so neither imports the other.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math

from .errors import CheckpointError
from .layout import read_meta
from .reading import safetensors_headers

_SAMPLED_TENSORS, _SAMPLED_BYTES = 8, 1 << 20


@functools.lru_cache(maxsize=4)
def base_fingerprint(hf_dir: str) -> dict:
    """{"fingerprint", "params", "bytes"} of a HF safetensors folder: sha256 over every tensor's name, dtype
    and shape, plus the first MiB of 8 tensors spread over the sorted names. Cost: the headers + 8 MiB read,
    whatever the model size. Same weights in other files (sharding) -> same fingerprint; another fine-tune of
    the same architecture differs in the sampled bytes."""
    headers = safetensors_headers(hf_dir)
    h = hashlib.sha256()
    names = sorted(headers)
    for name in names:
        h.update(json.dumps([name, headers[name]["dtype"], headers[name]["shape"]]).encode())
    step = max(1, len(names) // _SAMPLED_TENSORS)
    for name in names[::step][:_SAMPLED_TENSORS]:
        t = headers[name]
        with open(t["file"], "rb") as f:
            f.seek(t["start"])
            h.update(f.read(min(t["nbytes"], _SAMPLED_BYTES)))
    return {"fingerprint": "sha256:" + h.hexdigest()[:32], "params": sum(math.prod(t["shape"]) for t in headers.values()),
            "bytes": sum(t["nbytes"] for t in headers.values())}


def lora_info(ckpt_path: str) -> dict | None:
    """meta.json's "lora" entry of a checkpoint, or None for a full fine-tuning checkpoint."""
    return read_meta(ckpt_path, missing_ok=True).get("lora")


def check_same_base(ckpt_path: str, expected: dict | None) -> None:
    """Refuse to resume `ckpt_path` in a run whose adapter setup (`expected`: the run's meta "lora" entry, None
    for full fine-tuning) differs: full vs LoRA, or adapters trained on another base (both named)."""
    saved = lora_info(ckpt_path)
    if saved is None and expected is None:
        return
    if saved is None:
        raise CheckpointError(f"checkpoint {ckpt_path} is a full fine-tuning checkpoint, but this run trains LoRA "
                              f"adapters (r={expected['r']}) on {expected['base']}")
    if expected is None:
        raise CheckpointError(f"checkpoint {ckpt_path} holds LoRA adapters (r={saved['r']}) of base {saved['base']}, "
                              "but this run does full fine-tuning")
    if saved["base_fingerprint"] != expected["base_fingerprint"]:
        raise CheckpointError(f"checkpoint {ckpt_path} was trained on base {saved['base']} "
                              f"({saved['base_fingerprint']}), but this run's base is {expected['base']} "
                              f"({expected['base_fingerprint']}): adapters only fit the weights they were trained on")


def describe_lora(meta: dict, ckpt_bytes: int, schema) -> str | None:
    """One line for `inspect`: a LoRA checkpoint, and its size against a full one (fp32 weights + the optimizer
    state of `schema`, the checkpoint's CheckpointSchema)."""
    lora = meta.get("lora")
    if not lora:
        return None
    full = lora["base_params"] * (4 + schema.optimizer_state_bytes)  # 4 bytes of fp32 weight + the state's
    return (f"LoRA checkpoint: adapters r={lora['r']}, alpha {lora['alpha']}, on base {lora['base']} "
            f"({lora['base_fingerprint']}); {ckpt_bytes / 2**20:.2f} MiB = {100 * ckpt_bytes / full:.2f}% of a full "
            f"fine-tuning checkpoint of this model (~{full / 2**20:.1f} MiB: fp32 weights + {schema.optimizer} state)")

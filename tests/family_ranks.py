"""The ranks of tests/test_families.py's in-process checks: per family, random init at W=2 and at W=1 (each rank
alone), then the family's save_pretrained folder loaded at W=2; each rank writes what it found as JSON.

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/family_ranks.py SAVED.json OUT_DIR
    (started by tests/test_families.py through conftest.run_python: forked from tests/zygote.py, imports done)
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from finetune.tiny_assets import FAMILIES, family_dir  # noqa: E402


def model_cfg(name: str, **keys):
    """The family's ModelConfig: its overrides (e.g. eager attention) and `keys` (model.<key>=<value>)."""
    from finetune.config import load_config
    return load_config(None, [*FAMILIES[name].overrides, *(f"model.{k}={v}" for k, v in keys.items())]).model


def ids() -> torch.Tensor:
    return torch.randint(3, 101, (2, 16), generator=torch.Generator().manual_seed(7))


def full(model) -> dict:
    """Every parameter in full (a collective on a sharded model: every rank calls it)."""
    return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}


def init_check(name: str, meshes: dict) -> dict:
    from finetune.model import build_sharded_model, init_random

    drawn = {}
    for w, mesh in meshes.items():
        model = build_sharded_model(model_cfg(name, config_path=family_dir(ROOT, name)), mesh, torch.device("cpu"))
        init_random(model, 3, 0.02)
        drawn[w] = full(model)
    return {"init_names": sorted(drawn[1]) == sorted(drawn[2]), "init_params": len(drawn[1]),
            "init_differ": [n for n in drawn[2] if not torch.equal(drawn[1][n], drawn[2][n])]}


def load_check(name: str, saved: str, mesh) -> dict:
    from transformers import AutoModelForCausalLM

    from ckpt.hf.load import load_hf_weights
    from finetune.model import build_sharded_model

    try:
        model = build_sharded_model(model_cfg(name, name_or_path=saved), mesh, torch.device("cpu"))
        load_hf_weights(model, saved)
    except Exception as e:  # noqa: BLE001 - the message is the result (MoE: the Hub's per-expert names)
        return {"error": f"{type(e).__name__}: {str(e)[:500]}"}
    ref = AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32,
                                               attn_implementation=model.config._attn_implementation)
    ref_sd, loaded = ref.state_dict(), full(model)
    with torch.no_grad():
        model.eval()  # dropout off, as from_pretrained's
        diff = (model(input_ids=ids(), use_cache=False).logits - ref(input_ids=ids(), use_cache=False).logits)
    return {"differ": [n for n in loaded if not torch.equal(loaded[n], ref_sd[n])],
            "logits_diff": float(diff.abs().max())}


def main(saved_json: str, out_dir: str) -> None:
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    with open(saved_json) as f:
        saved = json.load(f)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    try:
        two = init_device_mesh("cpu", (2,), mesh_dim_names=("shard",))
        alone = [dist.new_group([r]) for r in (0, 1)][rank]
        one = DeviceMesh.from_group(alone, "cpu", mesh_dim_names=("shard",))
        out = {name: {**init_check(name, {2: two, 1: one}), "load": load_check(name, saved[name], two)}
               for name in FAMILIES}
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(out, f)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:3])

"""LoRA vs full fine-tuning checkpoints of the same model: bytes on disk and training-blocking save time.

    python bench/lora_bench.py                               # ~45M-param Llama, 2 ranks, CPU here
    python bench/lora_bench.py --hidden 64 --layers 1 --vocab 256 --rounds 2   # seconds, smoke test

Launches itself under torchrun. Each rank builds the model twice, sharded like train_fsdp.py: full (every
parameter trained, AdamW on all) and LoRA (r=--rank on every attention and MLP projection, base frozen),
takes one optimizer step so AdamW state exists, then saves both through CheckpointManager, sync (`off`) and
async (`thread`), interleaved round by round so load on the machine hits both alike. Reports median and
min-max of blocking seconds, and checkpoint bytes. Writes bench/results/lora_bench.{json,md}
and keeps the run under bench/results/runs/ (bench/provenance.py).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from common.dist import free_port  # noqa: E402 - after the path insert

import provenance  # noqa: E402 - bench/provenance.py, beside this script


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--rank", type=int, default=16, help="LoRA r")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5, help="saves per (model, mode), interleaved")
    p.add_argument("--work-dir", default=None, help="where checkpoints go (default: a temp dir)")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def build(args, work: str, lora_r: int):
    """The bench Llama, fully_shard-ed; with lora_r > 0 peft adapters on all-linear and the base frozen."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import LlamaConfig

    from finetune.config import LoRAConfig, ModelConfig
    from finetune.lora import init_adapters
    from finetune.model import build_sharded_model, init_random

    cfg_dir = os.path.join(work, "model")
    if dist.get_rank() == 0 and not os.path.isdir(cfg_dir):
        LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3,
                    num_hidden_layers=args.layers, num_attention_heads=max(1, args.hidden // 64),
                    max_position_embeddings=128).save_pretrained(cfg_dir)
    dist.barrier()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    cfg = ModelConfig(config_path=cfg_dir, param_dtype="fp32", lora=LoRAConfig(r=lora_r))
    model = build_sharded_model(cfg, mesh, torch.device("cpu"))
    init_random(model, seed=0, std=0.02)
    if lora_r:
        init_adapters(model, seed=0)
    optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    ids = torch.randint(0, args.vocab, (1, 64), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()  # one step: AdamW state exists, as in a real checkpoint
    optim.step()
    optim.zero_grad(set_to_none=True)
    return model, optim


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path))


def worker(args) -> None:
    import torch.distributed as dist

    from ckpt import CheckpointManager, ModelOptimizer
    from ckpt.layout import step_dir

    dist.init_process_group("gloo")
    work = args.work_dir
    models = {"full": build(args, work, 0), "lora": build(args, work, args.rank)}
    cases = [(kind, mode) for mode in ("off", "thread") for kind in ("full", "lora")]
    managers = {c: CheckpointManager(os.path.join(work, f"{c[0]}-{c[1]}"), c[1], keep_last=1) for c in cases}
    res = {f"{k}/{m}": {"blocking_s": [], "bytes": None} for k, m in cases}
    for step in range(1, args.rounds + 1):
        for kind, mode in cases:  # interleaved: every round saves each case once
            model, optim = models[kind]
            mgr = managers[(kind, mode)]
            blocking = mgr.save(step, {"app": ModelOptimizer(model, optim)}, {"meta.json": "{}\n"})
            mgr.wait()  # committed before the next case, so cases never overlap
            res[f"{kind}/{mode}"]["blocking_s"].append(blocking)
            res[f"{kind}/{mode}"]["bytes"] = dir_bytes(step_dir(mgr.dir, step)) if dist.get_rank() == 0 else None
    for mgr in managers.values():
        mgr.close()
    if dist.get_rank() == 0:
        params = {k: (sum(p.numel() for p in m.parameters() if p.requires_grad), sum(p.numel() for p in m.parameters()))
                  for k, (m, _) in models.items()}
        with open(os.path.join(work, "raw.json"), "w") as f:
            json.dump({"cases": res, "params": params, "world_size": dist.get_world_size()}, f)
    dist.destroy_process_group()


def summarize(raw: dict, args) -> dict:
    out = {"model": {"hidden": args.hidden, "layers": args.layers, "vocab": args.vocab, "lora_r": args.rank,
                     "params": raw["params"]["full"][1], "lora_trainable_params": raw["params"]["lora"][0]},
           "world_size": raw["world_size"], "rounds": args.rounds, "cases": {}}
    for name, r in raw["cases"].items():
        b = r["blocking_s"]
        out["cases"][name] = {"bytes": r["bytes"], "blocking_median_s": statistics.median(b),
                              "blocking_min_s": min(b), "blocking_max_s": max(b), "blocking_s": b}
    c = out["cases"]
    out["ratios"] = {"bytes_full_over_lora": c["full/off"]["bytes"] / c["lora/off"]["bytes"],
                     "sync_blocking_full_over_lora": c["full/off"]["blocking_median_s"] / c["lora/off"]["blocking_median_s"],
                     "async_blocking_full_over_lora":
                         c["full/thread"]["blocking_median_s"] / c["lora/thread"]["blocking_median_s"]}
    return out


def table(res: dict) -> str:
    lines = [f"{res['model']['params'] / 1e6:.0f}M params, LoRA r={res['model']['lora_r']}, {res['world_size']} ranks, "
             f"{res['rounds']} rounds. " + provenance.markdown_line(res), "",
             "| checkpoint | mode | size | blocking median (min-max) |", "|---|---|---|---|"]
    for name, c in res["cases"].items():
        kind, mode = name.split("/")
        lines.append(f"| {kind} | {'sync' if mode == 'off' else 'async ' + mode} | {c['bytes'] / 2**20:.2f} MiB | "
                     f"{c['blocking_median_s']:.3f} s ({c['blocking_min_s']:.3f}-{c['blocking_max_s']:.3f}) |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    started = provenance.start(argv)
    work = args.work_dir or tempfile.mkdtemp(prefix="lora_bench_")
    port = free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.nproc), "--master_addr",
           "127.0.0.1", "--master_port", str(port), os.path.abspath(__file__), "--worker", "--work-dir", work,
           "--hidden", str(args.hidden), "--layers", str(args.layers), "--vocab", str(args.vocab),
           "--rank", str(args.rank), "--rounds", str(args.rounds)]
    try:
        subprocess.run(cmd, check=True, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
        with open(os.path.join(work, "raw.json")) as f:
            res = summarize(json.load(f), args)
    finally:
        if args.work_dir is None:
            shutil.rmtree(work, ignore_errors=True)
    provenance.record(res, "lora_bench", args.out, started)
    with open(os.path.join(args.out, "lora_bench.md"), "w") as f:
        f.write(table(res))
    print(table(res))
    print(json.dumps(res["ratios"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())

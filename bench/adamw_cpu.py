"""AdamW on CPU with FSDP2: `foreach` (what train_fsdp.py used) against `fused`: same numbers? memory? time?

    python bench/adamw_cpu.py                          # Qwen2.5-0.5B shape, 8 blocks, vocab 32000, 2 ranks
    python bench/adamw_cpu.py --layers 1 --vocab 1024 --steps 3   # seconds, a smoke test

Each mode runs in its own torchrun (2 ranks, gloo) so each has its own peak RSS. Both train the same
random-init model on the same batches; after --steps steps every rank saves its local parameter shards and
AdamW state, and the driver compares them bitwise (and gives the largest absolute difference). Per rank:
VmHWM of the whole run, the peak rise of RSS during optimizer.step() (VmHWM reset through
/proc/self/clear_refs before each step), and the median optimizer.step() and whole-step times after the
first step. Writes bench/results/adamw_cpu.json and keeps the run under bench/results/runs/ (bench/provenance.py).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from bench.qwen_shape import write_qwen_config  # noqa: E402 - after the path insert
from common.dist import free_port  # noqa: E402
import provenance  # noqa: E402 - bench/provenance.py, beside this script

MODES = ("foreach", "fused")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    p.add_argument("--worker", choices=MODES, default=None, help=argparse.SUPPRESS)
    p.add_argument("--work-dir", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def proc_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field))


def reset_peak_rss() -> None:
    """Linux: writing 5 to clear_refs resets VmHWM to the current RSS."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


# ---------------------------------------------------------------- worker side (under torchrun)

def worker(args) -> None:
    import torch
    import torch.distributed as dist

    from finetune.config import ModelConfig
    from finetune.model import build_mesh, build_sharded_model, init_random

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_sharded_model(ModelConfig(config_path=os.path.join(args.work_dir, "model"), param_dtype="fp32"),
                                build_mesh(torch.device("cpu"), world, 1), torch.device("cpu"))
    init_random(model, seed=0, std=0.02)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1,
                              **({"fused": True} if args.worker == "fused" else {"foreach": True}))
    gen = torch.Generator().manual_seed(1 + rank)
    step_s, opt_s, opt_rise, losses = [], [], [], []
    for _ in range(args.steps):
        ids = torch.randint(0, args.vocab, (1, args.seq_len), generator=gen)
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        before = proc_kib("VmRSS:")
        reset_peak_rss()
        t1 = time.perf_counter()
        optim.step()
        opt_s.append(time.perf_counter() - t1)
        opt_rise.append((proc_kib("VmHWM:") - before) * 1024)
        optim.zero_grad(set_to_none=True)
        step_s.append(time.perf_counter() - t0)
        losses.append(loss.item())
    local = {f"param/{n}": p.to_local().detach().clone() for n, p in model.named_parameters()}
    for i, st in enumerate(optim.state.values()):
        local.update({f"state/{i}/{k}": v.to_local() if hasattr(v, "to_local") else v for k, v in st.items()})
    torch.save(local, os.path.join(args.work_dir, f"{args.worker}-rank{rank}.pt"))
    out = {"rank": rank, "losses": losses, "step_s": step_s, "optimizer_step_s": opt_s,
           "optimizer_step_rss_rise_bytes": opt_rise, "peak_rss_bytes": proc_kib("VmHWM:") * 1024,
           "params": sum(p.numel() for p in model.parameters()),
           "local_param_bytes": sum(p.to_local().numel() * 4 for p in model.parameters())}
    with open(os.path.join(args.work_dir, f"{args.worker}-rank{rank}.json"), "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()


# ---------------------------------------------------------------- driver side

def launch(args, mode: str, work: str) -> list[dict]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.nproc), "--master_addr",
           "127.0.0.1", "--master_port", str(free_port()), os.path.abspath(__file__), "--worker", mode,
           "--work-dir", work, "--vocab", str(args.vocab), "--seq-len", str(args.seq_len), "--steps", str(args.steps)]
    subprocess.run(cmd, check=True, cwd=ROOT)
    ranks = []
    for r in range(args.nproc):
        with open(os.path.join(work, f"{mode}-rank{r}.json")) as f:
            ranks.append(json.load(f))
    return ranks


def compare(work: str, nproc: int) -> dict:
    """Bitwise equality of every rank's parameters and AdamW state after the run, and the largest difference."""
    import torch
    equal, worst, worst_rel = True, 0.0, 0.0
    for r in range(nproc):
        a, b = (torch.load(os.path.join(work, f"{m}-rank{r}.pt")) for m in MODES)
        for k in a:
            x, y = a[k].double(), b[k].double()
            equal &= torch.equal(a[k], b[k])
            diff = (x - y).abs().max().item() if x.numel() else 0.0
            worst = max(worst, diff)
            worst_rel = max(worst_rel, diff / max(x.abs().max().item(), 1e-30) if x.numel() else 0.0)
    return {"bitwise_equal": bool(equal), "max_abs_diff": worst, "max_diff_relative_to_max_abs": worst_rel}


def one_step_ulps(n: int = 1_000_000) -> dict:
    """The two modes from the same parameters and the same 3 gradients: the largest difference (absolute, in
    units in the last place of the parameter, against the largest update), and the share of elements that differ.
    Training then amplifies such differences through the next gradients, so runs drift apart slowly."""
    import torch
    gen = torch.Generator().manual_seed(0)
    start, grads = torch.randn(n, generator=gen) * 0.02, [torch.randn(n, generator=gen) * 1e-3 for _ in range(3)]
    out = {}
    for mode in MODES:
        p = start.clone().requires_grad_()
        opt = torch.optim.AdamW([p], lr=1e-3, weight_decay=0.1, **{mode: True})
        for g in grads:
            p.grad = g.clone()
            opt.step()
        out[mode] = p.detach()
    a, b = out["foreach"], out["fused"]
    diff = (a - b).abs()
    ulp = (torch.nextafter(a, torch.full_like(a, float("inf"))) - a).abs()
    big = a.abs() > 1e-3  # away from zero, where one ulp of the parameter is meaningful
    return {"max_abs_diff": diff.max().item(), "max_ulps_where_abs_above_1e-3": (diff[big] / ulp[big]).max().item(),
            "max_diff_over_update": (diff / (a - start).abs().max()).max().item(),
            "share_different": (a != b).float().mean().item()}


def summary(ranks: list[dict]) -> dict:
    med = lambda key: statistics.median(v for r in ranks for v in r[key][1:] or r[key])  # noqa: E731
    return {"peak_rss_GiB_per_rank": [round(r["peak_rss_bytes"] / 2 ** 30, 3) for r in ranks],
            # the first step allocates AdamW's moments; later rises are the optimizer's temporaries
            "first_optimizer_step_rss_rise_MiB": [round(r["optimizer_step_rss_rise_bytes"][0] / 2 ** 20, 1)
                                                  for r in ranks],
            "later_optimizer_step_rss_rise_MiB_max": round(max(max(r["optimizer_step_rss_rise_bytes"][1:] or [0])
                                                               for r in ranks) / 2 ** 20, 1),
            "optimizer_step_s_median": round(med("optimizer_step_s"), 4), "step_s_median": round(med("step_s"), 3),
            "losses_rank0": ranks[0]["losses"], "local_param_MiB": [round(r["local_param_bytes"] / 2 ** 20, 1)
                                                                     for r in ranks]}


def main(argv=None):
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    started = provenance.start(argv)  # at the start: the code that ran, the load it ran under
    with tempfile.TemporaryDirectory(prefix="adamw-cpu-") as work:
        write_qwen_config(os.path.join(work, "model"), args.layers, args.vocab)
        modes = {m: summary(launch(args, m, work)) for m in MODES}
        result = {"modes": modes, "comparison": compare(work, args.nproc), "same_gradients": one_step_ulps()}
    import torch
    result.update(layers=args.layers, vocab=args.vocab, seq_len=args.seq_len, steps=args.steps,
                  nproc=args.nproc, torch=torch.__version__)
    provenance.record(result, "adamw_cpu", args.out, started)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

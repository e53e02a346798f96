"""Peak memory of the loss (forward + backward from the logits) at a large vocabulary: plain vs chunked.

    python bench/loss_memory.py                         # CPU: vocab 128256, seq 512, fp32 logits
    python bench/loss_memory.py --seq 4096 --dtype bf16  # on a GPU: the review's case

Each measurement runs in a fresh subprocess. On CUDA it reads torch.cuda.max_memory_allocated; on CPU
the rise of the process's peak RSS (VmHWM) above its RSS with the logits already allocated. Methods are
interleaved over --repeats rounds; the table gives the median and the spread, in units of one logits copy.
Writes bench/results/loss_memory.{json,md} (--out) and keeps the run under bench/results/runs/ (bench/provenance.py).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import provenance  # noqa: E402 - bench/provenance.py, beside this script


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field))


def measure(method: str, batch: int, seq: int, vocab: int, dtype: str) -> dict:
    import torch
    import torch.nn.functional as F

    from finetune.loss import next_token_loss_sum
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    dt = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    gen = torch.Generator(device=device).manual_seed(0)
    logits = torch.randn(batch, seq, vocab, device=device, dtype=dt, generator=gen).requires_grad_()
    labels = torch.randint(0, vocab, (batch, seq), device=device, generator=gen)
    logits_bytes = logits.numel() * logits.element_size()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = _rss_kib("VmRSS:") * 1024
    if method == "plain":  # what train_fsdp.py did before: upcast, shifted slice of the logits
        lg = logits.float()
        loss = F.cross_entropy(lg[:, :-1].reshape(-1, vocab), labels[:, 1:].reshape(-1), reduction="sum")
        del lg
    else:
        loss = next_token_loss_sum(logits, labels, -100)
    loss.backward()
    if cuda:
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = _rss_kib("VmHWM:") * 1024 - base
    return {"method": method, "peak_bytes": peak, "logits_bytes": logits_bytes, "loss": float(loss),
            "device": device.type}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        print(json.dumps(measure(a.worker, a.batch, a.seq, a.vocab, a.dtype)))
        return
    started = provenance.start()
    rows = {"plain": [], "chunked": []}
    for _ in range(a.repeats):
        for method in rows:  # interleaved, so drift on a shared machine hits both alike
            out = subprocess.run([sys.executable, __file__, "--worker", method, "--batch", str(a.batch), "--seq",
                                  str(a.seq), "--vocab", str(a.vocab), "--dtype", a.dtype],
                                 capture_output=True, text=True, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
            rows[method].append(json.loads(out.stdout.strip().splitlines()[-1]))
    first = rows["plain"][0]
    res = {"device": first["device"], "batch": a.batch, "seq": a.seq, "vocab": a.vocab, "dtype": a.dtype,
           "repeats": a.repeats, "logits_bytes": first["logits_bytes"], "methods": {}}
    for method, rs in rows.items():
        peaks = [r["peak_bytes"] for r in rs]
        res["methods"][method] = {"peak_bytes": peaks, "peak_median_MiB": statistics.median(peaks) / 2**20,
                                  "logits_copies": statistics.median(peaks) / first["logits_bytes"],
                                  "loss": rs[0]["loss"]}
    provenance.record(res, "loss_memory", a.out, started)
    lines = [f"loss memory, {first['device']}: batch {a.batch} x seq {a.seq} x vocab {a.vocab} {a.dtype} "
             f"(one logits copy = {first['logits_bytes'] / 2**20:.0f} MiB), {a.repeats} interleaved runs. "
             + provenance.markdown_line(res), "",
             "| method | peak above logits, MiB (median) | min-max | copies of the logits | loss |", "|---|---|---|---|---|"]
    for method, m in res["methods"].items():
        lines.append(f"| {method} | {m['peak_median_MiB']:.0f} | {min(m['peak_bytes']) / 2**20:.0f}-"
                     f"{max(m['peak_bytes']) / 2**20:.0f} | {m['logits_copies']:.2f} | {m['loss']:.6g} |")
    provenance.write_markdown(a.out, "loss_memory", lines)


if __name__ == "__main__":
    main()

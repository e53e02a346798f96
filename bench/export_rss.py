"""Peak memory of the Hugging Face export: a ~110M-param Llama built from a config, saved as a DCP checkpoint
in the CheckpointManager layout, then exported by `python -m ckpt export` in a fresh process.

    python bench/export_rss.py                       # fp32, checkpoint saved by one rank (the worst case)
    python bench/export_rss.py --dtype bf16 --keep /tmp/export-rss

Prints the exporting process's peak RSS above its baseline (torch, transformers and the Llama code
imported), beside the model's size and, for contrast, a naive export that loads the whole state dict
and writes it with safetensors' save_file. Nothing is downloaded. Writes bench/results/export_rss.{json,md} (--out)
and keeps the run under bench/results/runs/ (bench/provenance.py).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import provenance  # noqa: E402 - bench/provenance.py, beside this script

# Run inside the measured process: baseline after the imports, peak reset, export, peak read back.
# Peak RSS comes from VmHWM after resetting it (clear_refs 5); where that is refused, a 1 ms sampler.
MEASURE = r"""
import json, sys, threading, time
import torch, transformers, transformers.models.llama.modeling_llama
from ckpt.hf.export import export_cli
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024

mode, ckpt, out, dtype = sys.argv[1:5]
base = status("VmRSS")
try:
    open("/proc/self/clear_refs", "w").write("5")
    sampled = None
except OSError:
    sampled = [base]
    def sample():
        while True:
            sampled[0] = max(sampled[0], status("VmRSS"))
            time.sleep(0.001)
    threading.Thread(target=sample, daemon=True).start()
t0 = time.perf_counter()
if mode == "stream":
    assert export_cli(ckpt, out, dtype, "2GB") == 0
else:  # naive: the whole model in memory, then one save_file
    sd = _load_state_dict_from_keys(checkpoint_id=ckpt)["app"]["model"]
    save_file({k: v.to(getattr(torch, {"fp32": "float32", "bf16": "bfloat16"}[dtype])).contiguous()
               for k, v in sd.items() if k != "lm_head.weight"}, out + "/model.safetensors")
seconds = time.perf_counter() - t0
peak = sampled[0] if sampled else status("VmHWM")
print(json.dumps({"baseline": base, "peak": peak, "seconds": seconds, "sampled": sampled is not None}))
"""


def bench_config():
    from transformers import LlamaConfig

    # GPT-2-small-like: 12 x 768, vocab 32000, tied embeddings -> about 110M parameters
    return LlamaConfig(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                       num_attention_heads=12, num_key_value_heads=12, max_position_embeddings=2048,
                       tie_word_embeddings=True, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def save_checkpoint(root: str) -> tuple[str, int, int]:
    """A committed one-rank checkpoint of a randomly initialised model; returns (path, params, bytes)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from transformers import AutoModelForCausalLM

    from ckpt.checksum import ChecksummingWriter
    from ckpt.commit_protocol import commit_checkpoint

    model_dir, ckpt = os.path.join(root, "model"), os.path.join(root, "checkpoints", "step-000001")
    config = bench_config()
    config.save_pretrained(model_dir)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(os.path.join(ROOT, "assets", "tiny-llama", name), model_dir)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    params = sum(p.numel() for p in model.parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no process group: saving in a single process" is the intent
        # the writer CheckpointManager uses: it hashes each file as written, for the commit marker
        metadata = dcp.save({"app": {"model": model.state_dict()}}, no_dist=True, storage_writer=ChecksummingWriter(ckpt))
    with open(os.path.join(ckpt, "meta.json"), "w") as f:
        json.dump({"step": 1, "world_size": 1, "model": model_dir}, f)
    with open(os.path.join(ckpt, "config.yaml"), "w") as f:
        f.write(f"model:\n  name_or_path: {model_dir}\n")
    commit_checkpoint(ckpt, 1, metadata.file_digests, metadata, ["meta.json", "config.yaml"])
    return ckpt, params, params * 4


def measure(mode: str, ckpt: str, out: str, dtype: str) -> dict:
    os.makedirs(out, exist_ok=True) if mode == "naive" else None
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    proc = subprocess.run([sys.executable, "-c", MEASURE, mode, ckpt, out, dtype], env=env, cwd=ROOT,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{mode} export failed:\n{proc.stdout}\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--keep", default="", help="work in this folder and keep it (default: a temp folder, deleted)")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    args = p.parse_args()
    started = provenance.start()
    root = args.keep or tempfile.mkdtemp(prefix="export-rss-")
    mib = 2 ** 20
    try:
        ckpt, params, model_bytes = save_checkpoint(root)
        res = {"params": params, "model_bytes": model_bytes, "dtype": args.dtype, "modes": {}}
        for mode in ("stream", "naive"):
            r = measure(mode, ckpt, os.path.join(root, f"hf-{mode}"), args.dtype)
            above = r["peak"] - r["baseline"]
            res["modes"][mode] = {**r, "peak_above_baseline_MiB": above / mib,
                                  "peak_above_baseline_over_model": above / model_bytes}
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    provenance.record(res, "export_rss", args.out, started)
    lines = [f"model: {params / 1e6:.1f}M params, {model_bytes / mib:.0f} MiB fp32; largest tensor (embeddings) "
             f"{32000 * 768 * 4 / mib:.0f} MiB; checkpoint saved by 1 rank. " + provenance.markdown_line(res), "",
             "| export | peak RSS above baseline | baseline | of the model | seconds |", "|---|---|---|---|---|"]
    for mode, r in res["modes"].items():
        lines.append(f"| {mode} ({args.dtype}) | {r['peak_above_baseline_MiB']:.0f} MiB | {r['baseline'] / mib:.0f} MiB "
                     f"| {r['peak_above_baseline_over_model']:.0%} | {r['seconds']:.1f}{' (sampled)' if r['sampled'] else ''} |")
    provenance.write_markdown(args.out, "export_rss", lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())

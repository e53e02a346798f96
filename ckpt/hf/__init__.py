"""Hugging Face interop: weights in at start-up, a checkpoint out as a HF model folder (full, or LoRA merged into
its base, or the PEFT adapter alone).

    python -m ckpt export runs/tiny/checkpoints/step-001200 out/model
    python -m pytest tests/test_hf.py tests/test_lora.py -q

- load.py: a local safetensors model read into the fully_shard-ed model, each rank only its slices.
- export.py: the one export entry point (`export_checkpoint`, `export_final` at the end of training, the CLI);
  every rank writes its share, memory about one saved chunk.
- adapter.py: LoRA's two exports and peft's merge rule per layer type.
- files.py: the safetensors writer the exports share (save_pretrained's sharding, pre-sized files).
- convert.py: the Hub's tensor layout <-> the in-memory one (MoE experts per-expert in files, fused in memory),
  by transformers' own conversion rules; load.py and export.py read and write through it.

May import: ckpt/'s core modules (errors, layout, reading, schema, commit_protocol, lora_base, storage), common/,
torch, safetensors; transformers and peft lazily. Nothing in ckpt/ imports this package but the handle the
trainer holds (loop.py) and `python -m ckpt` (__main__.py).
"""

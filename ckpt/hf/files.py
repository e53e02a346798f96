"""The safetensors writer the exports share: tensors assigned to files as save_pretrained shards them, each
file created at full size with its header (writers then fill their byte ranges in parallel), the index,
config.json / generation config / tokenizer, and the swap of the finished folder into place.

    python -m pytest tests/test_hf.py tests/test_lora.py -q -k export
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from dataclasses import dataclass

import torch

SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
                      torch.int64: "I64", torch.int32: "I32", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}


def parse_size(text: str) -> int:
    """'2GB' -> 2e9 bytes, '500MB', '100KiB', '123' (bytes); decimal and binary units as HF reads them."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*", str(text), flags=re.IGNORECASE)
    if not m:
        raise ValueError(f"size {text!r} must look like 2GB, 500MB or 100KiB")
    unit = (m.group(2) or "B").upper()
    power = "BKMGT".index(unit[0])
    return int(float(m.group(1)) * ((1024 if "I" in unit else 1000) ** power))


@dataclass
class OutTensor:
    """One tensor of the output: which file, where its bytes go, and how many have arrived."""
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    file: int  # index into the list of output files
    begin: int  # byte offset inside that file's data section
    nbytes: int
    written: int = 0


def assign_files(saved: dict, names: list[str], dtype: torch.dtype, max_bytes: int,
               prefix: str = "") -> list[list[OutTensor]]:
    """Assign tensors to files in state-dict order, a new file when the next tensor would pass max_bytes
    (a tensor larger than that gets a file of its own), as save_pretrained shards. `saved[prefix + name]`
    is each tensor's metadata."""
    files: list[list[OutTensor]] = [[]]
    used = 0
    for name in names:
        md = saved[prefix + name]
        out_dtype = dtype if md.properties.dtype.is_floating_point else md.properties.dtype
        nbytes = math.prod(md.size) * out_dtype.itemsize
        if files[-1] and used + nbytes > max_bytes:
            files.append([])
            used = 0
        files[-1].append(OutTensor(name, tuple(md.size), out_dtype, len(files) - 1, used, nbytes))
        used += nbytes
    return files


def file_names(n: int) -> list[str]:
    return ["model.safetensors"] if n == 1 else [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]


def safetensors_header(tensors: list[OutTensor]) -> bytes:
    """The 8-byte length and JSON header of a safetensors file holding `tensors`; data follows it."""
    header = {"__metadata__": {"format": "pt"}}
    for t in tensors:
        header[t.name] = {"dtype": SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape),
                          "data_offsets": [t.begin, t.begin + t.nbytes]}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data section starts 8-byte aligned, as safetensors writes it
    return len(blob).to_bytes(8, "little") + blob


def create_files(out_dir: str, files: list[list[OutTensor]]) -> list[str]:
    """Create every output file with its header at its full size (holes for now), for writers to fill."""
    names = file_names(len(files))
    for name, tensors in zip(names, files):
        head = safetensors_header(tensors)
        fd = os.open(os.path.join(out_dir, name), os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, head)
            os.ftruncate(fd, len(head) + sum(t.nbytes for t in tensors))
        finally:
            os.close(fd)
    return names


def write_index(out_dir: str, files: list[list[OutTensor]], names: list[str]) -> None:
    if len(files) == 1:
        return  # a single model.safetensors needs no index, as save_pretrained does it
    index = {"metadata": {"total_parameters": sum(math.prod(t.shape) for ts in files for t in ts),
                          "total_size": sum(t.nbytes for ts in files for t in ts)},
             "weight_map": {t.name: names[t.file] for ts in files for t in ts}}
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f, indent=2)


def write_model_files(model_dir: str, tok_dir: str, out_dir: str, config, cls_name: str, dtype) -> None:
    """config.json (architectures and dtype set for vLLM and from_pretrained), generation config, tokenizer."""
    from transformers import AutoTokenizer, GenerationConfig

    config.architectures = [cls_name]
    config.dtype = dtype
    config.save_pretrained(out_dir)
    if os.path.isfile(os.path.join(model_dir, "generation_config.json")):
        gen = GenerationConfig.from_pretrained(model_dir)
    else:
        gen = GenerationConfig.from_model_config(config)
    gen.save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(tok_dir).save_pretrained(out_dir)


def replace_dir(tmp: str, out_dir: str) -> None:
    """Move the finished folder into place; an older export there is swapped out, then deleted."""
    old = None
    if os.path.exists(out_dir):
        old = f"{out_dir}.old{os.getpid()}"
        os.replace(out_dir, old)
    os.replace(tmp, out_dir)
    if old:
        shutil.rmtree(old, ignore_errors=True)

"""Hugging Face weights in and out: sharded import into the FSDP2 model, streaming export to a HF folder.

    python -m ckpt export runs/tiny/checkpoints/step-000512 runs/tiny/hf --dtype bf16
    python -m pytest tests/test_hf.py

Import (`load_hf_weights`): DCP's HuggingFaceStorageReader plans reads against each rank's DTensor
shards, so a rank reads only its own slices of the safetensors files; the full model never exists in
one place. Export (`export_checkpoint`): one `dcp.load` with no process group whose planner, instead
of filling a state dict, writes each saved chunk straight to its place in the output safetensors
files, so memory peaks at about one saved chunk (a rank's shard of the largest tensor), not the model:
`python bench/export_rss.py` measures it. The files are created at full size first, so writers fill
them in parallel, each its share of the tensors: `--jobs N` processes offline, every rank of the job
for `export.at_end`. The default dtype (`auto`) is the source model's torch_dtype, fp32 for random init.
"""

from __future__ import annotations

import io
import json
import math
import os
import re
import shutil
import sys
import warnings
from dataclasses import dataclass

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, HuggingFaceStorageReader
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.futures import Future

from .commit import VerifyError, verify_checkpoint
from .dtypes import DTYPE_NAMES, DTYPES
from .layout import step_of
from finetune.dist import on_rank0_then_share
from .errors import SAVE_ERRORS, CheckpointError, save_failure
from .schema import schema_of

SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
                      torch.int64: "I64", torch.int32: "I32", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}
_PIECE = 4 << 20  # elements converted and written at a time (16 MiB of fp32)
_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _few(names: list[str], n: int = 4) -> str:
    shown = ", ".join(repr(x) for x in names[:n])
    return shown + (f" (+{len(names) - n} more)" if len(names) > n else "")


def tied_aliases(model: torch.nn.Module) -> dict[str, str]:
    """{alias: source} for parameters registered under two names, e.g. tied embeddings
    {'lm_head.weight': 'model.embed_tokens.weight'}. save_pretrained writes only the source."""
    first, aliases = {}, {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            aliases[name] = first[id(param)]
        else:
            first[id(param)] = name
    return aliases


# ---------------------------------------------------------------- import: HF safetensors -> sharded model

def check_hf_keys(model: torch.nn.Module, model_sd: dict, saved: dict, hf_dir: str) -> list[str]:
    """The state-dict names to read. Missing or unexpected names and shape mismatches are errors that
    name the model class: a silently skipped tensor would leave random or stale weights in training."""
    cls = type(model).__name__
    aliases = tied_aliases(model)
    wanted = [k for k in model_sd if k not in aliases]
    missing = [k for k in wanted if k not in saved]
    # HF's own list of leftovers it ignores on load (e.g. rotary inv_freq in old Llama files)
    ignore = [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or []]
    unexpected = [k for k in saved if k not in model_sd and not any(p.search(k) for p in ignore)]
    if missing or unexpected:
        raise CheckpointError(
            f"{hf_dir} does not fit {cls}: " + "; ".join(
                part for part in (f"missing {_few(missing)}" if missing else "",
                                  f"unexpected {_few(unexpected)}" if unexpected else "") if part) +
            f". Tensor names must be {cls}'s state-dict names, as its save_pretrained writes them")
    for k in wanted:
        if tuple(saved[k].size) != tuple(model_sd[k].shape):
            raise CheckpointError(f"{hf_dir} does not fit {cls}: '{k}' is {list(saved[k].size)} in the files but "
                                  f"{list(model_sd[k].shape)} in the model (config.json and weights disagree?)")
    return wanted


def check_safetensors_files(hf_dir: str) -> None:
    """The reader takes every *.safetensors in the folder, so a stray file from another save would mix in
    silently: with an index, the files must be exactly the ones it lists."""
    present = sorted(f for f in os.listdir(hf_dir) if f.endswith(".safetensors")) if os.path.isdir(hf_dir) else []
    if not present:
        raise CheckpointError(f"no *.safetensors files in {hf_dir}; only safetensors are read (re-save a "
                              "pytorch_model.bin model with save_pretrained(dir, safe_serialization=True))")
    index = os.path.join(hf_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            listed = sorted(set(json.load(f)["weight_map"].values()))
        if listed != present:
            raise CheckpointError(f"{hf_dir}: model.safetensors.index.json lists {_few(listed)} but the folder "
                                  f"holds {_few(present)}; remove the files of other saves")


def load_hf_weights(model: torch.nn.Module, hf_dir: str, process_group=None, file_name=None) -> None:
    """Read a local HF safetensors model (one file, or sharded with an index) into the fully_shard-ed
    `model`, in place, on every rank. bf16/fp16 files are converted to the parameters' dtype as they are
    copied; tied aliases (lm_head.weight) are filled through their source; non-persistent buffers
    (rotary inv_freq) are not in the files and were computed when the model was built.
    `file_name(state-dict name)` gives a tensor's name in the files, or None for one they do not hold
    (LoRA: `q_proj.base_layer.weight` is `q_proj.weight` there, adapters are not there)."""
    check_safetensors_files(hf_dir)
    saved = HuggingFaceStorageReader(hf_dir).read_metadata().state_dict_metadata  # file headers only
    model_sd = get_model_state_dict(model)
    to_model = {k: k for k in model_sd} if file_name is None else \
        {file_name(k): k for k in model_sd if file_name(k) is not None}
    file_sd = {f: model_sd[k] for f, k in to_model.items()}
    state = {k: file_sd[k] for k in check_hf_keys(model, file_sd, saved, hf_dir)}
    dcp.load(state, storage_reader=HuggingFaceStorageReader(hf_dir), process_group=process_group)
    set_model_state_dict(model, {to_model[f]: v for f, v in state.items()},
                         options=StateDictOptions(strict=False))  # tied aliases (and adapters) are absent


# ---------------------------------------------------------------- export: where the pieces come from

def parse_size(text: str) -> int:
    """'2GB' -> 2e9 bytes, '500MB', '100KiB', '123' (bytes); decimal and binary units as HF reads them."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*", str(text), flags=re.IGNORECASE)
    if not m:
        raise ValueError(f"size {text!r} must look like 2GB, 500MB or 100KiB")
    unit = (m.group(2) or "B").upper()
    power = "BKMGT".index(unit[0])
    return int(float(m.group(1)) * ((1024 if "I" in unit else 1000) ** power))


def _existing_dir(path: str) -> str | None:
    for candidate in (path, os.path.join(_REPO_ROOT, path)):  # relative to where training ran, usually here
        if path and os.path.isdir(candidate):
            return candidate
    return None


def source_dirs(ckpt_path: str) -> tuple[str, str]:
    """(model dir with config.json, tokenizer dir) the checkpoint was trained from (its schema, schema.py)."""
    schema = schema_of(ckpt_path)
    named = schema.model_dir
    model_dir = _existing_dir(named)
    if model_dir is None or not os.path.isfile(os.path.join(model_dir, "config.json")):
        raise CheckpointError(f"the model folder this checkpoint was trained from ({named!r}, as its meta.json schema "
                              "records) has no config.json here; run the export from the directory training ran in")
    tok_named = schema.tokenizer_dir or named
    tok_dir = _existing_dir(tok_named)
    if tok_dir is None:
        raise CheckpointError(f"tokenizer folder {tok_named!r} (as the checkpoint's meta.json schema records) "
                              "not found")
    return model_dir, tok_dir


def model_names(config) -> tuple[str, list[str], dict[str, str]]:
    """(class name, state-dict names, tied aliases) of the HF model for `config`, built on `meta`: no memory."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return type(model).__name__, list(model.state_dict()), tied_aliases(model)


# ---------------------------------------------------------------- export: safetensors files written in place

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


def plan_files(saved: dict, names: list[str], dtype: torch.dtype, max_bytes: int,
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


def chunk_runs(offsets, sizes, shape) -> tuple[list[int], int]:
    """Element offsets in the full row-major tensor where a saved chunk's contiguous runs start, and the
    run length. An FSDP dim-0 shard is one run; a chunk split on a later dim is one run per row prefix."""
    k = len(shape)
    while k > 0 and offsets[k - 1] == 0 and sizes[k - 1] == shape[k - 1]:
        k -= 1
    if k == 0:
        return [0], math.prod(shape)
    strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
    run = sizes[k - 1] * strides[k - 1]
    starts = [offsets[k - 1] * strides[k - 1]]
    for d in reversed(range(k - 1)):  # every index of the dims before the partial one, row-major
        starts = [(offsets[d] + i) * strides[d] + s for i in range(sizes[d]) for s in starts]
    return starts, run


class ChunkToFilePlanner(LoadPlanner):
    """A DCP load planner with no state dict: it asks for every saved chunk of the exported tensors and
    writes each one, converted a piece at a time, to its place in the output files as soon as it is read."""

    def __init__(self, tensors: dict[str, OutTensor], fds: list[tuple[int, int]], prefix: str):
        self.tensors, self.fds, self.prefix = tensors, fds, prefix

    def set_up_planner(self, state_dict, metadata: Metadata | None = None, is_coordinator: bool = False) -> None:
        self.metadata = metadata

    def create_local_plan(self) -> LoadPlan:
        items = []
        for name in self.tensors:
            for chunk in self.metadata.state_dict_metadata[self.prefix + name].chunks:
                index = MetadataIndex(self.prefix + name, chunk.offsets)
                items.append(ReadItem(LoadItemType.TENSOR, index, chunk.offsets, index,
                                      torch.Size([0] * len(chunk.sizes)), chunk.sizes))
        return LoadPlan(items)

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        return global_plan

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        return central_plan

    def load_bytes(self, read_item: ReadItem, value) -> None:
        raise CheckpointError(f"{read_item.dest_index.fqn} is not a tensor in the checkpoint")

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        """Only a stock FileSystemReader asks: a buffer it copies the chunk into (SingleCopyReader does not)."""
        saved = self.metadata.state_dict_metadata[read_item.dest_index.fqn].properties.dtype
        return torch.empty(read_item.lengths, dtype=saved)

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        out = self.tensors[read_item.dest_index.fqn[len(self.prefix):]]
        fd, data_start = self.fds[out.file]
        flat, size = tensor.contiguous().reshape(-1), out.dtype.itemsize
        starts, run = chunk_runs(read_item.dest_offsets, read_item.lengths, out.shape)
        for i, start in enumerate(starts):
            for a in range(0, run, _PIECE):  # a bf16 export converts a piece at a time, never a whole chunk
                piece = flat[i * run + a: i * run + min(a + _PIECE, run)].to(out.dtype)
                os.pwrite(fd, piece.view(torch.uint8).numpy(), data_start + out.begin + (start + a) * size)
                out.written += piece.numel() * size


class SingleCopyReader(FileSystemReader):
    """FileSystemReader that hands each chunk to the planner as torch.load returns it. The stock reader
    first copies it into the planner's resolve_tensor buffer, which doubles the export's peak memory.
    Same file walk, transforms and torch.load as FileSystemReader.read_data (torch 2.13), minus that copy."""

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for relative_path, items in per_file.items():
            with self.fs.create_stream(self.fs.concat_path(self.path, relative_path), "rb") as stream:
                for item in items:
                    info = self.storage_data[item.storage_index]
                    data = self.transforms.transform_load_stream(item, info.transform_descriptors or (),
                                                                 self._slice_file(stream, info))
                    if not data.seekable():
                        data = io.BytesIO(data.read())
                    planner.commit_tensor(item, torch.load(data, map_location="cpu", weights_only=True))
        done: Future = Future()
        done.set_result(None)
        return done


def tensor_shares(files: list[list[OutTensor]], n: int) -> list[list[str]]:
    """Split the output tensors over n writers by bytes (largest first to the least loaded), the same everywhere."""
    load, out = [0] * n, [[] for _ in range(n)]
    for t in sorted((t for ts in files for t in ts), key=lambda t: (-t.nbytes, t.name)):
        w = load.index(min(load))
        out[w].append(t.name)
        load[w] += t.nbytes
    return out


def write_share(ckpt_path: str, out_dir: str, files: list[list[OutTensor]], share: list[str]) -> None:
    """Stream the saved chunks of the tensors in `share` into their places in the files create_files made.
    Writers of other shares may run at the same time, in other processes or on other ranks: each one
    touches only its own tensors' byte ranges."""
    names, wanted = file_names(len(files)), set(share)
    fds = [(os.open(os.path.join(out_dir, n), os.O_RDWR), len(safetensors_header(ts))) for n, ts in zip(names, files)]
    tensors = {t.name: t for ts in files for t in ts if t.name in wanted}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "no process group: loading in a single process" is the intent
            dcp.load({}, storage_reader=SingleCopyReader(ckpt_path), planner=ChunkToFilePlanner(tensors, fds, schema_of(ckpt_path).model_prefix),
                     no_dist=True)
        for fd, _ in fds:
            os.fsync(fd)
    finally:
        for fd, _ in fds:
            os.close(fd)
    short = [t.name for t in tensors.values() if t.written != t.nbytes]
    if short:
        raise CheckpointError(f"{ckpt_path}: the saved chunks of {_few(short)} do not cover the whole tensor")


def write_weights(plan: "ExportPlan", jobs: int = 1) -> None:
    """Fill the files start_export created, with `jobs` processes (this one included), a share each."""
    shares = tensor_shares(plan.files, max(1, jobs))
    args = (plan.ckpt_path, plan.tmp, plan.files)
    if jobs <= 1:
        write_share(*args, shares[0])
        return
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    with ProcessPoolExecutor(jobs - 1, mp_context=multiprocessing.get_context("spawn")) as pool:
        others = [pool.submit(write_share, *args, share) for share in shares[1:]]
        write_share(*args, shares[0])
        for f in others:
            f.result()


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


def _replace_dir(tmp: str, out_dir: str) -> None:
    """Move the finished folder into place; an older export there is swapped out, then deleted."""
    old = None
    if os.path.exists(out_dir):
        old = f"{out_dir}.old{os.getpid()}"
        os.replace(out_dir, old)
    os.replace(tmp, out_dir)
    if old:
        shutil.rmtree(old, ignore_errors=True)


# ---------------------------------------------------------------- export: the entry points

@dataclass
class ExportPlan:
    """Everything an export writer needs, computed the same on every rank / process from the checkpoint."""
    ckpt_path: str
    out_dir: str
    model_dir: str
    tok_dir: str
    config: object
    cls_name: str
    names: list[str]
    files: list[list[OutTensor]]
    dtype: torch.dtype

    @property
    def tmp(self) -> str:
        return f"{self.out_dir}.tmp-export"  # the same name on every rank: ranks fill one folder

    def summary(self) -> dict:
        return {"path": self.out_dir, "class": self.cls_name, "tensors": len(self.names), "files": len(self.files),
                "bytes": sum(t.nbytes for ts in self.files for t in ts), "dtype": DTYPE_NAMES[self.dtype]}


def source_dtype(ckpt_path: str, config) -> torch.dtype:
    """The export dtype `auto` means: the source model's torch_dtype when training started from its weights
    (the schema's `pretrained`, from meta.json), fp32 for a random init (nothing to follow) or a non-float /
    unknown dtype."""
    pretrained = schema_of(ckpt_path).pretrained
    found = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(found, str):
        found = getattr(torch, found, None)
    return found if pretrained and found in DTYPE_NAMES else torch.float32


def plan_export(ckpt_path: str, out_dir: str, dtype: str = "auto", max_shard_size: str = "2GB") -> ExportPlan:
    """Check the checkpoint against the model it was trained from and lay out the output files."""
    from transformers import AutoConfig

    if os.path.lexists(out_dir) and (os.path.islink(out_dir) or not os.path.isdir(out_dir)):
        raise CheckpointError(f"{os.path.normpath(out_dir)} exists and is not a folder; choose a new folder")
    model_dir, tok_dir = source_dirs(ckpt_path)
    config = AutoConfig.from_pretrained(model_dir)
    cls_name, names, aliases = model_names(config)
    saved = FileSystemReader(ckpt_path).read_metadata().state_dict_metadata
    names = [n for n in names if n not in aliases]  # save_pretrained writes the tied source only
    prefix = schema_of(ckpt_path).model_prefix
    in_ckpt = {k[len(prefix):] for k in saved if k.startswith(prefix)}
    missing, extra = [n for n in names if n not in in_ckpt], sorted(in_ckpt - set(names) - set(aliases))
    if missing or extra:
        raise CheckpointError(f"{ckpt_path} is not a checkpoint of {cls_name} from {model_dir}: "
                              f"missing {_few(missing)}, extra {_few(extra)}")
    out_dtype = source_dtype(ckpt_path, config) if dtype == "auto" else DTYPES[dtype]
    files = plan_files(saved, names, out_dtype, parse_size(max_shard_size), prefix)
    return ExportPlan(ckpt_path, os.path.normpath(out_dir), model_dir, tok_dir, config, cls_name, names, files,
                      out_dtype)


def check_export(ckpt_path: str, out_dir: str, overwrite: bool, verify: bool, jobs: int = 1) -> None:
    if not overwrite and os.path.isdir(out_dir) and os.listdir(out_dir):
        raise CheckpointError(f"{out_dir} exists and is not empty; choose a new folder")
    if verify:
        try:
            verify_checkpoint(ckpt_path, jobs=jobs)
        except VerifyError as e:
            raise CheckpointError(f"cannot export {ckpt_path}: {e}") from None


def start_export(plan: ExportPlan) -> None:
    """One writer, first: a fresh temporary folder with every output file created at full size."""
    shutil.rmtree(plan.tmp, ignore_errors=True)
    os.makedirs(plan.tmp)
    create_files(plan.tmp, plan.files)


def finish_export(plan: ExportPlan) -> None:
    """One writer, after all shares are written: index, config, tokenizer, then the folder moves into place."""
    write_index(plan.tmp, plan.files, file_names(len(plan.files)))
    write_model_files(plan.model_dir, plan.tok_dir, plan.tmp, plan.config, plan.cls_name, plan.dtype)
    _replace_dir(plan.tmp, plan.out_dir)


def export_checkpoint(ckpt_path: str, out_dir: str, dtype: str = "auto", max_shard_size: str = "2GB",
                      overwrite: bool = False, verify: bool = True, jobs: int = 1, adapter: bool = False) -> dict:
    """Write a complete HF model folder from a checkpoint saved at any world size, with `jobs` processes
    and no process group. The folder appears whole or not at all (built beside it, then renamed).
    A LoRA checkpoint is merged into its base (ckpt/adapter.py); adapter=True writes the PEFT adapter alone."""
    check_export(ckpt_path, out_dir, overwrite, verify, jobs)
    from .adapter import export_lora, lora_info
    if adapter or lora_info(ckpt_path) is not None:  # adapters only: that alone, or merged into the base
        return export_lora(ckpt_path, out_dir, dtype, max_shard_size, adapter_only=adapter)
    plan = plan_export(ckpt_path, out_dir, dtype, max_shard_size)
    try:
        start_export(plan)
        write_weights(plan, jobs)
        finish_export(plan)
    except BaseException as e:
        shutil.rmtree(plan.tmp, ignore_errors=True)
        if isinstance(e, SAVE_ERRORS):  # a full disk, DCP's CheckpointException: one line naming the export
            raise save_failure(e, os.path.dirname(plan.out_dir) or ".", f"the export {plan.out_dir}") from e
        raise
    return plan.summary()


def export_on_ranks(ckpt_path: str, out_dir: str, dtype: str = "auto", group=None) -> dict:
    """export_checkpoint with every rank of the job writing its share of the tensors (no verification: the
    caller has just committed it). Call on all ranks; an error on any rank raises on all."""
    import torch.distributed as dist

    from .adapter import export_lora, lora_info

    if lora_info(ckpt_path) is not None:  # merged LoRA: one streaming writer (the base is read once, in order)
        return on_rank0_then_share(lambda: export_lora(ckpt_path, out_dir, dtype), group, CheckpointError)
    plan = plan_export(ckpt_path, out_dir, dtype)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    on_rank0_then_share(lambda: start_export(plan), group, CheckpointError)
    problem = None
    try:
        write_share(plan.ckpt_path, plan.tmp, plan.files, tensor_shares(plan.files, world)[rank])
    except SAVE_ERRORS as e:  # agreed below, re-raised on every rank
        problem = str(save_failure(e, os.path.dirname(plan.out_dir) or ".", f"the export {plan.out_dir}"))
    problems = [None] * world
    dist.all_gather_object(problems, problem, group=group)
    if any(problems):
        on_rank0_then_share(lambda: shutil.rmtree(plan.tmp, ignore_errors=True), group, CheckpointError)
        raise CheckpointError(next(p for p in problems if p))
    on_rank0_then_share(lambda: finish_export(plan), group, CheckpointError)
    return plan.summary()


def export_final(ckpt_path: str, out_dir: str, dtype: str = "auto") -> str:
    """End of training, on every rank: export this job's final checkpoint (committed by this job, so not
    re-hashed) over any earlier export in out_dir, each rank writing its share; returns a log line."""
    import torch.distributed as dist

    if dist.is_initialized():
        info = export_on_ranks(ckpt_path, out_dir, dtype)
    else:
        info = export_checkpoint(ckpt_path, out_dir, dtype, overwrite=True, verify=False)
    return (f"export: step {step_of(ckpt_path)} -> {info['path']} ({info['class']}, {info['files']} safetensors "
            f"file(s), {info['bytes'] / 2**20:.1f} MiB {info['dtype']})")


def export_cli(checkpoint: str, out_dir: str, dtype: str = "auto", max_shard_size: str = "2GB", jobs: int = 1,
               adapter: bool = False) -> int:
    """`python -m ckpt export`: 0 and one OK line, or 2 (bad input, as everywhere) and one error line."""
    try:
        info = export_checkpoint(checkpoint, out_dir, dtype, max_shard_size, jobs=jobs, adapter=adapter)
    except (CheckpointError, OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"OK: {checkpoint} -> {info['path']}: {info['class']}, {info['tensors']} tensors in {info['files']} "
          f"safetensors file(s), {info['bytes'] / 2**20:.1f} MiB {info['dtype']}, "
          f"{info.get('extras', 'with config, generation config, tokenizer')}")
    return 0

"""Export out: a checkpoint as a Hugging Face model folder, full or LoRA behind one entry point, and its CLI.

    python -m ckpt export runs/tiny/checkpoints/step-000512 runs/tiny/hf --dtype bf16
    python -m ckpt export runs/lora/checkpoints/step-000100 out/adapter --adapter   # PEFT adapter folder
    python -m pytest tests/test_hf.py -q -k export

Full checkpoints (`export_checkpoint`): one `dcp.load` with no process group whose planner, instead of
filling a state dict, writes each saved chunk straight to its place in the output safetensors files
(files.py), under the names and in the layout transformers' save_pretrained writes (convert.py: a fused MoE
expert tensor becomes one tensor per expert, a chunk written to each expert it holds), so memory peaks at
about one saved chunk (a rank's shard of the largest tensor), not the model: `python bench/export_rss.py`
measures it. The files are created at full size first, so writers fill
them in parallel, each its share of the tensors: `--jobs N` processes offline, every rank of the job for
`export.at_end`. LoRA checkpoints go to adapter.py (merged into the base, or the adapter alone). The
default dtype (`auto`) is the source model's torch_dtype, fp32 for random init.
"""

from __future__ import annotations

import io
import math
import multiprocessing
import os
import shutil
import sys
import tempfile
import warnings
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem

from common.dist import on_rank0_then_share
from common.dtypes import DTYPE_NAMES, DTYPES
from ..commit_protocol import VerifyError, verify_checkpoint
from ..errors import SAVE_ERRORS, CheckpointError, save_failure
from ..layout import step_of
from ..lora_base import lora_info
from ..reading import dcp_metadata, few, meta_model, model_names, source_dirs, source_dtype
from ..schema import schema_of
from ..storage import reader_with, storage_for
from .adapter import export_lora
from .convert import Placement, memory_to_hub, overlap
from .files import (OutTensor, assign_files, create_files, file_names, parse_size, replace_dir, safetensors_header,
                    write_index, write_model_files)

_PIECE = 4 << 20  # elements converted and written at a time (16 MiB of fp32)


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


def chunk_part(chunk_offsets, chunk_sizes, p: Placement):
    """The part of a saved chunk (offsets, sizes in the in-memory tensor) that file tensor `p` holds: (the slices
    of the chunk, its offsets and sizes in the file tensor), or None when they do not meet."""
    box = overlap(chunk_offsets, chunk_sizes, p)
    if box is None:
        return None
    (lo, hi), kept = box, [d for d in range(len(chunk_offsets)) if d not in p.dropped]
    return (tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, chunk_offsets)),
            [lo[d] - p.start[d] for d in kept], [hi[d] - lo[d] for d in kept])


class ChunkToFilePlanner(LoadPlanner):
    """A DCP load planner with no state dict: it asks for every saved chunk of the exported tensors and
    writes each one, converted a piece at a time, to its place in the output files as soon as it is read;
    a fused tensor (MoE experts) to each file tensor it holds part of (convert.py's Placements)."""

    def __init__(self, tensors: dict[str, list[tuple[OutTensor, Placement]]], fds: list[tuple[int, int]], prefix: str):
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
        """Only a stock FileSystemReader asks: a buffer it copies the chunk into (SingleCopyRead does not)."""
        saved = self.metadata.state_dict_metadata[read_item.dest_index.fqn].properties.dtype
        return torch.empty(read_item.lengths, dtype=saved)

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        for out, placement in self.tensors[read_item.dest_index.fqn[len(self.prefix):]]:
            part = chunk_part(read_item.dest_offsets, read_item.lengths, placement)
            if part is not None:
                self.write_part(out, tensor[part[0]], part[1], part[2])

    def write_part(self, out: OutTensor, tensor: torch.Tensor, offsets, sizes) -> None:
        """Write `tensor` (sizes `sizes`) to its place (offsets) in output tensor `out`."""
        fd, data_start = self.fds[out.file]
        flat, size = tensor.contiguous().reshape(-1), out.dtype.itemsize
        starts, run = chunk_runs(offsets, sizes, out.shape)
        for i, start in enumerate(starts):
            for a in range(0, run, _PIECE):  # a bf16 export converts a piece at a time, never a whole chunk
                piece = flat[i * run + a: i * run + min(a + _PIECE, run)].to(out.dtype)
                os.pwrite(fd, piece.view(torch.uint8).numpy(), data_start + out.begin + (start + a) * size)
                out.written += piece.numel() * size


def commit_whole_chunk(item: ReadItem, data, planner: LoadPlanner) -> None:
    """Hand a saved chunk to the planner as torch.load returns it, with no copy into a resolve_tensor buffer."""
    if not data.seekable():
        data = io.BytesIO(data.read())
    planner.commit_tensor(item, torch.load(data, map_location="cpu", weights_only=True))


class SingleCopyRead:
    """A DCP reader (any backend's, ckpt.storage.reader_with) that hands each chunk to the planner as torch.load
    returns it. The stock reader first copies it into the planner's resolve_tensor buffer, which doubles the
    export's peak memory. Same file walk, transforms and torch.load (on S3: parallel ranged GETs), minus that copy."""

    def load_item(self, req, stream, planner) -> None:
        commit_whole_chunk(req, stream, planner)


def chunk_reader(ckpt_path: str):
    return reader_with(SingleCopyRead, ckpt_path)


def tensor_shares(files: list[list[OutTensor]], placements: list[Placement], n: int) -> list[list[str]]:
    """Split the checkpoint's tensors over n writers by output bytes (largest first to the least loaded), the
    same everywhere; each writer reads its tensors' saved chunks once and writes every file tensor they fill."""
    nbytes = {t.name: t.nbytes for ts in files for t in ts}
    per_name: dict[str, int] = {}
    for p in placements:
        per_name[p.name] = per_name.get(p.name, 0) + nbytes[p.key]
    load, out = [0] * n, [[] for _ in range(n)]
    for name, size in sorted(per_name.items(), key=lambda kv: (-kv[1], kv[0])):
        w = load.index(min(load))
        out[w].append(name)
        load[w] += size
    return out


def write_share(ckpt_path: str, out_dir: str, files: list[list[OutTensor]], placements: list[Placement],
                share: list[str]) -> None:
    """Stream the saved chunks of the checkpoint tensors in `share` into their places in the files create_files
    made. Writers of other shares may run at the same time, in other processes or on other ranks: each one
    touches only its own tensors' byte ranges."""
    names, wanted = file_names(len(files)), set(share)
    fds = [(os.open(os.path.join(out_dir, n), os.O_RDWR), len(safetensors_header(ts))) for n, ts in zip(names, files)]
    by_key = {t.name: t for ts in files for t in ts}
    tensors: dict[str, list[tuple[OutTensor, Placement]]] = {}
    for p in placements:
        if p.name in wanted:
            tensors.setdefault(p.name, []).append((by_key[p.key], p))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "no process group: loading in a single process" is the intent
            dcp.load({}, storage_reader=chunk_reader(ckpt_path), planner=ChunkToFilePlanner(tensors, fds, schema_of(ckpt_path).model_prefix),
                     no_dist=True)
        for fd, _ in fds:
            os.fsync(fd)
    finally:
        for fd, _ in fds:
            os.close(fd)
    short = [t.name for ts in tensors.values() for t, _ in ts if t.written != t.nbytes]
    if short:
        raise CheckpointError(f"{ckpt_path}: the saved chunks of {few(short)} do not cover the whole tensor")


def write_weights(job: "ExportJob", jobs: int = 1) -> None:
    """Fill the files start_export created, with `jobs` processes (this one included), a share each."""
    shares = tensor_shares(job.files, job.placements, max(1, jobs))
    args = (job.ckpt_path, job.tmp, job.files, job.placements)
    if jobs <= 1:
        write_share(*args, shares[0])
        return
    with ProcessPoolExecutor(jobs - 1, mp_context=multiprocessing.get_context("spawn")) as pool:
        others = [pool.submit(write_share, *args, share) for share in shares[1:]]
        write_share(*args, shares[0])
        for f in others:
            f.result()


@dataclass
class ExportJob:
    """Everything an export writer needs, computed the same on every rank / process from the checkpoint."""
    ckpt_path: str
    out_dir: str
    model_dir: str
    tok_dir: str
    config: object
    cls_name: str
    placements: list[Placement]  # the tensors save_pretrained writes, each from its checkpoint tensor
    files: list[list[OutTensor]]
    dtype: torch.dtype

    @property
    def tmp(self) -> str:
        return f"{self.out_dir}.tmp-export"  # the same name on every rank: ranks fill one folder

    def summary(self) -> dict:
        return {"path": self.out_dir, "class": self.cls_name, "tensors": len(self.placements), "files": len(self.files),
                "bytes": sum(t.nbytes for ts in self.files for t in ts), "dtype": DTYPE_NAMES[self.dtype]}


def prepare_export(ckpt_path: str, out_dir: str, dtype: str = "auto", max_shard_size: str = "2GB") -> ExportJob:
    """Check the checkpoint against the model it was trained from and lay out the output files."""
    from transformers import AutoConfig

    if os.path.lexists(out_dir) and (os.path.islink(out_dir) or not os.path.isdir(out_dir)):
        raise CheckpointError(f"{os.path.normpath(out_dir)} exists and is not a folder; choose a new folder")
    model_dir, tok_dir = source_dirs(ckpt_path)
    config = AutoConfig.from_pretrained(model_dir)
    model = meta_model(config)
    cls_name, names, aliases = model_names(model)
    saved = dcp_metadata(ckpt_path).state_dict_metadata
    names = [n for n in names if n not in aliases]  # save_pretrained writes the tied source only
    prefix = schema_of(ckpt_path).model_prefix
    in_ckpt = {k[len(prefix):] for k in saved if k.startswith(prefix)}
    missing, extra = [n for n in names if n not in in_ckpt], sorted(in_ckpt - set(names) - set(aliases))
    if missing or extra:
        raise CheckpointError(f"{ckpt_path} is not a checkpoint of {cls_name} from {model_dir}: "
                              f"missing {few(missing)}, extra {few(extra)}")
    out_dtype = source_dtype(ckpt_path, config) if dtype == "auto" else DTYPES[dtype]
    placements = memory_to_hub(model, {n: tuple(saved[prefix + n].size) for n in names})  # save_pretrained's names
    out = {p.key: TensorStorageMetadata(saved[prefix + p.name].properties, torch.Size(p.shape), []) for p in placements}
    files = assign_files(out, [p.key for p in placements], out_dtype, parse_size(max_shard_size))
    return ExportJob(ckpt_path, os.path.normpath(out_dir), model_dir, tok_dir, config, cls_name, placements, files,
                     out_dtype)


def check_export(ckpt_path: str, out_dir: str, overwrite: bool, verify: bool, jobs: int = 1) -> None:
    if not overwrite and os.path.isdir(out_dir) and os.listdir(out_dir):
        raise CheckpointError(f"{out_dir} exists and is not empty; choose a new folder")
    if verify:
        try:
            verify_checkpoint(ckpt_path, jobs=jobs)
        except VerifyError as e:
            raise CheckpointError(f"cannot export {ckpt_path}: {e}") from None


def start_export(job: ExportJob) -> None:
    """One writer, first: a fresh temporary folder with every output file created at full size."""
    shutil.rmtree(job.tmp, ignore_errors=True)
    os.makedirs(job.tmp)
    create_files(job.tmp, job.files)


def finish_export(job: ExportJob) -> None:
    """One writer, after all shares are written: index, config, tokenizer, then the folder moves into place."""
    write_index(job.tmp, job.files, file_names(len(job.files)))
    write_model_files(job.model_dir, job.tok_dir, job.tmp, job.config, job.cls_name, job.dtype)
    replace_dir(job.tmp, job.out_dir)


def export_checkpoint(ckpt_path: str, out_dir: str, dtype: str = "auto", max_shard_size: str = "2GB",
                      overwrite: bool = False, verify: bool = True, jobs: int = 1, adapter: bool = False) -> dict:
    """Write a complete HF model folder from a checkpoint saved at any world size, with `jobs` processes
    and no process group. The folder appears whole or not at all (built beside it, then renamed).
    A LoRA checkpoint is merged into its base (ckpt/hf/adapter.py); adapter=True writes the PEFT adapter alone.
    The checkpoint may be on S3, and so may `out_dir` (export_to_object_store)."""
    if not storage_for(out_dir).atomic_rename:  # an object store: built here, then uploaded
        return export_to_object_store(ckpt_path, out_dir, dtype, max_shard_size, overwrite, verify, jobs, adapter)
    check_export(ckpt_path, out_dir, overwrite, verify, jobs)
    if adapter or lora_info(ckpt_path) is not None:  # adapters only: that alone, or merged into the base
        return export_lora(ckpt_path, out_dir, dtype, max_shard_size, adapter_only=adapter)
    job = prepare_export(ckpt_path, out_dir, dtype, max_shard_size)
    try:
        start_export(job)
        write_weights(job, jobs)
        finish_export(job)
    except BaseException as e:
        shutil.rmtree(job.tmp, ignore_errors=True)
        if isinstance(e, SAVE_ERRORS):  # a full disk, DCP's CheckpointException: one line naming the export
            raise save_failure(e, os.path.dirname(job.out_dir) or ".", f"the export {job.out_dir}") from e
        raise
    return job.summary()


def export_to_object_store(ckpt_path: str, out_url: str, dtype: str, max_shard_size: str, overwrite: bool,
                           verify: bool, jobs: int, adapter: bool) -> dict:
    """export_checkpoint to s3://: the folder is built in a local temporary one ($TMPDIR needs room for the model's
    bytes: safetensors are filled in place, which an object cannot be), then uploaded in parallel parts with
    config.json last, so a reader that starts from config.json finds every file; a failed upload deletes what it
    sent."""
    store = storage_for(out_url)
    if store.listdir(out_url):
        if not overwrite:
            raise CheckpointError(f"{out_url} is not empty; choose a new prefix")
        store.delete_tree(out_url)
    with tempfile.TemporaryDirectory(prefix="ckpt-export-") as tmp:
        info = export_checkpoint(ckpt_path, os.path.join(tmp, "hf"), dtype, max_shard_size, True, verify, jobs, adapter)
        try:
            store.put_folder(os.path.join(tmp, "hf"), out_url)
        except OSError as e:
            raise CheckpointError(f"uploading the export to {out_url} failed (what was sent is deleted): {e}") from e
    return {**info, "path": out_url}


def export_on_ranks(ckpt_path: str, out_dir: str, dtype: str = "auto", group=None) -> dict:
    """export_checkpoint with every rank of the job writing its share of the tensors (no verification: the
    caller has just committed it). Call on all ranks; an error on any rank raises on all."""

    if lora_info(ckpt_path) is not None:  # merged LoRA: one streaming writer (the base is read once, in order)
        return on_rank0_then_share(lambda: export_lora(ckpt_path, out_dir, dtype), group, CheckpointError)
    job = prepare_export(ckpt_path, out_dir, dtype)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    on_rank0_then_share(lambda: start_export(job), group, CheckpointError)
    problem = None
    try:
        share = tensor_shares(job.files, job.placements, world)[rank]
        write_share(job.ckpt_path, job.tmp, job.files, job.placements, share)
    except SAVE_ERRORS as e:  # agreed below, re-raised on every rank
        problem = str(save_failure(e, os.path.dirname(job.out_dir) or ".", f"the export {job.out_dir}"))
    problems = [None] * world
    dist.all_gather_object(problems, problem, group=group)
    if any(problems):
        on_rank0_then_share(lambda: shutil.rmtree(job.tmp, ignore_errors=True), group, CheckpointError)
        raise CheckpointError(next(p for p in problems if p))
    on_rank0_then_share(lambda: finish_export(job), group, CheckpointError)
    return job.summary()


def export_final(ckpt_path: str, out_dir: str, dtype: str = "auto", group=None) -> str:
    """End of training, on every rank: export this job's final checkpoint (committed by this job, so not
    re-hashed) over any earlier export in out_dir, each rank writing its share; returns a log line. `group`: the
    checkpoint group, whose timeout (ckpt.timeout_minutes) the others' wait for rank 0's LoRA merge needs; the
    default group's is a training step's."""
    if dist.is_initialized():
        info = export_on_ranks(ckpt_path, out_dir, dtype, group)
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

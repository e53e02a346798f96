"""Rewrite a checkpoint as if W' ranks had saved it, offline, on CPU: no GPU and no training job needed.

    python -m ckpt reshard runs/a/checkpoints/step-000008 runs/b/checkpoints --world-size 3
    python -m ckpt reshard <src step dir> <dst step dir> --world-size 3

Training already resumes at any world size straight from the original (DCP reshards on load). Resharding
ahead of time gives each new rank exactly one file to read, and a result to `python -m ckpt verify`
before the big job starts. This starts W' processes (gloo on 127.0.0.1); each rebuilds the state skeleton
from the checkpoint's .metadata - tensors of 1+ dims as DTensors sharded on dim 0 over a 1-D mesh, as
FSDP2 shards them; scalars and bytes items (train state, scheduler, param groups, RNG) whole - loads it
with dcp.load and writes it with dcp.save. Rank 0 writes meta.json and config.yaml and commits last.

RNG: the per-rank RNG blobs of the ranks that trained are carried over unchanged and meta.json records
`rng_world_size`, so resuming the copy behaves exactly like resuming the original: RNG restored per
rank at the original world size, re-derived from (seed, step, rank) at any other (train_fsdp.resume).
"""

from __future__ import annotations

import json
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Shard
from torch.distributed.tensor import empty as dtensor_empty

from common.words import plural
from .checksum import ChecksummingWriter
from .commit_protocol import VerifyError, commit_checkpoint, verify_checkpoint
from .describe import is_dim0_sharded, world_size_problem
from .layout import (CONFIG_FILE, META_FILE, is_marked_committed, list_step_dirs, read_meta, read_saved_config, step_dir,
                     step_of)
from .state import rng_world_size
from .storage import join, storage_for


class ReshardError(RuntimeError):
    """The reshard cannot start; the message says why and what to change."""


def prepare_destination(src: str, dst: str, world_size: int) -> str:
    """Check src and W', and return the (empty, created) destination step directory.

    A dst that is not a step-NNNNNN folder is taken as a ckpt.dir and gets src's step folder name,
    so `ckpt.dir=<dst> ckpt.resume=auto` finds it.
    """
    if list_step_dirs(src):
        raise ReshardError(f"{src} is a ckpt.dir; give one of its step-NNNNNN checkpoints "
                           f"(`python -m ckpt inspect {src}` lists them)")
    try:
        verify_checkpoint(src)
    except VerifyError as e:
        raise ReshardError(f"source is not a committed, verified checkpoint: {e}") from None
    problem = world_size_problem(src, world_size)
    if problem:
        raise ReshardError(problem)
    if step_of(dst) is None and step_of(src) is not None:
        dst = step_dir(dst, step_of(src))
    if _where(dst) == _where(src):
        raise ReshardError("destination is the source; write the resharded copy somewhere else")
    store = storage_for(dst)
    if store.occupied(dst):  # a folder, or objects under an s3:// prefix
        if is_marked_committed(dst):
            raise ReshardError(f"{dst} already holds a committed checkpoint; remove it or pick another destination")
        if step_of(dst) is None and store.listdir(dst):
            raise ReshardError(f"{dst} exists and is not empty")
        # an uncommitted step folder: the leftover of a reshard that crashed
        store.delete_tree(dst)
    store.prepare_folder(dst)  # an object store has no folders
    return dst


def _where(path: str) -> str:
    """`path` as one spelling: absolute for a folder, the URL without a trailing / for an object store."""
    return storage_for(path).spelling(path)


def _set_nested(root: dict, path: tuple, value) -> None:
    """root[path[0]][path[1]]... = value, creating dicts (str keys) and lists (int keys) on the way."""
    node = root
    for key, nxt in zip(path[:-1], path[1:]):
        child = [] if isinstance(nxt, int) else {}
        if isinstance(node, list):
            node.extend([None] * (key + 1 - len(node)))
            node[key] = child if node[key] is None else node[key]
        else:
            node.setdefault(key, child)
        node = node[key]
    if isinstance(node, list):
        node.extend([None] * (path[-1] + 1 - len(node)))
    node[path[-1]] = value


def state_skeleton(metadata: Metadata, saved_world: int, mesh: DeviceMesh) -> dict:
    """Empty state with the checkpoint's structure (DCP's flatten mappings), ready for dcp.load to fill:
    dim-0 sharded tensors as Shard(0) DTensors (this rank's slice only), the rest whole."""
    mappings = metadata.planner_data or {}
    state: dict = {}
    for key, md in metadata.state_dict_metadata.items():
        if not isinstance(md, TensorStorageMetadata):
            value = None  # a bytes item: dcp.load puts the stored object here
        elif is_dim0_sharded(md, saved_world):
            value = dtensor_empty(*md.size, dtype=md.properties.dtype, device_mesh=mesh, placements=[Shard(0)])
        else:
            value = torch.empty(md.size, dtype=md.properties.dtype)
        _set_nested(state, tuple(mappings.get(key, (key,))), value)
    return state


def write_files_and_commit(src: str, dst: str, world_size: int, metadata: Metadata) -> None:
    """Rank 0, after every rank's shards and .metadata are written: meta.json, config.yaml, then the marker."""
    meta = read_meta(src, missing_ok=True)
    meta.update(world_size=world_size, rng_world_size=rng_world_size(meta), resharded_from=_where(src),
                resharded_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    store = storage_for(dst)
    store.create(join(dst, META_FILE), (json.dumps(meta, indent=1) + "\n").encode())
    own = [META_FILE]
    config = read_saved_config(src)
    if config is not None:
        store.create(join(dst, CONFIG_FILE), config.encode())
        own.append(CONFIG_FILE)
    commit_checkpoint(dst, world_size, metadata.file_digests, metadata, own)


def _reshard_rank(rank: int, world_size: int, port: int, src: str, dst: str) -> None:
    """One of the W' processes: load this rank's slices from src, save them to dst."""
    torch.set_num_threads(1)  # W' processes share the machine's cores
    store = dist.TCPStore("127.0.0.1", port, is_master=False)  # reshard's own, bound before this process started
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    try:
        mesh = init_device_mesh("cpu", (world_size,))
        metadata = storage_for(src).dcp_reader(src).read_metadata()
        saved_world = int(read_meta(src, missing_ok=True).get("world_size", 1))
        state = state_skeleton(metadata, saved_world, mesh)
        dcp.load(state, storage_reader=storage_for(src).dcp_reader(src))
        saved = dcp.save(state, storage_writer=ChecksummingWriter(dst))
        if rank == 0:
            write_files_and_commit(src, dst, world_size, saved)
        dist.barrier()  # nobody exits (and tears down the group) before the commit
    finally:
        dist.destroy_process_group()


def reshard(src: str, dst: str, world_size: int) -> int:
    """`python -m ckpt reshard`: returns 0 once dst is committed, 1 (with a message) otherwise."""
    try:
        dst = prepare_destination(src, dst, world_size)
    except ReshardError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    t0 = time.perf_counter()
    # the processes meet at a store bound here first: a port only picked here would be free again until the
    # first of them binds it, after its imports, and any connection on the machine can take it meanwhile
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    try:
        mp.start_processes(_reshard_rank, args=(world_size, store.port, src, dst), nprocs=world_size,
                           start_method="spawn")
    except mp.ProcessException as e:
        print(f"error: reshard to {dst} failed (left uncommitted, so never resumed from): {e}", file=sys.stderr)
        return 1
    saved = read_meta(src, missing_ok=True).get("world_size", "?")
    print(f"resharded {src} ({plural(saved, 'rank')}) -> {dst} ({plural(world_size, 'rank')}), committed in "
          f"{time.perf_counter() - t0:.1f}s")
    return 0

"""Look inside checkpoints without a GPU or a process group: list them, show one, dry-run a world-size change.

    python -m ckpt inspect runs/tiny/checkpoints                              # step, world size, size, status
    python -m ckpt inspect runs/tiny/checkpoints/step-000200                  # train state, sizes by group
    python -m ckpt inspect runs/tiny/checkpoints/step-000200 --tensors        # every key, shape and dtype
    python -m ckpt inspect runs/tiny/checkpoints/step-000200 --world-size 3   # can it resume at 3 ranks?

Reads meta.json, config.yaml, DCP's .metadata and the few small bytes items of the train state (a no-dist
dcp.load of just those keys), so it costs the same for a tiny model and a 70B one. Exit status 1 when the
path holds no checkpoint, the checkpoint shown is not committed and verified, or the dry run finds the
resume would fail; 0 otherwise (a listing is 0 even when it shows bad checkpoints).
"""

from __future__ import annotations

import math
import sys
from collections import defaultdict

from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata

from common.dist import divisibility_problem
from common.words import plural
from .commit_protocol import VerifyError, verify_checkpoint
from .layout import META_FILE, is_marked_committed, list_step_dirs, read_meta, step_of
from .lora_base import describe_lora
from .reading import dcp_metadata, read_items
from .schema import schema_of
from .state import DERIVED_SEED, restores_rng, rng_key, rng_world_size
from .storage import storage_for

# ---------------------------------------------------------------- reading one checkpoint

def world_size_problem(path: str, world_size: int) -> str | None:
    """Why `path` cannot resume at `world_size` ranks, or None: a value its schema says the world size
    must divide (the trainer's batch rule, common.dist.divisibility_problem) that it does not."""
    if world_size < 1:
        return f"world size must be >= 1, got {world_size}"
    problems = [divisibility_problem(k, v, world_size) for k, v in schema_of(path).divides.items()]
    return next((p for p in problems if p), None)


def checkpoint_status(path: str) -> tuple[bool, str]:
    """(resumable, words): committed and verified, uncommitted, or corrupt with the reason."""
    try:
        verify_checkpoint(path)
        return True, "committed, verified"
    except VerifyError as e:
        if not is_marked_committed(path):
            return False, "uncommitted (no commit.json: a save that never finished)"
        return False, f"CORRUPT: {e}"


def _dir_bytes(path: str) -> int:
    return sum(storage_for(path).sizes(path).values())


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


# ---------------------------------------------------------------- how shards move to W' ranks

def is_dim0_sharded(md: TensorStorageMetadata, saved_world: int) -> bool:
    """FSDP2 shards every parameter (and its optimizer state) on dim 0; 0-dim tensors (Adam's step) and
    tensors that W > 1 ranks saved as one chunk (replicated buffers) are plain, read whole."""
    return len(md.size) > 0 and not (saved_world > 1 and len(md.chunks) == 1)


def dim0_range(rows: int, rank: int, world_size: int) -> tuple[int, int]:
    """Rows of rank r under Shard(0): torch.chunk semantics (ceil-sized pieces, the last ones short or empty)."""
    c = math.ceil(rows / world_size)
    return min(rows, rank * c), min(rows, (rank + 1) * c)


def remap_reads(metadata: Metadata, saved_world: int, world_size: int) -> dict[int, dict[str, int]]:
    """For each new rank, bytes it reads from each saved file to fill its dim-0 shards."""
    files = {(i.fqn, tuple(i.offset or ())): s.relative_path for i, s in metadata.storage_data.items()}
    reads: dict[int, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for key, md in metadata.state_dict_metadata.items():
        if not isinstance(md, TensorStorageMetadata) or not is_dim0_sharded(md, saved_world):
            continue
        row_bytes = math.prod(md.size[1:]) * md.properties.dtype.itemsize
        for r in range(world_size):
            lo, hi = dim0_range(md.size[0], r, world_size)
            for ch in md.chunks:
                overlap = min(hi, ch.offsets[0] + ch.sizes[0]) - max(lo, ch.offsets[0])
                if overlap > 0:
                    reads[r][files[(key, tuple(ch.offsets))]] += overlap * row_bytes
    return reads


# ---------------------------------------------------------------- the three views

def list_checkpoints(ckpt_dir: str) -> int:
    dirs = list_step_dirs(ckpt_dir)
    if not dirs:
        print(f"error: {ckpt_dir}: no step-NNNNNN checkpoints", file=sys.stderr)
        return 1
    print(f"{'step':>8}  {'world':>5}  {'size':>10}  {'score':>9}  status")
    for step, path in dirs:
        meta = read_meta(path, missing_ok=True)
        world = meta.get("world_size", "?")
        if meta.get("rng_world_size", world) != world:
            world = f"{world}*"  # resharded: RNG blobs still from the original world size
        score = f"{meta['score']:.4f}" if "score" in meta else "-"  # the eval loss ckpt.keep_best ranks by
        print(f"{step:>8}  {world!s:>5}  {_mib(_dir_bytes(path)):>10}  {score:>9}  {checkpoint_status(path)[1]}")
    return 0


def show_checkpoint(path: str, tensors_too: bool = False) -> int:
    meta = read_meta(path, missing_ok=True)
    ok, status = checkpoint_status(path)
    saved_by = plural(meta.get('world_size', '?'), 'rank')
    print(f"{path}: step {meta.get('step', step_of(path))}, saved by {saved_by}, {status}")
    if "score" in meta:
        print(f"  score (eval loss) {meta['score']:.6f}")
    lora_line = describe_lora(meta, _dir_bytes(path), schema_of(path))
    if lora_line:
        print(f"  {lora_line}")
    if meta.get("resharded_from"):
        print(f"  resharded from {meta['resharded_from']} (RNG blobs of {plural(rng_world_size(meta), 'rank')})")
    try:
        metadata = dcp_metadata(path)
    except Exception as e:  # noqa: BLE001 - a missing or broken .metadata is the whole answer
        print(f"error: {path}: cannot read DCP metadata: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    md = metadata.state_dict_metadata
    train_state = schema_of(path).train_state_keys
    wanted = [k for k in md if k.startswith(train_state) and isinstance(md[k], BytesStorageMetadata)]
    if ok and wanted:
        print("train state:")
        for k, v in sorted(read_items(path, wanted).items()):
            print(f"  {k} = {v}")
    tensors = {k: v for k, v in md.items() if isinstance(v, TensorStorageMetadata)}
    print(f"{plural(len(tensors), 'tensor')} ({_mib(sum(_nbytes(v) for v in tensors.values()))}), "
          f"{plural(len(md) - len(tensors), 'other item')} (bytes: train state, RNG)")
    if tensors_too:
        _print_all_keys(md)
    else:
        _print_key_groups(md, schema_of(path).optim_prefix)
    return 0 if ok else 1


def _nbytes(md: TensorStorageMetadata) -> int:
    return math.prod(md.size) * md.properties.dtype.itemsize


def key_group(key: str, optim_prefix: str) -> str:
    """<model prefix>model.layers.7.mlp.up_proj.weight -> <model prefix>model.layers.*; the optimizer's state
    per kind (<optim prefix>state.*.exp_avg): a few lines for any model size."""
    parts = key.split(".")
    if parts[0].startswith(rng_key(0)[:-1]):
        return rng_key(0)[:-1] + "*"
    if key.startswith(optim_prefix + "state."):
        return f"{optim_prefix}state.*.{parts[-1]}"
    head = []
    for part in parts[:-1]:
        head.append("*" if part.isdigit() else part)
        if part.isdigit():
            break
    return ".".join(head) or key


def _print_key_groups(md: dict, optim_prefix: str) -> None:
    groups: dict[str, list] = defaultdict(lambda: [0, 0, set()])  # tensors, bytes, dtypes
    for k, v in md.items():
        g = groups[key_group(k, optim_prefix)]
        g[0] += 1
        if isinstance(v, TensorStorageMetadata):
            g[1] += _nbytes(v)
            g[2].add(str(v.properties.dtype).replace("torch.", ""))
        else:
            g[2].add("bytes")
    width = max(len(name) for name in groups)
    for name, (count, nbytes, dtypes) in sorted(groups.items(), key=lambda kv: -kv[1][1]):
        print(f"  {name:<{width}}  {plural(count, 'item'):>12}  {_mib(nbytes):>12}  {','.join(sorted(dtypes))}")
    print("  (--tensors lists every key with its shape and dtype)")


def _print_all_keys(md: dict) -> None:
    width = max(len(k) for k in md)
    for k, v in md.items():
        if isinstance(v, TensorStorageMetadata):
            print(f"  {k:<{width}}  {str(list(v.size)):<14} {str(v.properties.dtype).replace('torch.', '')}")
        else:
            print(f"  {k:<{width}}  bytes")


def dry_run(path: str, world_size: int) -> int:
    """Would `train_fsdp.py` resume `path` at `world_size` ranks, and what moves? The rules of resume.py and
    state.py (the RNG rule)."""
    meta = read_meta(path, missing_ok=True)
    saved = meta.get("world_size", "?")
    print(f"dry run: resume {path} (step {meta.get('step', step_of(path))}, saved by {plural(saved, 'rank')}) "
          f"at {plural(world_size, 'rank')}")
    ok, status = checkpoint_status(path)
    problem = None if ok else f"checkpoint is {status}"
    problem = problem or world_size_problem(path, world_size)
    if problem:
        print(f"  NO: {problem}")
        return 1
    schema = schema_of(path)
    for key, value in schema.divides.items():
        print(f"  {key} {value} = {plural(world_size, 'rank')} x {value // world_size} (micro batches adapt)")
    state = read_items(path, [k for k in (schema.position_key, schema.step_key)
                              if k in dcp_metadata(path).state_dict_metadata])
    if schema.position_key in state:
        print(f"  data: continues at global sample {state[schema.position_key]}: the same samples in the same "
              "order as a run that never stopped")
    _print_remap(path, saved if isinstance(saved, int) else 1, world_size)
    if restores_rng(meta, world_size):
        print(f"  RNG: restored per rank from rng_rank0..{world_size - 1}")
    else:
        step = state.get(schema.step_key, meta.get("step"))
        print(f"  RNG: saved by {plural(rng_world_size(meta), 'rank')}, so re-derived on each rank as {DERIVED_SEED} "
              f"(seed {meta.get('seed', '?')}, step {step}); dropout-free training follows the same trajectory")
    print(f"  OK: resume with {plural(world_size, 'rank')} and ckpt.resume={path}")
    return 0


def _print_remap(path: str, saved_world: int, world_size: int) -> None:
    metadata = dcp_metadata(path)
    md = metadata.state_dict_metadata
    sharded = [k for k, v in md.items() if isinstance(v, TensorStorageMetadata) and is_dim0_sharded(v, saved_world)]
    whole = [k for k, v in md.items() if k not in sharded and not k.startswith(rng_key(0)[:-1])]
    verb = ("keep their layout" if saved_world == world_size
            else f"go from {saved_world} to {world_size} shards (DCP reshards on load)")
    print(f"  model + optimizer: {len(sharded)} tensors sharded on dim 0 {verb}:")
    for r, by_file in sorted(remap_reads(metadata, saved_world, world_size).items()):
        print(f"    rank {r} reads " + ", ".join(f"{_mib(n)} from {f}" for f, n in sorted(by_file.items())))
    print(f"  {len(whole)} scalars and small items (Adam steps, param groups, scheduler, train state) "
          "are read whole by every rank")


def inspect_path(path: str, world_size: int | None = None, tensors: bool = False) -> int:
    """`python -m ckpt inspect`: a ckpt.dir lists its checkpoints (and dry-runs the newest resumable one);
    a checkpoint shows a summary of its contents (every tensor with `tensors`), or with world_size, the dry run."""
    store = storage_for(path)
    names = store.listdir(path)
    if not (names or store.is_folder(path)):  # on an object store, is_folder is another listing
        print(f"error: {path}: {store.missing}", file=sys.stderr)
        return 2  # bad input
    is_checkpoint = bool({".metadata", META_FILE, "commit.json"} & set(names))
    if is_checkpoint:
        return show_checkpoint(path, tensors) if world_size is None else dry_run(path, world_size)
    rc = list_checkpoints(path)
    if rc or world_size is None:
        return rc
    resumable = [p for _, p in reversed(list_step_dirs(path)) if checkpoint_status(p)[0]]
    if not resumable:
        print("error: no committed, verified checkpoint to resume from", file=sys.stderr)
        return 1
    print()
    return dry_run(resumable[0], world_size)

"""Resume: which checkpoint to load (newest verified, or the one named), verified by all ranks together, a
load that names a model mismatch instead of failing inside DCP, and `restore`, the whole sequence a
trainer asks for (base check, its own config check, load, the RNG rule of state.py), returning what it loaded.

    python -m pytest tests/test_ckpt_unit.py tests/test_ckpt_resume.py -q

Every rank takes part in each call: rank 0 lists the folders and checks the marker, each rank checks the sizes
and checksums of its share of the files (O(bytes / W)), and all agree on one verdict. No rank reads the global
.metadata (O(tensors x W): ~630 MB at 70B on 2,048 ranks): each reads the checkpoint's metadata index
(metadata_index.py), whose references to data files it checks against the manifest; verify keeps it for the model
check and the train-state fit (headers only), and dcp.load's planner adds the index buckets this rank's shards
meet. A checkpoint written before the index: each rank reads .metadata once, as before.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from common.dist import first_problem, on_rank0_then_share
from common.progress import phase
from common.words import plural
from . import collector
from .checksum import new_hasher
from .commit_protocol import VerifyError, check_files, check_listing, check_marker, check_references, shares
from .errors import SAVE_ERRORS, CheckpointError, cause_line
from .layout import list_step_dirs, read_meta, read_saved_config, step_of
from .lora_base import check_same_base
from .metadata_index import INDEX, IndexedLoadPlanner, MetadataIndexError, read_index
from .state import (DERIVED_SEED, ModelOptimizer, derived_seed, fit_to_checkpoint, reseed_all, restores_rng, rng_key,
                    rng_world_size)
from .storage import join, reader_with, storage_for


def choose_checkpoint(ckpt_dir: str, resume: str, pg, on_log: Callable[[str], None], on_event: Callable[..., None],
                newer_than: int = -1) -> str | None:
    """'none' -> None; 'auto' -> newest verified checkpoint after step `newer_than` (skips are logged); a path ->
    that one."""
    if resume == "none":
        return None
    if resume != "auto":
        try:
            with phase(on_log, f"resume: verifying {resume}"):
                verify(resume, pg)
        except VerifyError as e:
            raise CheckpointError(f"cannot resume from {resume}: {e}") from None
        return resume
    for step, path in reversed(on_rank0_then_share(lambda: list_step_dirs(ckpt_dir), pg, CheckpointError)):
        if step <= newer_than:
            break
        try:
            with phase(on_log, f"resume: verifying {path}"):  # each rank checks 1/W of the bytes
                verify(path, pg)
            return path
        except VerifyError as e:
            on_log(f"resume: skipping {path}: {e}")
            on_event("resume_skip", step=step, path=path, reason=str(e))
    return None


_verified: dict = {}  # {checkpoint path: its DCP Metadata}: the last one verify() passed, until load() takes it


def verify(path: str, pg) -> dict:
    """verify_checkpoint split over the ranks of `pg`. Returns the marker; raises VerifyError, with the same
    message, on every rank."""
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if pg is not None else (0, 1)
    _verified.clear()
    marker, listing_problem = on_rank0_then_share(lambda: _marker_and_listing(path), pg, VerifyError)
    try:  # check_manifest's order: references, then the listing
        metadata, problem = _checked_metadata(path, marker), listing_problem
    except VerifyError as e:  # the same on every rank (one file); still joins the agreement below
        metadata, problem = None, str(e)
    problem = problem or check_files(path, marker, shares(marker["files"], world_size)[rank])
    problem = first_problem(problem, pg) if pg is not None else problem
    if problem:
        raise VerifyError(problem)
    _verified[os.path.normpath(path)] = metadata
    return marker


def _checked_metadata(path: str, marker: dict):
    """The metadata index's top (INDEX), its references checked against the manifest; a checkpoint without one:
    the whole .metadata (check_references). Raises VerifyError."""
    if INDEX not in marker["files"]:
        return check_references(path, marker)
    try:
        return read_index(path, checked_reader(path, marker), marker["files"])
    except (MetadataIndexError, VerifyError) as e:
        raise VerifyError(str(e)) from None
    except Exception as e:  # noqa: BLE001 - missing, torn or not a pickle: the same verdict
        raise VerifyError(f"{join(path, INDEX)}: unreadable ({type(e).__name__})") from None


def checked_reader(path: str, marker: dict) -> Callable[[str], bytes]:
    """read(name) -> the bytes of `path`'s file `name`, whole, once they match the manifest's size and checksum
    (VerifyError, the words of check_file): a rank checks the metadata index files it reads itself, before the
    agreement on every rank's share has covered them."""
    store, algorithm = storage_for(path), marker["algorithm"]

    def read(name: str) -> bytes:
        full, expected = join(path, name), marker["files"].get(name)
        data = store.read(full)
        if expected is None:
            raise VerifyError(f"{full}: not in the manifest")
        if len(data) != expected["size"]:
            raise VerifyError(f"{full}: size {len(data)} != {expected['size']} in manifest")
        hasher = new_hasher(algorithm)
        hasher.update(data)
        if hasher.hexdigest() != expected[algorithm]:
            raise VerifyError(f"{full}: checksum mismatch ({algorithm})")
        return data
    return read


def _marker_and_listing(path: str) -> tuple[dict, str | None]:
    """Rank 0: the marker (or VerifyError) and what check_listing finds (None: nothing)."""
    marker = check_marker(path)
    try:
        check_listing(path, marker)
    except VerifyError as e:
        return marker, str(e)
    return marker, None


class _VerifiedRead:
    """A DCP reader that takes the global .metadata verify() read, if it verified this checkpoint."""

    def read_metadata(self, *args, **kwargs):
        metadata = _verified.get(os.path.normpath(str(self.path)))
        if metadata is None or kwargs.get("rank") is not None:  # DCP's per-rank fallback reads its own file
            return super().read_metadata(*args, **kwargs)
        if metadata.storage_meta is not None:
            metadata.storage_meta.load_id = self.load_id  # as FileSystemReader.read_metadata does
        return metadata


def trust_metadata(path: str, metadata) -> None:
    """`metadata`, read from `path`'s .metadata after its checksum passed, is the one the next load of `path` uses
    (the memory tier verifies its own way, memory_tier/recover.py)."""
    _verified.clear()
    _verified[os.path.normpath(path)] = metadata


def _verified_reader(path: str):
    return reader_with(_VerifiedRead, path)  # on every backend: its own reader (S3: this rank's items, ranged GETs)


def saved_metadata(path: str):
    """The DCP Metadata of `path`, unpickled once per resume: the one verify() or trust_metadata() kept (after
    verify: the metadata index's top, every key's header), else .metadata read now and kept for the model check,
    the train-state fit and dcp.load alike (load() drops it)."""
    key = os.path.normpath(path)
    if _verified.get(key) is None:
        _verified[key] = storage_for(path).dcp_reader(path).read_metadata()
    return _verified[key]


def load(path: str, state: dict, pg, model_state: dict | None = None, prefix: str = "") -> None:
    """Load `state` in place from a verified checkpoint; `model_state` (the current model's state dict, saved
    under the key prefix `prefix`) is checked against the saved shapes first, for an error that names the mismatch."""
    try:
        if model_state is not None:
            check_model_matches(path, model_state, prefix)
        try:  # rank 0 unpickles W load plans: its collector paused, as in a save (collector.py)
            with collector.paused(collector.coordinates(pg)):
                dcp.load(state, storage_reader=_verified_reader(path), process_group=pg, planner=IndexedLoadPlanner())
        except SAVE_ERRORS as e:
            raise CheckpointError(f"loading {path} failed: {cause_line(e)}") from e
    finally:
        _verified.clear()  # a 70B/512 Metadata is large; the next resume verifies again


def _few(names: list[str], shown: int = 3) -> str:
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(f"'{n}'" for n in names[:shown]) + more


def check_model_matches(path: str, model_state: dict, prefix: str) -> None:
    """Same tensor names in both directions, and the same shapes: a checkpoint of a deeper model must not
    load into a shallower one by leaving the extra layers behind."""
    saved = saved_metadata(path).state_dict_metadata
    in_ckpt = {k[len(prefix):] for k in saved if k.startswith(prefix)}
    lacking = sorted(set(model_state) - in_ckpt)
    extra = sorted(in_ckpt - set(model_state))
    if lacking:
        raise CheckpointError(f"checkpoint {path} does not match the model: it has no {_few(lacking)} "
                              "(a different model architecture?)")
    if extra:
        raise CheckpointError(f"checkpoint {path} does not match the model: the model has no {_few(extra)} "
                              f"({len(extra)} saved tensors; a different model architecture?)")
    for name, tensor in model_state.items():
        key = prefix + name
        saved_shape = tuple(getattr(saved[key], "size", ()))
        if saved_shape != tuple(tensor.shape):
            raise CheckpointError(f"checkpoint {path} does not match the model: '{name}' is {list(saved_shape)} "
                                  f"in the checkpoint but {list(tensor.shape)} in the model")


# ---------------------------------------------------------------- a trainer's resume, start to end

@dataclass
class Resumed:
    """What restore did. `path` None: nothing to resume (a fresh start, RNG seeded for step 0)."""
    path: str | None = None
    step: int = 0
    saved_world_size: int | None = None
    rng: str = "seeded"  # "seeded" (fresh start), "restored" (each rank's saved RNG), "re-derived" (DERIVED_SEED)


def restore(mgr, path: str | None, tier: str, state: dict, seed: int, lora_base: dict | None, log,
            check_config: Callable[[str, str | None], None] = lambda path, saved: None) -> Resumed:
    """Load `path`, a verified checkpoint of `mgr`'s folder found in `tier` (disk, memory; the `resume` event
    records it), into `state`, in place, at any world size (DCP reshards); None: a fresh start. Before the load:
    the LoRA base must be the checkpoint's (`lora_base`: the run's meta "lora" entry, None for full fine-tuning;
    lora_base.py check_same_base), and `check_config(path, saved config.yaml text or None)`, the trainer's own
    rule, may refuse. The RNG follows state.py's rule; without a checkpoint every rank seeds
    derived_seed(seed, rank). `log`: info and event."""
    if path is None:
        reseed_all(derived_seed(seed, mgr.rank))
        return Resumed()
    check_same_base(path, lora_base)
    check_config(path, on_rank0_then_share(lambda: read_saved_config(path), mgr.pg, CheckpointError))
    meta = read_meta(path)
    step, saved_world, same_rng = meta.get("step", step_of(path)), meta["world_size"], restores_rng(meta, mgr.world_size)
    loaded = state if same_rng else {k: v for k, v in state.items() if k != rng_key(mgr.rank)}
    loaded, filled = fit_to_checkpoint(loaded, saved_metadata(path).state_dict_metadata, path)
    for key, default in filled.items():
        log.info(f"resume: {path} has no {key} (added to the train state since): it starts at {default!r}")
    model_key = next((k for k, v in state.items() if isinstance(v, ModelOptimizer)), None)
    model_state = None if model_key is None else state[model_key].state_dict()[ModelOptimizer.MODEL]
    with phase(log.info, f"resume: loading {path}"):
        mgr.load(path, loaded, model_state=model_state, prefix=f"{model_key}.{ModelOptimizer.MODEL}.")
    if not same_rng:
        reseed_all(derived_seed(seed, mgr.rank, step))
        log.info(f"resume: RNG saved by {plural(rng_world_size(meta), 'rank')}, now {mgr.world_size}: re-derived as "
                 f"{DERIVED_SEED} (step {step})")
    log.info(f"resume: loaded {path} at step {step} (saved by {plural(saved_world, 'rank')}, now {mgr.world_size})")
    log.event("resume", step=step, path=path, world_size=mgr.world_size, saved_world_size=saved_world, tier=tier)
    return Resumed(path, step, saved_world, "restored" if same_rng else "re-derived")


"""DCP's global .metadata stays on the coordinator: after a save no other rank receives it, and on resume each rank
reads only the index entries it loads (ckpt/checksum.py SavedMetadata, ckpt/metadata_index.py).

    python -m pytest tests/test_ckpt_metadata.py -q -n 0
"""

import os
import pickle
from multiprocessing.reduction import ForkingPickler

import torch
import torch.distributed.checkpoint as dcp

from ckpt.checksum import ChecksummingWriter, SavedMetadata
from ckpt.commit_protocol import referenced_files
from conftest import start_on_free_port


def sharded_state(world: int, tensors: int) -> dict:
    """`tensors` tensors of 4 x W rows, sharded on dim 0 over the W ranks as FSDP2 shards: one chunk per rank each."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    mesh = init_device_mesh("cpu", (world,))
    return {f"t{i}": distribute_tensor(torch.arange(8.0 * world).reshape(4 * world, 2) + i, mesh, [Shard(0)])
            for i in range(tensors)}


def _save_and_report(rank: int, port: int, root: str, world: int) -> None:
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        state = sharded_state(world, 6)
        md = dcp.save(state, storage_writer=ChecksummingWriter(root))
        with open(os.path.join(root, f"rank{rank}.pkl"), "wb") as f:
            pickle.dump({"type": type(md).__name__, "entries": len(md.state_dict_metadata),
                         "storage": len(md.storage_data or {}), "pickled": len(pickle.dumps(md)),
                         "digests": sorted(getattr(md, "file_digests", {}) or {})}, f)
    finally:
        dist.destroy_process_group()


def test_after_a_save_only_the_coordinator_holds_the_global_metadata(tmp_path):
    """DCP broadcasts the Metadata its finish leaves to every rank; the writer's finish makes that broadcast carry no
    entries, so what rank 1 receives does not grow with tensors x W, while rank 0 keeps everything its commit needs."""
    root, world = str(tmp_path), 2
    start_on_free_port(_save_and_report, lambda port: (port, root, world), nprocs=world)
    rank0, rank1 = (pickle.load(open(os.path.join(root, f"rank{r}.pkl"), "rb")) for r in range(world))
    assert rank0["type"] == "SavedMetadata" and rank0["entries"] == 6 and rank0["storage"] == 6 * world
    index = [".metadata.index", ".metadata.index-0-00000"]  # one size group, one bucket: 8 ranks per bucket
    assert rank0["digests"] == index + sorted(f"__{r}_0.distcp" for r in range(world))
    # no entry, no storage item: what rank 1 received has the same few bytes whatever the tensors and W
    assert rank1 == {"type": "Metadata", "entries": 0, "storage": 0, "pickled": rank1["pickled"], "digests": []}
    assert rank1["pickled"] < 400
    assert pickle.load(open(os.path.join(root, ".metadata"), "rb")).state_dict_metadata.keys() == {
        f"t{i}" for i in range(6)}  # the file is DCP's whole Metadata, as before


def test_a_process_mode_uploader_hands_its_trainer_the_commit_inputs(tmp_path):
    """The process-mode uploader sends dcp.save's result to its training process through a multiprocessing pipe
    (ForkingPickler): on rank 0 that carries the digests and the referenced files, never the entries."""
    md = dcp.save({"w": torch.arange(5.0)}, storage_writer=ChecksummingWriter(str(tmp_path)), no_dist=True)
    assert isinstance(md, SavedMetadata) and md.state_dict_metadata
    piped = ForkingPickler.loads(ForkingPickler.dumps(md))
    assert piped.state_dict_metadata == {} and piped.file_digests == md.file_digests
    assert referenced_files(piped) == referenced_files(md) == {"__0_0.distcp"}
    plain = pickle.loads(pickle.dumps(md))  # DCP's broadcast pickles with pickle
    assert type(plain).__name__ == "Metadata" and plain.state_dict_metadata == {} and not hasattr(plain, "file_digests")


ROWS = 12  # divisible by 4 and 3: the same tensors saved at W=4 and loaded at W=3


def rows_state(world: int, zero: bool) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    mesh = init_device_mesh("cpu", (world,))
    return {f"t{i}": distribute_tensor(torch.zeros(ROWS, 2) if zero else torch.arange(2.0 * ROWS).reshape(ROWS, 2) + i,
                                       mesh, [Shard(0)]) for i in range(4)}


def _save_or_resume(rank: int, port: int, root: str, world: int, resume: bool) -> None:
    """W ranks on one machine: save (2 ranks per index bucket), or resume and record which metadata files each
    rank opened."""
    import builtins
    import io
    import json

    import torch.distributed as dist
    from ckpt.manager import CheckpointManager
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_WORLD_SIZE="2")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        mgr = CheckpointManager(root, "off", keep_last=1)
        if not resume:
            mgr.save(1, {"app": rows_state(world, zero=False)}, {"meta.json": "{}"}, blocking=True)
        else:
            opened, real = [], io.open

            def counting(file, *args, **kwargs):
                opened.append(os.path.basename(str(file)))
                return real(file, *args, **kwargs)
            io.open = builtins.open = counting
            try:
                state = {"app": rows_state(world, zero=True)}
                path = mgr.choose_checkpoint("auto")
                verified, opened[:] = list(opened), []
                mgr.load(path, state)
            finally:
                io.open = builtins.open = real
            right = all(torch.equal(v.full_tensor(), torch.arange(2.0 * ROWS).reshape(ROWS, 2) + int(k[1:]))
                        for k, v in state["app"].items())
            with open(os.path.join(root, f"opened{world}-{rank}.json"), "w") as f:
                json.dump({"verify": sorted(n for n in verified if n.startswith(".metadata")),
                           "load": sorted(n for n in opened if n.startswith(".metadata")), "right": right}, f)
        mgr.close()
    finally:
        dist.destroy_process_group()


def test_resume_reads_only_the_index_entries_each_rank_loads(tmp_path):
    """Saved by 4 ranks (2 per index bucket), resumed by 4 and then by 3: no rank opens the global .metadata (today
    all four did); each reads the index's top and only the buckets its shards meet; the values come back exact."""
    import json
    root = str(tmp_path)
    for world, resume in ((4, False), (4, True), (3, True)):
        start_on_free_port(_save_or_resume, lambda port: (port, root, world, resume), nprocs=world)
    opened = {(w, r): json.load(open(os.path.join(root, f"opened{w}-{r}.json"))) for w, n in ((4, 4), (3, 3))
              for r in range(n)}
    assert all(o["right"] for o in opened.values())
    top, b0, b1 = ".metadata.index", ".metadata.index-0-00000", ".metadata.index-0-00001"  # one size group
    for world in (4, 3):
        verified = [opened[world, r]["verify"] for r in range(world)]
        assert all(top in v for v in verified)  # every rank: the index's top (its references checked)
        # the global .metadata: opened only to checksum it, by the one rank whose share of the bytes it is
        assert sum(".metadata" in v for v in verified) == 1
    # the load: 12 rows saved by 4 ranks, 3 each; 2 ranks per bucket: bucket 0 holds rows 0-5, bucket 1 rows 6-11
    assert {k: o["load"] for k, o in opened.items()} == {
        (4, 0): [b0], (4, 1): [b0], (4, 2): [b1], (4, 3): [b1],
        (3, 0): [b0], (3, 1): [b0, b1], (3, 2): [b1]}  # W=3: rows 0-3, 4-7, 8-11


def test_verify_checks_that_the_index_says_what_metadata_says(tmp_path):
    """Resume trusts the index instead of .metadata; `python -m ckpt verify` reads both and refuses an index that
    disagrees, even one whose manifest digest matches (a writer's bug, not a flipped byte)."""
    import json

    from ckpt.checksum import file_digest
    from ckpt.commit_protocol import VerifyError, verify_checkpoint
    from ckpt.manager import CheckpointManager
    from ckpt.metadata_index import INDEX
    mgr = CheckpointManager(str(tmp_path), "off", keep_last=1)
    mgr.save(1, {"w": torch.arange(4.0), "b": b"x"}, {"meta.json": "{}"}, blocking=True)
    mgr.close()
    path = os.path.join(str(tmp_path), "step-000001")
    verify_checkpoint(path)
    top = pickle.load(open(os.path.join(path, INDEX), "rb"))
    del top["metadata"].state_dict_metadata["b"]
    with open(os.path.join(path, INDEX), "wb") as f:
        pickle.dump(top, f)
    marker = json.load(open(os.path.join(path, "commit.json")))
    marker["files"][INDEX] = file_digest(os.path.join(path, INDEX))
    with open(os.path.join(path, "commit.json"), "w") as f:
        json.dump(marker, f)
    try:
        verify_checkpoint(path)
    except VerifyError as e:
        assert "does not agree with .metadata" in str(e)
    else:
        raise AssertionError("verify passed an index that disagrees with .metadata")

"""The memory tier on several nodes: each node's memory steps are copied to the next node; a job that lost nodes
resumes from the copies (at another world size, with the same samples), fetching what a rank reads from the peer
that holds it; damaged or incomplete steps are skipped; kills mid-save never leave a marked step that fails.

    python -m pytest tests/test_memory_replicas.py -q

A node here is a torchrun agent on this machine (--nnodes N --node_rank i, static rendezvous on 127.0.0.1) with
one rank and its own memory folder, <run>-node<i>, as a real node has its own /dev/shm; the SLURM test of two
hosts is in tests/test_slurm_multinode.py. Run T2 trains on 2 nodes with a memory step every step (memory_keep 2,
one replica: each node then holds both ranks' files) and a disk step every 4; it is killed after step 7, once
memory step 6 is marked on both nodes. T3 does the same on 3 nodes, where the ring puts rank i's files on nodes
i and i+1 only. R2 and R3 are the same 12 steps at W=2 and W=3 on one node, uninterrupted.
"""

import os
import random
import shutil
import subprocess
import sys
import threading
import time

import pytest

from ckpt import verify_checkpoint
from ckpt.reading import read_items
from conftest import (FAST, ROOT, events, free_port, kill_workers, port_was_taken, run_train, start_on_free_port,
                      start_python)
from finetune.metrics import read_metrics
from test_memory_tier import damage_step, same_item
from torch.distributed.checkpoint import FileSystemReader

K = 6  # the newest memory step when T2 and T3 are killed; disk steps are 4 and 8
RUN = ["train.max_steps=12", "ckpt.interval=4", "ckpt.keep_last=0"]
MEMORY = ["ckpt.memory_interval=1", "ckpt.memory_keep=2"]


def mem(run_dir, node: int) -> str:
    return f"{run_dir}-node{node}"


def marker(run_dir, node: int, step: int) -> str:
    return os.path.join(mem(run_dir, node), f"step-{step:06d}", "commit.json")


def node_cmd(nodes: int, node: int, port: int, overrides: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes), "--node_rank", str(node),
            "--nproc_per_node", "1", "--master_addr", "127.0.0.1", "--master_port", str(port),
            os.path.join(ROOT, "train_fsdp.py"), "--config", os.path.join(ROOT, "configs", "tiny.yaml"), *overrides]


def run_nodes(run_dir, nodes: int, overrides: list[str] = (), faults: list[str] | None = None, check: bool = True,
              killer=None, timeout: float = 300, env: dict | None = None) -> list[subprocess.CompletedProcess]:
    """One agent per node, all on this machine; node i gets CKPT_FAULT faults[i] and memory folder mem(run_dir, i),
    and `env`. `killer(agents)`, if given, runs beside them (a thread). Retried on another port if the store's was
    taken."""
    args = [*FAST, f"run.dir={run_dir}", f"data.cache_dir={os.path.join(str(run_dir), '..', '.tok-cache')}", *RUN,
            *MEMORY, *overrides]
    for attempt in range(3):
        port = free_port()
        agents = [start_python(node_cmd(nodes, i, port, [*args, f"ckpt.memory_dir={mem(run_dir, i)}"])[1:],
                               {"CKPT_FAULT": (faults or [""] * nodes)[i], **(env or {})}, ROOT,
                               forked=env is None)  # a sitecustomize in `env` runs only in exec'd processes
                  for i in range(nodes)]
        side = threading.Thread(target=killer, args=(agents,), daemon=True) if killer else None
        if side:
            side.start()
        try:
            outs = ["".join(a.communicate(timeout=timeout)) for a in agents]  # stdout, then stderr
        finally:
            for a in agents:
                if a.returncode is None:  # its communicate did not finish
                    kill_workers(a.pid)
                    a.kill()
                    a.communicate()
        if not port_was_taken(outs) or attempt == 2:
            break
    done = [subprocess.CompletedProcess(a.args, a.returncode, out, "") for a, out in zip(agents, outs)]
    if check:
        for i, p in enumerate(done):
            assert p.returncode == 0, f"node {i} exited {p.returncode}\n{p.stdout[-5000:]}"
    return done


def kill_after_memory_step(run_dir, nodes: int, step: int) -> list[str]:
    """Per node: after step `step` + 1, wait for this node's marker of memory step `step` (and disk step 4's),
    then SIGKILL."""
    disk = os.path.join(str(run_dir), "checkpoints", "step-000004", "commit.json")
    return [f"wait_for@after_step:{step + 1},secs=120,file={marker(run_dir, i, step)};"
            f"wait_for@after_step:{step + 1},secs=120,file={disk};kill@after_step:{step + 1}" for i in range(nodes)]


def step_records(run_dir) -> dict[int, dict]:
    return read_metrics(os.path.join(str(run_dir), "metrics.jsonl"))[0]


def copy_nodes(src, dst, nodes) -> None:
    """The memory folders of nodes `nodes` of run `src` as those of run `dst`, node by node in order."""
    for new, old in enumerate(nodes):
        shutil.copytree(mem(src, old), mem(dst, new))


def killed_run(root, nodes: int):
    run = root / f"t{nodes}"
    procs = run_nodes(run, nodes, faults=kill_after_memory_step(run, nodes, K), check=False)
    assert all(p.returncode != 0 for p in procs), "the fault should have killed every node"
    return run


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    root = tmp_path_factory.mktemp("replicas2")
    run_train(root / "r2", 2, RUN)
    return killed_run(root, 2), root / "r2"


@pytest.fixture(scope="module")
def three(tmp_path_factory):
    root = tmp_path_factory.mktemp("replicas3")
    run_train(root / "r3", 3, RUN)
    return killed_run(root, 3), root / "r3"


def assert_continues(run_dir, reference, first: int, exact: bool) -> None:
    """Steps `first`..12 train the reference's samples; the losses are its own (`exact`) or within the world-size
    tolerance of tests/test_world_size.py."""
    r, ref = step_records(run_dir), step_records(reference)
    assert max(r) == 12 and set(range(first, 13)) <= set(r)
    for s in range(first, 13):
        assert r[s]["sample_ids"] == ref[s]["sample_ids"], f"step {s}: a different global batch"
        assert r[s]["loss"] == (ref[s]["loss"] if exact else pytest.approx(ref[s]["loss"], rel=1e-4)), f"step {s}"


AUDIT = """import os, sys
_rank, _out = os.environ.get("RANK"), os.environ.get("AUDIT_METADATA_DIR")
def _hook(event, args):
    if event != "open" or not str(args[0]).endswith("/.metadata"):
        return
    mode, flags = args[1], args[2]
    if (isinstance(mode, str) and "r" in mode and "+" not in mode) or (mode is None and not flags & (os.O_WRONLY | os.O_RDWR)):
        with open(os.path.join(_out, f"rank{_rank}"), "a") as f:
            f.write(str(args[0]) + "\\n")
if _rank is not None and _out:
    sys.addaudithook(_hook)
"""


def metadata_readers(tmp_path) -> tuple[dict, dict[int, list[str]]]:
    """(env, readers): with `env`, every rank of a run records each .metadata it opens for reading (an audit hook,
    tests/test_launch.py's way of reaching every process); `readers()`: rank -> the paths it opened."""
    hooks, out = tmp_path / "audit", tmp_path / "audit-out"
    hooks.mkdir()
    out.mkdir()
    (hooks / "sitecustomize.py").write_text(AUDIT)
    env = {"PYTHONPATH": f"{hooks}{os.pathsep}{ROOT}", "AUDIT_METADATA_DIR": str(out)}
    return env, lambda: {int(p.name[4:]): p.read_text().split() for p in out.iterdir()}


def memory_fetch(run_dir) -> tuple[int, int]:
    (e,) = events(run_dir, "memory_fetch")
    return e["files"], e["bytes"]


# ---------------------------------------------------------------- moving files between ranks

def _exchange(rank: int, port: int, folder: str) -> None:
    """Rank 0 sends two files to rank 1, 7 bytes a message: one it has, and one that is gone."""
    import json
    import torch.distributed as dist
    from ckpt.checksum import ALGORITHM, file_digest
    from ckpt.memory_tier.peers import Transfer, exchange
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        src, dst = os.path.join(folder, "src"), os.path.join(folder, "mem", "dst")  # a node with no memory folder yet
        transfers = [Transfer(0, 1, "a.distcp", file_digest(os.path.join(src, "a.distcp")), 0),
                     Transfer(0, 1, "gone.distcp", {"size": 10, ALGORITHM: "0" * 32}, 1)]
        problems = exchange(transfers, rank, dist.new_group(backend="gloo"), src, dst, ALGORITHM, chunk=7)
        with open(os.path.join(folder, f"problems-{rank}.json"), "w") as f:
            json.dump(problems, f)
    finally:
        dist.destroy_process_group()


def test_a_file_moves_whole_and_checked_and_a_missing_one_never_hangs_the_receiver(tmp_path):
    import json
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.distcp").write_bytes(bytes(range(200)) * 3)
    start_on_free_port(_exchange, lambda port: (port, str(tmp_path)), nprocs=2, start_method="fork")
    assert (tmp_path / "mem" / "dst" / "a.distcp").read_bytes() == bytes(range(200)) * 3  # 86 messages, in order
    sender, receiver = (json.loads((tmp_path / f"problems-{r}.json").read_text()) for r in (0, 1))
    assert len(sender) == 1 and "gone.distcp: cannot be read to send to rank 1" in sender[0]
    assert receiver == ["gone.distcp from rank 0: checksum mismatch on arrival (xxh3_128)"]
    assert sorted(os.listdir(tmp_path / "mem" / "dst")) == ["a.distcp"], "no torn or temporary file is left"
    assert (tmp_path / "mem").stat().st_mode & 0o777 == 0o700, "the memory folder a fetch makes is this user's alone"


def test_a_file_arriving_over_one_of_its_name_is_written_over_its_pages(tmp_path):
    """A step folder made from the spare already holds the file (longer, stale): it is overwritten in place."""
    import json
    (tmp_path / "src").mkdir()
    (tmp_path / "mem" / "dst").mkdir(parents=True)
    (tmp_path / "src" / "a.distcp").write_bytes(bytes(range(200)) * 3)
    (tmp_path / "mem" / "dst" / "a.distcp").write_bytes(b"\xff" * 1000)
    inode = os.stat(tmp_path / "mem" / "dst" / "a.distcp").st_ino
    start_on_free_port(_exchange, lambda port: (port, str(tmp_path)), nprocs=2, start_method="fork")
    assert (tmp_path / "mem" / "dst" / "a.distcp").read_bytes() == bytes(range(200)) * 3, "cut to the bytes received"
    assert os.stat(tmp_path / "mem" / "dst" / "a.distcp").st_ino == inode
    assert json.loads((tmp_path / "problems-1.json").read_text()) == [
        "gone.distcp from rank 0: checksum mismatch on arrival (xxh3_128)"]


def test_a_superseded_step_becomes_the_spare_and_the_next_step_writes_over_its_files(tmp_path):
    from ckpt.memory_tier.peers import NodeLayout
    from ckpt.memory_tier.replicate import SPARE, NodeCommitter, make_step_dir, shard_file
    from ckpt.writeback import InPlaceFileSystem
    folder = tmp_path / "mem"
    for step in (1, 2):
        d = folder / f"step-{step:06d}"
        d.mkdir(parents=True)
        for name in ("commit.json", "meta.json", shard_file(0), shard_file(1), shard_file(5), "__0_s0.distcp"):
            (d / name).write_bytes(b"x" * 100)
    inodes = {n: os.stat(folder / "step-000001" / n).st_ino for n in (shard_file(0), shard_file(1))}
    committer = NodeCommitter(str(folder), None, 1, NodeLayout(0, 2, 1), 1, lambda *a, **k: None, print)
    try:
        committer.retain(2)  # keep 1: step 1 is superseded
    finally:
        committer.close()
    assert sorted(os.listdir(folder)) == [SPARE, "step-000002"]
    assert "commit.json" not in os.listdir(folder / SPARE), "the spare is never a marked step"
    new = folder / "step-000003"
    make_step_dir(str(new), {"meta.json": "{}"}, str(folder / SPARE), frozenset({shard_file(0), shard_file(1)}))
    assert not (folder / SPARE).exists()
    assert sorted(os.listdir(new)) == [shard_file(0), shard_file(1), "meta.json"], "rank 5's and small files go"
    with InPlaceFileSystem().create_stream(str(new / shard_file(0)), "wb") as f:
        f.write(b"abc")
    assert (new / shard_file(0)).read_bytes() == b"abc"
    assert {n: os.stat(new / n).st_ino for n in inodes} == inodes


def test_dcp_writing_over_a_longer_file_leaves_exactly_its_bytes(tmp_path):
    """DCP closes each file itself: the cut to the bytes written must happen at that close, or a spare's longer
    file keeps a stale tail that the step's manifest does not cover (after a world-size change, say)."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from ckpt.checksum import file_digest
    from ckpt.memory_tier.replicate import TierWriter, shard_file
    step = tmp_path / "step"
    step.mkdir()
    (step / shard_file(0)).write_bytes(b"\xff" * 1_000_000)
    inode = os.stat(step / shard_file(0)).st_ino
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        metadata = dcp.save({"w": distribute_tensor(torch.arange(1000.0), mesh, [Shard(0)])},
                            storage_writer=TierWriter(str(step), 0))
        loaded = {"w": distribute_tensor(torch.zeros(1000), mesh, [Shard(0)])}
        dcp.load(loaded, checkpoint_id=str(step))
    finally:
        dist.destroy_process_group()
    assert os.stat(step / shard_file(0)).st_ino == inode, "written over, not replaced"
    assert {n: file_digest(str(step / n)) for n in metadata.file_digests} == metadata.file_digests
    assert torch.equal(loaded["w"].full_tensor(), torch.arange(1000.0))


def _tier_save(rank: int, port: int, root: str, world: int, per_node: int) -> None:
    """One memory save across `world // per_node` nodes (node n's folder root/node<n>), as NodeCommitter runs it:
    prepare, DCP's save with TierWriter, then step 3 (the hand-out of digests, the ring, node 0's files to the other
    leaders) and the markers. Each rank reports what it received."""
    import json
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from ckpt.memory_tier.peers import NodeLayout
    from ckpt.memory_tier.replicate import NodeCommitter, TierWriter, share_digests
    from test_ckpt_metadata import sharded_state
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_WORLD_SIZE=str(per_node))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        layout = NodeLayout.here()
        folder = os.path.join(root, f"node{layout.node}")
        path = os.path.join(folder, "step-000001")
        committer = NodeCommitter(folder, dist.group.WORLD, 1, layout, 1, lambda *a, **k: None, print)
        committer.prepare(path, 1, {"meta.json": json.dumps({"step": 1, "world_size": world})})
        state = {**sharded_state(world, 3), f"rng.{rank}": torch.tensor([rank])}
        md = dcp.save(state, storage_writer=TierWriter(path, 1))
        files = share_digests(md, layout, 1, path, dist.group.WORLD)
        assert committer.replicate(path, 1, files) is None
        dist.barrier()  # NodeCommitter._finish agrees first: a leader checks the copies its node's ranks receive
        assert committer._mark_problem(path, 1, files, ["meta.json"]) is None
        committer.close()
        with open(os.path.join(root, f"rank{rank}.json"), "w") as f:
            json.dump({"entries": len(md.state_dict_metadata), "storage": len(md.storage_data or {}),
                       "digests": sorted(files.digests), "manifest": sorted(files.manifest or ())}, f)
    finally:
        dist.destroy_process_group()


def test_after_a_memory_save_only_rank_0_holds_the_global_metadata_and_other_nodes_their_index(tmp_path):
    """4 ranks on 2 nodes of 2, one replica. DCP's save returns the global Metadata on rank 0 alone; each other
    rank gets the digests of its ring transfers only (its own files and its ring source's), each leader the manifest
    (O(W) digests); node 1's folder holds the metadata index top and the buckets of the ranks it holds, never
    .metadata, and every node's folder verifies."""
    import json
    root, world = str(tmp_path), 4
    start_on_free_port(_tier_save, lambda port: (port, root, world, 2), nprocs=world, start_method="spawn")
    got = [json.load(open(os.path.join(root, f"rank{r}.json"))) for r in range(world)]
    assert [g["entries"] > 0 for g in got] == [True, False, False, False], got
    assert [g["storage"] > 0 for g in got] == [True, False, False, False], got
    ring = {r: {r, (r + 2) % 4} for r in range(world)}  # a rank's own files and its ring source's
    for r, g in enumerate(got):
        assert {int(n[2]) for n in g["digests"]} == ring[r] and all(n.startswith("__") for n in g["digests"]), g
        assert bool(g["manifest"]) == (r % 2 == 0), g  # the leaders' markers need the whole manifest
    for node in range(2):
        step = tmp_path / f"node{node}" / "step-000001"
        marked = verify_checkpoint(str(step))  # every byte this folder holds, and the index's references
        index = sorted(n for n in marked["held"] if n.startswith(".metadata.index"))
        assert (".metadata" in marked["held"]) == (node == 0) and (step / ".metadata").exists() == (node == 0)
        if node == 1:  # buckets of 2 ranks (a node's): its own ranks 2, 3 and their sources 0, 1 -> both buckets
            assert index == [".metadata.index", ".metadata.index-0-00000", ".metadata.index-0-00001"], index
        assert ".metadata" in marked["files"] and len(marked["files"]) == len(json.load(open(
            tmp_path / "node0" / "step-000001" / "commit.json"))["files"])  # the same manifest on every node


# ---------------------------------------------------------------- where the copies are

def test_the_ring_puts_each_ranks_files_on_its_node_and_the_next(three):
    t3, _ = three
    for node in range(3):
        for step in (K - 1, K):
            marked = verify_checkpoint(os.path.dirname(marker(t3, node, step)))  # the files this node holds verify
            shards = sorted(n for n in marked["held"] if n.endswith("_0.distcp"))
            assert shards == sorted(f"__{r}_0.distcp" for r in (node, (node - 1) % 3)), (node, marked["held"])
            assert "__0_s0.distcp" in marked["held"]  # on every node
            assert (".metadata" in marked["held"]) == (node == 0), marked["held"]  # O(tensors x W): node 0's alone
            index = [n for n in marked["held"] if n.startswith(".metadata.index")]
            buckets = {0, 1, 2} if node == 0 else {node, node - 1}  # one rank per node: a bucket per saved rank
            assert ".metadata.index" in index and {int(n.rsplit("-", 1)[1]) for n in index[1:]} == buckets, index
            assert len([n for n in marked["files"] if n.endswith(".distcp")]) == 6  # the whole step's manifest


# ---------------------------------------------------------------- recovery

def test_the_same_nodes_resume_from_memory_and_fetch_nothing(two, tmp_path):
    """... and no rank reads .metadata (O(tensors x W)): each reads its node's metadata index; rank 0 opens it only
    to hash it for the markers of the saves after the resume."""
    t2, r2 = two
    copy_nodes(t2, tmp_path / "same", [0, 1])
    env, readers = metadata_readers(tmp_path)
    run_nodes(tmp_path / "same", 2, env=env)
    assert [(e["step"], e["tier"]) for e in events(tmp_path / "same", "resume")] == [(K, "memory")]
    assert memory_fetch(tmp_path / "same") == (0, 0), "at the same world size every rank reads its own node's files"
    assert set(readers()) <= {0}, readers()
    assert not any(f"step-{K:06d}" in p for p in readers().get(0, [])), readers()  # the resumed step's: never
    assert_continues(tmp_path / "same", r2, K + 1, exact=True)
    assert not os.path.exists(mem(tmp_path / "same", 0)), "exit 0 removes each node's memory folder"


def test_a_replaced_node_fetches_its_ranks_files_from_the_peer(two, tmp_path):
    """Node 1 comes back empty (a new host, its /dev/shm wiped): its rank's files come from node 0 over gloo."""
    t2, r2 = two
    copy_nodes(t2, tmp_path / "new", [0])
    run_nodes(tmp_path / "new", 2)
    assert [(e["step"], e["tier"]) for e in events(tmp_path / "new", "resume")] == [(K, "memory")]
    files, nbytes = memory_fetch(tmp_path / "new")
    shard = os.path.getsize(os.path.join(os.path.dirname(marker(t2, 0, K)), "__1_0.distcp"))
    assert files >= 3 and nbytes > shard, (files, nbytes)  # rank 1's shards, rank 0's small file, the small files
    assert_continues(tmp_path / "new", r2, K + 1, exact=True)


def test_a_lost_node_resumes_at_one_rank_from_the_replica(two, tmp_path):
    """W=2 -> W=1: node 1 is gone; node 0 holds rank 1's files as its replica; the data continues exactly."""
    t2, r2 = two
    copy_nodes(t2, tmp_path / "one", [0])
    proc = run_train(tmp_path / "one", 0, [*RUN, *MEMORY, f"ckpt.memory_dir={mem(tmp_path / 'one', 0)}"])
    resumed = events(tmp_path / "one", "resume")
    assert [(e["step"], e["tier"], e["saved_world_size"]) for e in resumed] == [(K, "memory", 2)]
    assert sum(f"resume: memory tier, step {K}" in ln for ln in proc.stdout.splitlines()) == 1, proc.stdout[-3000:]
    assert memory_fetch(tmp_path / "one") == (0, 0)
    assert_continues(tmp_path / "one", r2, K + 1, exact=False)


def test_three_nodes_less_one_resume_at_two_fetching_both_ways(three, tmp_path):
    """W=3 -> W=2 on nodes 0 and 1 (node 2 lost): rank 2's files survive on node 0 only; resharded, each new rank
    reads files the other node holds, fetched over gloo."""
    t3, r3 = three
    copy_nodes(t3, tmp_path / "two", [0, 1])
    env, readers = metadata_readers(tmp_path)
    run_nodes(tmp_path / "two", 2, env=env)
    resumed = events(tmp_path / "two", "resume")
    assert [(e["step"], e["tier"], e["saved_world_size"]) for e in resumed] == [(K, "memory", 3)]
    assert memory_fetch(tmp_path / "two")[0] >= 2
    assert set(readers()) <= {0} and not any(f"step-{K:06d}" in p for p in readers().get(0, [])), readers()
    assert_continues(tmp_path / "two", r3, K + 1, exact=False)


def test_both_nodes_holding_a_rank_lost_falls_back_to_disk(three, tmp_path):
    """Nodes 1 and 2 die: rank 1's files were on exactly those two. Node 0 alone resumes from ckpt.dir (step 4)."""
    t3, r3 = three
    copy_nodes(t3, tmp_path / "disk", [0])
    shutil.copytree(t3 / "checkpoints" / "step-000004", tmp_path / "disk" / "checkpoints" / "step-000004")
    proc = run_train(tmp_path / "disk", 0, [*RUN, *MEMORY, f"ckpt.memory_dir={mem(tmp_path / 'disk', 0)}"])
    assert [(e["step"], e["tier"]) for e in events(tmp_path / "disk", "resume")] == [(4, "disk")]
    (line,) = [ln for ln in proc.stdout.splitlines() if ln.startswith("resume: disk tier")]
    assert line.startswith("resume: disk tier, step 4 (newest recoverable memory step: none); skipped newer memory "
                           f"steps: step {K} (the files of saved rank 1 are on no node of this job)"), line
    assert_continues(tmp_path / "disk", r3, 5, exact=False)


@pytest.mark.parametrize("damage", ["flipped_byte", "missing_file", "missing_marker"])
def test_a_damaged_replica_is_skipped_for_the_older_step(two, tmp_path, damage):
    """Node 0 alone; its copy of rank 1's shard of step 6 is damaged, or step 6 has no marker there: step 6 is
    skipped with one line, and memory step 5 is used."""
    t2, _ = two
    run = tmp_path / "d"
    copy_nodes(t2, run, [0])
    newest = os.path.dirname(marker(run, 0, K))
    damage_step(newest, damage)  # on node 0, rank 1's files are the replica
    proc = run_train(run, 0, [*RUN, *MEMORY, "train.max_steps=7", f"ckpt.memory_dir={mem(run, 0)}"])
    assert [(e["step"], e["tier"]) for e in events(run, "resume")] == [(K - 1, "memory")]
    skips = [ln for ln in proc.stdout.splitlines() if "skipping" in ln]
    assert len(skips) == 1 and newest in skips[0], proc.stdout[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if "resume: memory tier" in ln)
    assert f"step {K - 1}" in line and f"skipped newer memory steps: step {K}" in line, line


def test_without_replicas_a_lost_node_means_the_disk_tier(tmp_path):
    """memory_replicas=0 on 2 nodes: each node's marker lists its own rank's files only; node 0 alone cannot
    rebuild step 3 and says so in one line, then resumes from disk step 2."""
    run = tmp_path / "r0"
    disk = os.path.join(str(run), "checkpoints", "step-000002", "commit.json")
    faults = [f"wait_for@after_step:4,secs=120,file={marker(run, i, 3)};wait_for@after_step:4,secs=120,file={disk};"
              "kill@after_step:4" for i in range(2)]
    procs = run_nodes(run, 2, ["ckpt.memory_replicas=0", "ckpt.memory_keep=1", "ckpt.interval=2"], faults=faults,
                      check=False)
    assert all(p.returncode != 0 for p in procs)
    for node in range(2):
        held = verify_checkpoint(os.path.dirname(marker(run, node, 3)))["held"]
        assert [n for n in held if n.endswith("_0.distcp")] == [f"__{node}_0.distcp"], held
    proc = run_train(run, 0, [*RUN, *MEMORY, "train.max_steps=4", "ckpt.interval=2", f"ckpt.memory_dir={mem(run, 0)}"])
    assert [(e["step"], e["tier"]) for e in events(run, "resume")] == [(2, "disk")]
    assert ("resume: disk tier, step 2 (newest recoverable memory step: none); skipped newer memory steps: step 3 "
            "(the files of saved rank 1 are on no node of this job)") in proc.stdout, proc.stdout[-3000:]


# ---------------------------------------------------------------- kills during a save

def marked_steps(run_dir, nodes: int) -> dict[int, list[int]]:
    """node -> its marked memory steps, each verified (size and checksum of every file it holds)."""
    out = {}
    for node in range(nodes):
        folder = mem(run_dir, node)
        out[node] = [int(d[5:]) for d in sorted(os.listdir(folder)) if os.path.exists(os.path.join(folder, d, "commit.json"))]
        for step in out[node]:
            verify_checkpoint(os.path.dirname(marker(run_dir, node, step)))
    return out


def assert_same_items(memory_step: str, disk_step: str) -> None:
    """Memory step 4, the disk tier's step too, was saved from the disk save's staged copy: the same state."""
    keys = list(FileSystemReader(disk_step).read_metadata().state_dict_metadata)
    on_disk, in_memory = read_items(disk_step, keys), read_items(memory_step, keys)
    assert sorted(keys) == sorted(FileSystemReader(memory_step).read_metadata().state_dict_metadata)
    for k in keys:
        assert same_item(on_disk[k], in_memory[k]), f"{k} differs between disk and memory step 4"


def random_kill(run_dir, seen: list):
    """A killer (run_nodes): once memory step 5's folder exists on node 0, wait a random 0-0.6 s, then SIGKILL a
    random node's rank (its agent then ends; the other rank fails in its next collective)."""
    def kill(agents):
        pick = random.Random()
        node, delay = pick.randrange(len(agents)), pick.uniform(0.0, 0.6)
        deadline = time.monotonic() + 120
        while not os.path.exists(os.path.dirname(marker(run_dir, 0, 5))) and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(delay)
        seen.append((node, round(delay, 3)))
        kill_workers(agents[node].pid)
    return kill


@pytest.mark.parametrize("moment", ["partial_replica", "before_commit", "random"])
def test_a_kill_during_replication_leaves_no_marked_step_that_fails(two, tmp_path, moment):
    """Rank 1 SIGKILLed while it receives rank 0's copy of memory step 5 (a torn file), or once every copy is in
    place but before node 1's marker; or a random rank at a random moment of step 5's save. Every marked step on
    every node verifies; node 0 alone resumes from its newest (step 5 only where node 0 marked it)."""
    t2, r2 = two
    run, seen = tmp_path / "k", []
    faults = ["", f"kill@{moment}:5,rank=1"] if moment != "random" else None
    procs = run_nodes(run, 2, faults=faults, check=False,
                      killer=random_kill(run, seen) if moment == "random" else None)
    assert any(p.returncode != 0 for p in procs), "the kill should have ended the job"
    marked = marked_steps(run, 2)
    if moment == "partial_replica":  # no agreement: no node marked step 5
        assert 5 not in marked[0] + marked[1] and marked[0][-1] == 4, marked
        assert_same_items(os.path.dirname(marker(run, 0, 4)), str(run / "checkpoints" / "step-000004"))
        return  # step 4 verified above; a resume from it is what the other two cases show
    if moment == "before_commit":  # node 0 marked step 5; node 1 died before its marker
        assert marked[0][-1] == 5 and 5 not in marked[1], marked
    newest = marked[0][-1]
    # a random kill may land after the job went on past step 5: a newer disk step then wins, as it should
    on_disk = [int(d[5:]) for d in os.listdir(run / "checkpoints") if (run / "checkpoints" / d / "commit.json").exists()]
    tier = "disk" if max(on_disk, default=-1) > newest else "memory"
    newest = max(newest, *on_disk)
    proc = run_train(run, 0, [*RUN, *MEMORY, f"ckpt.memory_dir={mem(run, 0)}"])
    assert [(e["step"], e["tier"]) for e in events(run, "resume")][-1:] == [(newest, tier)], (seen, proc.stdout[-3000:])
    assert_continues(run, r2, newest + 1, exact=False)


# ---------------------------------------------------------------- a marker that fails on one node

def test_a_marker_that_fails_on_one_node_leaves_the_step_before_on_every_node(tmp_path):
    """3 nodes, memory_keep 1: node 1 cannot write its marker of memory step 6 (ENOSPC); nodes 0 and 2 can. Every
    rank learns node 1's error and no node drops step 5, so when node 0 is lost too, nodes 1 and 2 still resume
    from memory step 5: step 6 lacks rank 0's files (their copy is on node 1, unmarked)."""
    run, lost = tmp_path / "m", tmp_path / "lost"
    keep_one = ["train.max_steps=7", "ckpt.memory_keep=1"]
    stop = "kill@before_commit:7"  # the final disk save: every node stops there, its memory folder kept
    procs = run_nodes(run, 3, keep_one, faults=[stop, f"oserror@before_commit:6;{stop}", stop], check=False)
    for node, p in enumerate(procs):  # each went on to step 7, past the failed memory save
        assert "Signal 9 (SIGKILL)" in p.stdout, f"node {node} exited {p.returncode}\n{p.stdout[-5000:]}"
    (failed,) = events(run, "checkpoint_failed")  # rank 0's, on node 0, which marked step 6 itself
    assert failed["tier"] == "memory" and failed["error"].startswith("memory step 6 not marked: node 1 ("), failed
    assert marked_steps(run, 3) == {0: [5, 6], 1: [5], 2: [5, 6]}, "step 5 stays marked and verifies on every node"
    copy_nodes(run, lost, [1, 2])
    proc = run_nodes(lost, 2, keep_one)[0]
    assert [(e["step"], e["tier"]) for e in events(lost, "resume")] == [(5, "memory")], proc.stdout[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("resume: memory tier"))
    assert "skipped newer memory steps: step 6 (the files of saved rank 0 are on no node of this job" in line, line

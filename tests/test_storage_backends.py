"""Every storage backend against the contract in ckpt/storage/base.py: create-only writes, reads and listings,
compare-and-swap, deletion and the retention sweep, the lock, DCP's write-stream rules, and a DCP save and load
through the backend's own writer file system and reader. S3 runs on the moto test server (tests/s3_server.py), Azure
Blob Storage on Azurite (tests/azurite_server.py).

    python -m pytest tests/test_storage_backends.py -q

A new backend: its class and registry entry (ckpt/storage/__init__.py), and one entry in BACKENDS below: a function
that returns the root under which a test may write.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp

from ckpt.checksum import ChecksummingWriter
from ckpt.storage import BACKENDS as REGISTRY
from ckpt.storage import base as storage_base
from ckpt.storage import join, reader_with, storage_for
from ckpt.storage.lock import LockError
from azurite_server import CONTAINER, azure_env, azurite_server  # noqa: F401 - fixtures
from s3_server import BUCKET, s3_env, s3_server  # noqa: F401 - fixtures


def _local_root(request, tmp_path) -> str:
    return str(tmp_path)


def _s3_root(request, tmp_path) -> str:
    request.getfixturevalue("s3_env")
    return f"s3://{BUCKET}/backends-{tmp_path.name}"


def _az_root(request, tmp_path) -> str:
    request.getfixturevalue("azure_env")
    return f"az://{CONTAINER}/backends-{tmp_path.name}"


BACKENDS = {None: _local_root, "s3": _s3_root, "az": _az_root}  # scheme -> root for a test; keyed as ckpt.storage.BACKENDS


@pytest.fixture(params=sorted(BACKENDS, key=str), ids=lambda s: s or "local")
def root(request, tmp_path) -> str:
    return BACKENDS[request.param](request, tmp_path)


def _step(root: str, store) -> str:
    path = join(root, "step-000002")
    store.prepare_folder(path)
    return path


def test_every_registered_backend_is_checked_here():
    assert set(BACKENDS) == set(REGISTRY), "a backend in ckpt.storage.BACKENDS without an entry in this suite"


def test_create_only_read_exists_listdir_delete(root):
    store = storage_for(root)
    step = _step(root, store)
    marker = join(step, "commit.json")
    assert not store.exists(marker) and store.listdir(step) == [] and not store.occupied(join(root, "step-000004"))
    store.create(marker, b'{"step": 2}')
    with pytest.raises(FileExistsError):
        store.create(marker, b'{"step": 3}')
    assert store.read(marker) == b'{"step": 2}' and store.size(marker) == 11
    with store.open_read(marker) as f:
        assert f.read() == b'{"step": 2}'
    store.create(join(step, "meta.json"), b"{}")
    assert store.listdir(step) == ["commit.json", "meta.json"] and store.sizes(step) == {"commit.json": 11,
                                                                                          "meta.json": 2}
    assert store.list_folders(root) == ["step-000002"] and store.is_folder(step) and store.occupied(step)
    assert not store.exists(step)  # a folder or prefix is no file
    store.delete(marker)
    assert not store.exists(marker)
    store.create(marker, b"again")  # create-only refuses an existing file, not a deleted one
    assert store.read(marker) == b"again"
    with pytest.raises(FileNotFoundError):
        store.read(join(step, "missing"))


def test_publish_is_seen_whole(root):
    store = storage_for(root)
    marker = join(_step(root, store), "commit.json")
    store.publish(marker, b'{"files": {}}')
    assert store.read(marker) == b'{"files": {}}'


def test_compare_and_swap_refuses_a_stale_tag(root):
    store = storage_for(root)
    if not store.compare_and_swap:
        pytest.skip("this backend offers no compare-and-swap (its lock is an flock)")
    path = join(root, ".lock")
    first = store.create(path, b"1")
    assert store.etag(path) == first
    second = store.replace(path, b"2", first)
    with pytest.raises(FileExistsError):
        store.replace(path, b"3", first)
    assert store.read(path) == b"2" and store.etag(path) == second


def test_the_guarantee_probe_passes_and_leaves_nothing(root, monkeypatch):
    """Every backend's store keeps create-only writes and compare-and-swap, proven by the probe a run makes before
    it takes the lock (Storage.check_guarantees); the probe object is gone afterwards."""
    monkeypatch.setattr(storage_base, "_VERDICTS", {})  # probe afresh, whatever this process asked before
    store = storage_for(root)
    assert store.missing_guarantees(root) == []
    assert store.listdir(root) == []


def test_the_lock_refuses_a_second_holder_and_is_free_after_release(root):
    store = storage_for(root)
    first = store.lock_class(root, store)
    first.acquire()
    try:
        with pytest.raises(LockError, match="in use by another job"):
            store.lock_class(root, store).acquire()
    finally:
        first.release()
    again = store.lock_class(root, store)
    again.acquire()
    again.release()


def test_delete_many_and_delete_tree(root):
    store = storage_for(root)
    step = _step(root, store)
    paths = [join(step, n) for n in ("a", "b", "c")]
    for p in paths:
        store.create(p, b"x")
    store.delete_many(paths[:2] + [join(step, "gone-already")])
    assert store.listdir(step) == ["c"]
    store.delete_tree(step)
    assert not store.occupied(step) and store.list_folders(root) == []


def test_retire_takes_the_marker_first_and_the_sweep_deletes_every_file(root):
    store = storage_for(root)
    step = _step(root, store)
    for name in ("commit.json", "__0_0.distcp", "__1_0.distcp", ".metadata"):
        store.create(join(step, name), b"x" * 10)
    store.retire(step, "commit.json")
    assert not store.exists(join(step, "commit.json"))  # out of the listing of checkpoints at once
    files = store.sweep_list(root, [step])
    assert len(files) == 3
    for rank in range(2):  # two ranks, each its share
        store.sweep_share(root, files[rank::2])
    store.sweep_finish(root, [step], on_log=print)
    assert store.list_folders(root) == [] and store.sweep_list(root, []) is None


def test_a_leftover_in_the_way_of_a_save_is_cleared(root):
    store = storage_for(root)
    step = _step(root, store)
    store.create(join(step, "commit.json"), b"{}")
    logs: list[str] = []
    waits_for_sweep = store.clear_stale(step, "commit.json", logs.append)
    assert not store.occupied(step) and "leftover of an earlier attempt" in logs[0]
    if waits_for_sweep:
        store.sweep_finish(root, [], logs.append)
    assert store.list_folders(root) == []


def test_dcp_write_stream_closed_by_dcp_inside_the_context_keeps_its_bytes(root):
    """DCP closes the stream itself before create_stream's context exits (torch's _write_files_from_queue)."""
    store = storage_for(root)
    path = join(_step(root, store), "__0_0.distcp")
    fs = store.writer_filesystem()
    fs.init_path(root)
    with fs.create_stream(path, "wb") as stream:
        stream.write(b"a" * 1000)
        stream.write(memoryview(b"b" * 24))
        assert stream.tell() == 1024
        stream.close()
    assert store.read(path) == b"a" * 1000 + b"b" * 24


def test_a_failed_dcp_write_leaves_no_visible_partial_file(root):
    store = storage_for(root)
    path = join(_step(root, store), "__0_0.distcp")
    fs = store.writer_filesystem()
    fs.init_path(root)
    with pytest.raises(RuntimeError, match="disk gone"):
        with fs.create_stream(path, "wb") as stream:
            stream.write(b"a" * 1000)
            raise RuntimeError("disk gone")
    if store.partial_writes:  # a folder: the torn file stays in the unmarked step, which no reader trusts
        assert not store.exists(join(path.rsplit("/", 1)[0], "commit.json"))
    else:
        assert not store.exists(path) and store.listdir(path.rsplit("/", 1)[0]) == []


class _CountingLoad:
    """A reader variant written once for every backend (as export's single copy is)."""
    loaded = 0

    def load_item(self, req, stream, planner) -> None:
        _CountingLoad.loaded += 1
        super().load_item(req, stream, planner)


def test_dcp_save_and_load_round_trip_through_the_backend(root):
    store = storage_for(root)
    path = _step(root, store)
    state = {"w": torch.arange(12.0).reshape(3, 4), "b": torch.tensor([1, 2, 3]), "meta": {"step": 2}}
    metadata = dcp.save(state, storage_writer=ChecksummingWriter(path), no_dist=True)
    # the data files, and the index of .metadata the writer writes beside it (ckpt/metadata_index.py)
    assert set(metadata.file_digests) == {n for n in store.listdir(path) if n.endswith(".distcp") or
                                          n.startswith(".metadata.index")}
    assert ".metadata" in store.listdir(path)
    loaded = {"w": torch.zeros(3, 4), "b": torch.zeros(3, dtype=torch.long), "meta": {"step": 0}}
    dcp.load(loaded, storage_reader=store.dcp_reader(path), no_dist=True)
    assert torch.equal(loaded["w"], state["w"]) and torch.equal(loaded["b"], state["b"])
    assert loaded["meta"] == {"step": 2}
    again = {"w": torch.zeros(3, 4), "b": torch.zeros(3, dtype=torch.long)}
    _CountingLoad.loaded = 0
    dcp.load(again, storage_reader=reader_with(_CountingLoad, path), no_dist=True)
    assert torch.equal(again["w"], state["w"]) and _CountingLoad.loaded == 2

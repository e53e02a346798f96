"""Checkpoint storage on object stores: S3, against a real S3-compatible server (moto's server mode), and Azure Blob
Storage, against Azurite (Microsoft's emulator), both started on 127.0.0.1. The tests whose body is the same for
every store take the `store` fixture and run once per store.

    python -m pytest tests/test_s3.py -q -p no:cacheprovider          # -k az: Azure only

Long: the Azure cases (-k az) took 615 s together on 2026-11-26, on a 2-core machine shared with other jobs; most
of it the torchrun runs. The unreachable-endpoint cases wait out Azure's retries (about 20 s) once, in
test_verify_with_the_server_unreachable; the others try once (CKPT_AZURE_MAX_ATTEMPTS=1, as AWS_MAX_ATTEMPTS=1).

End to end once: a promise whose store-specific part is the backend's contract runs its training end to end on S3
only (ONE_STORE); on Azure that part is checked by tests/test_storage_backends.py[az] and the store-level tests
here. Kill during an upload: test_a_failed_dcp_write_leaves_no_visible_partial_file[az],
test_a_leftover_in_the_way_of_a_save_is_cleared[az]; a flipped byte and a held lock at resume:
test_verify_reads_a_checkpoint_on_the_store_and_catches_a_flipped_byte[az],
test_lock_on_the_store_refuses_a_second_job_and_takes_over_a_dead_one[az]. Training, saving from the uploader
process, resuming and exporting on Azure stay end to end (the resume and retention tests).
"""

from __future__ import annotations

import json
import os
import re
import socket
import time
import warnings

import botocore.exceptions
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from ckpt.checksum import ChecksummingWriter
from ckpt.errors import CheckpointError
from ckpt.commit_protocol import VerifyError, commit_checkpoint, verify_checkpoint
from ckpt.storage import LocalStorage, join, storage_for, unsupported
from ckpt.storage.s3 import S3Storage
from ckpt.layout import list_step_dirs
from conftest import ROOT, ckpt_cli, events, free_port, losses, run_train, start_on_free_port
from azurite_server import CONTAINER, azure_env, azurite_server, connection_string  # noqa: F401 - fixtures
from s3_server import BUCKET, s3_client, s3_env, s3_proxy, s3_server  # noqa: F401 - fixtures


class ObjectStore:
    """One object store under test: `root` (scheme://bucket), `env` (what a run needs to reach it), `unreachable`
    (the same with the endpoint on a port where nothing listens)."""

    def __init__(self, scheme: str, env: dict):
        self.scheme, self.env = scheme, env
        self.root = f"{scheme}://{BUCKET if scheme == 's3' else CONTAINER}"
        if scheme == "s3":
            self.unreachable = {**env, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{free_port()}", "AWS_MAX_ATTEMPTS": "1"}
        else:  # one attempt, as AWS_MAX_ATTEMPTS=1 (the default's bound: test_verify_with_the_server_unreachable)
            self.unreachable = {**env, "AZURE_STORAGE_CONNECTION_STRING": connection_string(free_port()),
                                "CKPT_AZURE_MAX_ATTEMPTS": "1"}


@pytest.fixture(params=["s3", "az"])
def store(request) -> ObjectStore:
    """Each object store in turn, its environment in os.environ for the test (in-process clients)."""
    return ObjectStore(request.param, request.getfixturevalue("s3_env" if request.param == "s3" else "azure_env"))


def _overwrite(path: str, data: bytes) -> None:
    """Replace an object's bytes behind the checkpoint code's back (a flipped byte, as bit rot would)."""
    objects = storage_for(path)
    objects.delete(path)
    objects.create(path, data)


def test_server_refuses_a_second_create_only_put(s3_env):
    """The commit marker relies on it: a second PUT with If-None-Match: * of the same key fails with 412, and a PUT
    with If-Match of an old ETag fails too (the lock's compare-and-swap)."""
    c = s3_client(s3_env)
    first = c.put_object(Bucket=BUCKET, Key="raw/commit.json", Body=b"1", IfNoneMatch="*")["ETag"]
    with pytest.raises(botocore.exceptions.ClientError) as e:
        c.put_object(Bucket=BUCKET, Key="raw/commit.json", Body=b"2", IfNoneMatch="*")
    assert e.value.response["ResponseMetadata"]["HTTPStatusCode"] == 412
    c.put_object(Bucket=BUCKET, Key="raw/commit.json", Body=b"3", IfMatch=first)
    with pytest.raises(botocore.exceptions.ClientError) as e:
        c.put_object(Bucket=BUCKET, Key="raw/commit.json", Body=b"4", IfMatch=first)
    assert e.value.response["ResponseMetadata"]["HTTPStatusCode"] == 412
    assert c.get_object(Bucket=BUCKET, Key="raw/commit.json")["Body"].read() == b"3"


@pytest.mark.parametrize("backend", ["local", "s3"])
def test_storage_operations_behave_alike(backend, s3_env, tmp_path):
    root = str(tmp_path) if backend == "local" else f"s3://{BUCKET}/ops-{tmp_path.name}"
    store = storage_for(root)
    assert isinstance(store, LocalStorage if backend == "local" else S3Storage)
    marker = join(root, "step-000002", "commit.json")
    if backend == "local":
        (tmp_path / "step-000002").mkdir()
    assert not store.exists(marker) and store.listdir(join(root, "step-000002")) == []
    store.create(marker, b'{"step": 2}')
    with pytest.raises(FileExistsError):
        store.create(marker, b'{"step": 3}')
    assert store.read(marker) == b'{"step": 2}'
    assert store.listdir(join(root, "step-000002")) == ["commit.json"]
    store.delete(marker)
    assert not store.exists(marker)
    store.create(marker, b"again")  # create-only refuses an existing object, not a deleted one
    assert store.read(marker) == b"again"


def test_s3_replace_is_compare_and_swap(s3_env, tmp_path):
    store = S3Storage()
    lock = f"s3://{BUCKET}/cas-{tmp_path.name}/.lock"
    tag = store.create(lock, b"holder 1")
    assert store.etag(lock) == tag
    tag2 = store.replace(lock, b"heartbeat", tag)
    with pytest.raises(FileExistsError):
        store.replace(lock, b"someone else", tag)  # an ETag read before the heartbeat: refused
    assert store.read(lock) == b"heartbeat" and store.etag(lock) == tag2


def test_azurite_refuses_a_second_create_and_a_stale_etag(azure_env):
    """What the az:// marker and lock rely on, asked of the emulator directly: Put Blob with If-None-Match: * refuses
    an existing blob, and with If-Match an ETag that is no longer the blob's."""
    from azure.core import MatchConditions
    from azure.core.exceptions import ResourceExistsError, ResourceModifiedError

    from azurite_server import blob_client

    blob = blob_client(azure_env).get_blob_client(CONTAINER, "raw/commit.json")
    first = blob.upload_blob(b"1", overwrite=False)["etag"]
    with pytest.raises(ResourceExistsError):
        blob.upload_blob(b"2", overwrite=False)
    blob.upload_blob(b"3", overwrite=True, etag=first, match_condition=MatchConditions.IfNotModified)
    with pytest.raises(ResourceModifiedError):
        blob.upload_blob(b"4", overwrite=True, etag=first, match_condition=MatchConditions.IfNotModified)
    assert blob.download_blob().readall() == b"3"


def test_azure_upload_in_blocks_appears_only_at_close(azure_env, tmp_path):
    """A file DCP writes goes up as blocks, in parallel; the blob appears only when close() commits the list, and
    an upload that fails after blocks went up leaves no blob."""
    from ckpt.storage.azure import AzureStorage, BlockUploadStream

    objects, root = AzureStorage(), f"az://{CONTAINER}/blocks-{tmp_path.name}"
    data = os.urandom(1000)
    with BlockUploadStream(objects, f"{root}/whole", part_bytes=64, parallel=3) as out:
        for i in range(0, len(data), 100):
            out.write(data[i:i + 100])
        assert len(out._parts) == 15 and not objects.exists(f"{root}/whole")  # 15 blocks up, none visible
    assert objects.read(f"{root}/whole") == data and out.tell() == 1000
    with pytest.raises(RuntimeError, match="disk gone"):
        with BlockUploadStream(objects, f"{root}/torn", part_bytes=64, parallel=3) as out:
            out.write(data)
            raise RuntimeError("disk gone")
    assert objects.listdir(root) == ["whole"]


@pytest.mark.parametrize("path, expected", [
    ("runs/x", None),
    ("s3://bucket/prefix", None),
    ("s3://", "names no bucket"),
    ("az://container/prefix", None),
    ("az://", "names no container"),
    ("gs://bucket/prefix", "gs:// is not supported"),
])
def test_which_paths_are_refused(path, expected):
    problem = unsupported(path, "config key 'ckpt.dir'")
    assert (problem is None) if expected is None else (expected in problem and problem.startswith("config key"))


def test_local_only_paths_refuse_urls():
    assert "must be a local path" in unsupported("s3://b/run", "config key 'run.dir'", local_only="why")
    assert unsupported("runs/x", "config key 'run.dir'", local_only="why") is None


def _one_error_line(proc, needle: str) -> None:
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert [line for line in lines if line.startswith("error: ")] == lines[-1:] and needle in lines[-1], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("key, value, needle", [
    ("run.dir", "s3://{b}/{n}", "config key 'run.dir' must be a local path, got 's3://{b}/{n}'"),
    ("data.cache_dir", "s3://{b}/{n}", "config key 'data.cache_dir' must be a local path, got 's3://{b}/{n}'"),
    ("ckpt.dir", "gs://{b}/{n}", "config key 'ckpt.dir': gs:// is not supported, got 'gs://{b}/{n}'"),
    ("ckpt.resume", "s3://", "config key 'ckpt.resume': 's3://' names no bucket"),
])
def test_training_never_writes_a_url_into_a_local_folder(key, value, needle, tmp_path):
    """Before: ckpt.dir=s3://bucket/run made a local folder `s3:` in the working directory and the run 'succeeded'.
    Now s3:// works for ckpt.dir and ckpt.resume (tests below); every other URL is one error line."""
    value, needle = (t.format(b=BUCKET, n=tmp_path.name) for t in (value, needle))
    run_dir = value if key == "run.dir" else tmp_path / "run"
    proc = run_train(run_dir, nproc=0, overrides=[f"{key}={value}", "train.max_steps=2"], check=False, timeout=120)
    _one_error_line(proc, needle)
    assert not os.path.exists(os.path.join(ROOT, "s3:")) and not os.path.exists(os.path.join(ROOT, "gs:"))
    assert not (tmp_path / "run").exists()



def test_verify_reads_a_checkpoint_on_the_store_and_catches_a_flipped_byte(store, tmp_path):
    from test_ckpt_unit import DATA, fake_checkpoint

    local = fake_checkpoint(tmp_path / "local", 5)
    root = f"{store.root}/verify-{tmp_path.name}"
    url = f"{root}/step-000005"
    storage_for(url).put_folder(local, url)
    ok = ckpt_cli("verify", url, "--jobs", "2", env=store.env)
    # 4: the shard, .metadata, its index (.metadata.index: ckpt/metadata_index.py) and meta.json
    assert ok.returncode == 0 and ok.stdout.startswith(f"OK: {url}: step 5, 4 files"), ok.stderr[-2000:]
    assert "a checkpoints folder (1 step-* folder)" in ckpt_cli("verify", root, env=store.env).stderr

    objects = storage_for(url)
    data = bytearray(objects.read(f"{url}/{DATA}"))
    data[-7] ^= 0xFF
    _overwrite(f"{url}/{DATA}", bytes(data))  # same size, one byte changed
    bad = ckpt_cli("verify", url, env=store.env)
    assert bad.returncode == 1 and bad.stderr.strip() == f"INVALID: {url}/{DATA}: checksum mismatch (xxh3_128)"
    objects.delete(f"{url}/{DATA}")
    gone = ckpt_cli("verify", url, env=store.env)
    assert gone.returncode == 1 and gone.stderr.strip().endswith(f"{url}/{DATA}: missing"), gone.stderr
    objects.delete(f"{url}/commit.json")
    unmarked = ckpt_cli("verify", url, env=store.env)
    assert unmarked.returncode == 1 and "missing commit marker (checkpoint never committed)" in unmarked.stderr


def test_verify_with_the_server_unreachable_is_one_error_line(store):
    started = time.monotonic()  # Azure's production retries, waited out once here; the other cases try once
    default_retries = {**store.unreachable, "CKPT_AZURE_MAX_ATTEMPTS": ""}
    proc = ckpt_cli("verify", f"{store.root}/run/step-000002", env=default_retries)
    _one_error_line(proc, f"cannot read {store.root}/run/step-000002")
    assert time.monotonic() - started < 60  # retries are bounded: the line comes in seconds, not minutes
    with pytest.MonkeyPatch.context() as mp:
        for key, value in store.unreachable.items():
            mp.setenv(key, value)
        with pytest.raises(VerifyError, match=r"commit.json: cannot be read \(Could not connect to the endpoint URL"):
            verify_checkpoint(f"{store.root}/run-unreachable/step-000002")


# ---------------------------------------------------------------- DCP save, commit and load on each store

def _state(rank: int, step: int) -> dict:
    return {"w": torch.arange(4000.0) + step, f"rng_{rank}": torch.full((3,), float(rank))}


def _save_worker(rank, world_size, port, url, env):
    os.environ.update(env)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        metadata = dcp.save(_state(rank, 7), storage_writer=ChecksummingWriter(url))
        if rank == 0:
            storage_for(url).create(f"{url}/meta.json", json.dumps({"step": 7, "world_size": world_size}).encode())
            commit_checkpoint(url, world_size, metadata.file_digests, metadata, ["meta.json"])
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_two_ranks_save_to_the_store_commit_once_and_load_at_one_rank(store, tmp_path):
    """Every rank uploads its shard through the backend's DCP writer file system, checksummed as written; rank 0
    writes the marker last with a create-only PUT; the checkpoint verifies and loads at another world size. No
    rename: no .metadata.tmp object is left, and a second commit of the same step is refused, the first marker kept."""
    url = f"{store.root}/dcp-{tmp_path.name}/step-000007"
    start_on_free_port(_save_worker, lambda port: (2, port, url, dict(store.env)), nprocs=2)
    objects = storage_for(url)
    names = objects.listdir(url)
    assert names == [".metadata", ".metadata.index", "__0_0.distcp", "__1_0.distcp", "commit.json", "meta.json"], names
    marker = verify_checkpoint(url, jobs=2)
    assert marker["world_size"] == 2 and set(marker["files"]) == set(names) - {"commit.json"}
    first = objects.read(f"{url}/commit.json")
    with pytest.raises(FileExistsError):
        commit_checkpoint(url, 2, marker["files"], objects.dcp_reader(url).read_metadata(), [])
    assert objects.read(f"{url}/commit.json") == first

    loaded = {"w": torch.zeros(4000), "rng_0": torch.zeros(3), "rng_1": torch.zeros(3)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no process group: loading in a single process" is the intent
        dcp.load(loaded, storage_reader=objects.dcp_reader(url), no_dist=True)
    assert torch.equal(loaded["w"], torch.arange(4000.0) + 7) and torch.equal(loaded["rng_1"], torch.ones(3))
    local = f"{store.scheme}:"
    assert not os.path.exists(os.path.join(ROOT, local)) and not os.path.exists(str(tmp_path / local))


# ---------------------------------------------------------------- the run lock on each store

def test_lock_on_the_store_refuses_a_second_job_and_takes_over_a_dead_one(store, tmp_path, monkeypatch):
    import ckpt.storage.lock as lock_module
    from ckpt.lock import LockError, ObjectLock, lock_for_job

    root = f"{store.root}/lock-{tmp_path.name}"
    first = lock_for_job(root, None)
    assert isinstance(first, ObjectLock)
    objects = storage_for(root)
    record = json.loads(objects.read(f"{root}/.lock"))
    assert record["pid"] == os.getpid() and record["host"] == socket.gethostname()
    with pytest.raises(CheckpointError, match=rf"ckpt.dir {re.escape(store.root)}/lock-\S+ is in use by another job "
                                              rf"\(pid {os.getpid()} on .*\); stop it or point ckpt.dir elsewhere"):
        lock_for_job(root, None)
    first.release()
    assert not objects.exists(f"{root}/.lock")

    # another host, fresh heartbeat: refused, saying how to tell it is dead; stale: taken over with a warning
    other = {"host": "node-17", "pid": 4242, "started": "then", "heartbeat": time.time() - 70}
    objects.create(f"{root}/.lock", json.dumps(other).encode())
    with pytest.raises(LockError, match=r"pid 4242 on node-17, .*last heartbeat 70s ago\); a live job rewrites its "
                                        r"heartbeat every 60 s: if node-17 is down .*taken over 10 min after"):
        ObjectLock(root, objects).acquire()
    objects.replace(f"{root}/.lock", json.dumps({**other, "heartbeat": time.time() - 700}).encode(),
                  objects.etag(f"{root}/.lock"))
    warnings_seen = []
    monkeypatch.setattr(lock_module, "HEARTBEAT_S", 0.2)
    taker = ObjectLock(root, objects, warn=warnings_seen.append)
    taker.acquire()
    assert "taking over" in warnings_seen[0] and "pid 4242 on node-17" in warnings_seen[0]
    beat = json.loads(objects.read(f"{root}/.lock"))["heartbeat"]
    time.sleep(1.0)
    assert json.loads(objects.read(f"{root}/.lock"))["heartbeat"] > beat  # the heartbeat is a CAS that succeeds

    # someone replaces the object behind the holder's back: its next heartbeat's CAS fails, it says so, and
    # its release leaves the new holder's object alone
    for _ in range(100):  # a compare-and-swap, as a real job taking over does: retried if a heartbeat came between
        try:
            objects.replace(f"{root}/.lock", json.dumps({**other, "heartbeat": time.time()}).encode(),
                          objects.etag(f"{root}/.lock"))
            break
        except FileExistsError:
            time.sleep(0.01)
    time.sleep(1.0)
    assert any("was taken over by another job" in w for w in warnings_seen)
    taker.release()
    assert json.loads(objects.read(f"{root}/.lock"))["pid"] == 4242


# ---------------------------------------------------------------- training on each store (torchrun, 2 ranks, gloo)

S3_RUN = ["train.max_steps=8", "ckpt.interval=4", "ckpt.keep_last=0"]


def test_training_on_the_store_resumes_bit_identically_and_at_another_world_size(store, tmp_path):
    straight_url = f"{store.root}/{tmp_path.name}/straight"
    straight = tmp_path / "straight"
    run_train(straight, nproc=2, overrides=[*S3_RUN, f"ckpt.dir={straight_url}"], env=store.env)
    assert [s for s, _ in list_step_dirs(straight_url)] == [4, 8]
    assert verify_checkpoint(f"{straight_url}/step-000008")["world_size"] == 2

    url, run = f"{store.root}/{tmp_path.name}/killed", tmp_path / "killed"
    killed = run_train(run, nproc=2, overrides=[*S3_RUN, f"ckpt.dir={url}", "ckpt.async_mode=off"],
                       env={**store.env, "CKPT_FAULT": "kill@after_step:6"}, check=False)
    assert killed.returncode != 0 and max(losses(run)) == 6
    run_train(run, nproc=2, overrides=[*S3_RUN, f"ckpt.dir={url}"], env=store.env)
    assert [e["step"] for e in events(run, "resume")] == [4]
    a, b = losses(straight), losses(run)
    assert sorted(b) == list(range(1, 9)) and all(a[k] == b[k] for k in a), {k: (a[k], b[k]) for k in a}

    one = tmp_path / "one-rank"
    run_train(one, nproc=0, overrides=[*S3_RUN, f"ckpt.dir={store.root}/{tmp_path.name}/one",
                                       f"ckpt.resume={straight_url}/step-000004"], env=store.env)
    resumed = events(one, "resume")
    assert [(e["step"], e["world_size"], e["saved_world_size"]) for e in resumed] == [(4, 1, 2)]
    assert sorted(losses(one)) == [5, 6, 7, 8]  # a new run.dir: it logs the steps it trained, at W=1
    assert [s for s, _ in list_step_dirs(f"{store.root}/{tmp_path.name}/one")] == [8]
    local = f"{store.scheme}:"
    assert not os.path.exists(os.path.join(ROOT, local)) and not list(tmp_path.rglob(local))


ONE_STORE = pytest.mark.parametrize("store", ["s3"], indirect=True)  # Azure's part: see "End to end once" above


@ONE_STORE
def test_resume_from_the_store_skips_a_flipped_byte_and_a_second_job_is_refused(store, tmp_path):
    url, run = f"{store.root}/{tmp_path.name}/ckpt", tmp_path / "run"
    run_train(run, nproc=0, overrides=["train.max_steps=4", "ckpt.interval=2", "ckpt.keep_last=0", f"ckpt.dir={url}"],
              env=store.env)
    objects = storage_for(url)
    shard = f"{url}/step-000004/__0_0.distcp"
    data = bytearray(objects.read(shard))
    data[len(data) // 2] ^= 0x01
    _overwrite(shard, bytes(data))
    bad = ckpt_cli("verify", f"{url}/step-000004", env=store.env)
    assert bad.returncode == 1 and bad.stderr.strip() == f"INVALID: {shard}: checksum mismatch (xxh3_128)"

    run_train(run, nproc=0, overrides=["train.max_steps=6", "ckpt.interval=2", "ckpt.keep_last=0", f"ckpt.dir={url}"],
              env=store.env)
    assert [(e["step"], e["reason"]) for e in events(run, "resume_skip")] == [(4, f"{shard}: checksum mismatch (xxh3_128)")]
    assert [e["step"] for e in events(run, "resume")] == [2]

    # a live job holds the prefix (this very process, on this host): the second one stops with one line
    objects.create(f"{url}/.lock", json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "started": "now",
                                               "heartbeat": time.time()}).encode())
    second = run_train(tmp_path / "second", nproc=0, overrides=["train.max_steps=2", f"ckpt.dir={url}"], env=store.env,
                       check=False)
    _one_error_line(second, f"ckpt.dir {url} is in use by another job (pid {os.getpid()} on {socket.gethostname()}")
    assert not (tmp_path / "second").exists()


def test_store_unreachable_at_start_is_one_error_line(store, tmp_path):
    proc = run_train(tmp_path / "run", nproc=0, overrides=["train.max_steps=2", f"ckpt.dir={store.root}/x"],
                     env=store.unreachable, check=False, timeout=120)
    _one_error_line(proc, f"ckpt.dir {store.root}/x is not writable: Could not connect to the endpoint URL")


def test_azure_without_credentials_is_one_error_line_naming_the_variable(azurite_server, tmp_path):
    env = {k: "" for k in ("AZURE_STORAGE_CONNECTION_STRING", "AZURE_STORAGE_ACCOUNT_NAME",
                           "AZURE_STORAGE_ACCOUNT_KEY", "AZURE_STORAGE_SAS_TOKEN")}
    proc = run_train(tmp_path / "run", nproc=0, overrides=["train.max_steps=2", f"ckpt.dir=az://{CONTAINER}/x"],
                     env=env, check=False, timeout=120)
    _one_error_line(proc, f"error: ckpt.dir az://{CONTAINER}/x is not writable: no Azure credentials in the "
                          "environment: set AZURE_STORAGE_CONNECTION_STRING, or AZURE_STORAGE_ACCOUNT_NAME with "
                          "AZURE_STORAGE_ACCOUNT_KEY or AZURE_STORAGE_SAS_TOKEN")


def test_retention_on_the_store_deletes_marker_then_objects_and_sweeps_unmarked_prefixes(store, tmp_path):
    url, run = f"{store.root}/{tmp_path.name}/ckpt", tmp_path / "run"
    objects = storage_for(url)
    objects.create(f"{url}/step-000001/__0_0.distcp", b"a crashed save's shard, never marked")
    run_train(run, nproc=0, overrides=["train.max_steps=6", "ckpt.interval=2", "ckpt.keep_last=1", f"ckpt.dir={url}",
                                       "ckpt.async_mode=process"], env=store.env)  # uploads from the uploader process
    assert [(e["step"], e["mode"]) for e in events(run, "checkpoint")] == [(2, "process"), (4, "process"), (6, "sync")]
    assert [s for s, _ in list_step_dirs(url)] == [6]
    assert objects.listdir(url) == ["step-000006"]  # the lock object went with the job
    deleted = [p for e in events(run, "retention") for p in e["deleted"]]
    assert deleted == [f"{url}/step-000001", f"{url}/step-000002", f"{url}/step-000004"], deleted
    verify_checkpoint(f"{url}/step-000006")
    _inspect_reshard_and_export(store, f"{url}/step-000006", tmp_path)


def _inspect_reshard_and_export(store: ObjectStore, step: str, tmp_path) -> None:
    """`python -m ckpt` inspect, reshard and export, reading from the store and writing to it."""
    listing = ckpt_cli("inspect", step.rsplit("/", 1)[0], env=store.env)
    assert listing.returncode == 0 and "committed, verified" in listing.stdout.splitlines()[1], listing.stderr[-2000:]
    shown = ckpt_cli("inspect", step, env=store.env)
    assert shown.returncode == 0 and f"{step}: step 6, saved by 1 rank, committed, verified" in shown.stdout
    resharded = f"{store.root}/{tmp_path.name}/resharded/step-000006"
    proc = ckpt_cli("reshard", "--world-size", "2", step, resharded, env=store.env)
    assert proc.returncode == 0 and verify_checkpoint(resharded)["world_size"] == 2, proc.stderr[-2000:]
    hf, local = f"{store.root}/{tmp_path.name}/hf", tmp_path / "hf"
    for out in (hf, str(local)):
        proc = ckpt_cli("export", step, out, env=store.env)
        assert proc.returncode == 0 and proc.stdout.startswith(f"OK: {step} -> {out}"), proc.stderr[-2000:]
    assert storage_for(hf).listdir(hf) == sorted(os.listdir(local))
    assert storage_for(hf).read(f"{hf}/model.safetensors") == (local / "model.safetensors").read_bytes()


@ONE_STORE
def test_kill_during_upload_to_the_store_or_before_the_marker_leaves_no_marker(store, tmp_path):
    """SIGKILL while the shards go up, then after every rank's data is up but before the marker: neither leaves a
    marker over step 4; each next start resumes from step 2, and the last one saves step 4 again over the leftover."""
    url, run = f"{store.root}/{tmp_path.name}/ckpt", tmp_path / "run"
    overrides = ["train.max_steps=6", "ckpt.interval=2", "ckpt.keep_last=0", "ckpt.async_mode=off", f"ckpt.dir={url}"]
    for fault in ("kill@write:4", "kill@before_commit:4"):
        killed = run_train(run, nproc=2, overrides=overrides, env={**store.env, "CKPT_FAULT": fault}, check=False)
        assert killed.returncode != 0, fault
        assert [s for s, _ in list_step_dirs(url)] == [2, 4]
        assert not storage_for(url).exists(f"{url}/step-000004/commit.json")
    run_train(run, nproc=2, overrides=overrides, env=store.env)
    assert [e["step"] for e in events(run, "resume")] == [2, 2]
    assert verify_checkpoint(f"{url}/step-000004")["step"] == 4 and verify_checkpoint(f"{url}/step-000006")


@pytest.mark.parametrize("keep_going", [False, True], ids=["stop", "continue_on_save_error"])
def test_s3_server_down_mid_run_fails_the_save_and_keeps_the_committed_one(s3_env, tmp_path, keep_going):
    """The server goes away after step 3: the saves after it fail; training stops, or goes on with
    ckpt.continue_on_save_error=true; step 2, committed before, is intact once the server is back."""
    import threading

    from s3_server import start_server

    server, env = start_server()
    port = int(env["AWS_ENDPOINT_URL"].rsplit(":", 1)[1])
    flag, url, run = tmp_path / "after-step-3", f"s3://{BUCKET}/{tmp_path.name}/ckpt", tmp_path / "run"
    overrides = ["train.max_steps=6", "ckpt.interval=2", "ckpt.keep_last=0", "ckpt.async_mode=off", f"ckpt.dir={url}",
                 f"ckpt.continue_on_save_error={str(keep_going).lower()}"]
    fault = {"CKPT_FAULT": f"sleep@after_step:3,secs=8,file={flag}", "AWS_MAX_ATTEMPTS": "1"}
    result = {}
    job = threading.Thread(target=lambda: result.update(proc=run_train(run, nproc=0, overrides=overrides,
                                                                        env={**env, **fault}, check=False)))
    job.start()
    while job.is_alive() and not flag.exists():
        time.sleep(0.1)
    server.stop()
    job.join()
    server, _ = start_server(port)  # the same store, back online, to look at what the job left
    try:
        proc = result["proc"]
        last = proc.stderr.strip().splitlines()[-1]
        failed = f"{url}/step-{6 if keep_going else 4:06d}"  # with continue: the final save is the one that stops it
        assert proc.returncode != 0 and last.startswith(f"error: writing checkpoint {failed} failed: ConnectionError: "
                                                        "Could not connect to the endpoint URL"), proc.stderr[-3000:]
        assert max(losses(run)) == (6 if keep_going else 4), proc.stderr[-3000:]
        assert verify_checkpoint(f"{url}/step-000002")["step"] == 2
        assert not S3Storage().exists(f"{url}/step-000004/commit.json")
    finally:
        server.stop()

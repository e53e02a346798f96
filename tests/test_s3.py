"""Checkpoint storage on S3, against a real S3-compatible server (moto's server mode) started on 127.0.0.1.

    python -m pytest tests/test_s3.py -q -p no:cacheprovider
"""

from __future__ import annotations

import botocore.exceptions
import pytest

from ckpt.storage import LocalStorage, S3Storage, join, storage_for, unsupported
from tests.s3_server import BUCKET, s3_client, s3_env, s3_server  # noqa: F401 - fixtures


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


@pytest.mark.parametrize("path, expected", [
    ("runs/x", None),
    ("s3://bucket/prefix", None),
    ("s3://", "names no bucket"),
    ("gs://bucket/prefix", "gs:// is not supported"),
])
def test_which_paths_are_refused(path, expected):
    problem = unsupported(path, "config key 'ckpt.dir'")
    assert (problem is None) if expected is None else (expected in problem and problem.startswith("config key"))


def test_local_only_paths_refuse_urls():
    assert "must be a local path" in unsupported("s3://b/run", "config key 'run.dir'", remote_ok=False)
    assert unsupported("runs/x", "config key 'run.dir'", remote_ok=False) is None

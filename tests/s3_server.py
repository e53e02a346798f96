"""A real S3-compatible server (moto in server mode, the one s3fs's own tests use) on 127.0.0.1, for the tests.

    python -m pytest tests/test_s3.py -q

`s3_server` (a pytest fixture, session scope) starts it on a free port, creates BUCKET, and returns the
environment a run needs: AWS_ENDPOINT_URL and dummy credentials, the standard variables boto3 and s3fs read.
`s3_env` (function scope) puts that environment into os.environ for one test and takes it out after.
"""

from __future__ import annotations

import os
import socket

import pytest

BUCKET = "ckpt-test"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(port: int | None = None):
    """(server, env): a moto S3 server on 127.0.0.1 (`port`, or a free one) holding BUCKET. Servers of one
    process share their buckets (moto keeps them in process memory), so one stopped and started again on its port
    is the same store back online."""
    moto_server = pytest.importorskip("moto.server")
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port or _free_port(), verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    env = {"AWS_ENDPOINT_URL": f"http://{host}:{port}", "AWS_ACCESS_KEY_ID": "testing",
           "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
    try:
        s3_client(env).create_bucket(Bucket=BUCKET)
    except Exception as e:  # noqa: BLE001 - already there (another server of this process made it)
        if "BucketAlreadyOwnedByYou" not in str(e):
            raise
    return server, env


@pytest.fixture(scope="session")
def s3_server():
    server, env = start_server()
    try:
        yield env
    finally:
        server.stop()


@pytest.fixture
def s3_env(s3_server, monkeypatch):
    for key, value in s3_server.items():
        monkeypatch.setenv(key, value)
    return s3_server


def s3_client(env: dict):
    """A boto3 client of the test server (for checks the code under test must not do itself)."""
    import boto3

    return boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
                        aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"], region_name=env["AWS_DEFAULT_REGION"])

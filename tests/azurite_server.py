"""Azurite, Microsoft's Azure Storage emulator (`azurite-blob`, npm package azurite, installed by .ci/run), on
127.0.0.1 for the tests: the Blob service, with its published development account.

    python -m pytest tests/test_storage_backends.py -q -k az

`azurite_server` (a pytest fixture, session scope: the emulator starts once per test run) starts it on a free port
with its data in a temporary folder, creates CONTAINER, and returns the environment a run needs:
AZURE_STORAGE_CONNECTION_STRING, the standard variable. `azure_env` (function scope) puts it into os.environ for
one test. Without `azurite-blob` on PATH the tests that need it skip, saying so.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time

import pytest

from conftest import free_port

CONTAINER = "ckpt-test"
BUCKET = CONTAINER  # the name bench/s3_bench.py asks every store's emulator for
# Azurite's well-known development account (published in its README; it guards nothing)
ACCOUNT = "devstoreaccount1"
KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="


def connection_string(port: int) -> str:
    return (f"DefaultEndpointsProtocol=http;AccountName={ACCOUNT};AccountKey={KEY};"
            f"BlobEndpoint=http://127.0.0.1:{port}/{ACCOUNT};")


class NotInstalled(RuntimeError):
    """Azurite is not installed here: the tests skip, the benchmark says so in one line."""


def start_server(port: int | None = None, location: str | None = None):
    """(server, env): Azurite's Blob service on 127.0.0.1 (`port`, or a free one) holding CONTAINER, its data in
    `location` (a new temporary folder if None; the same folder and port: the same store back online)."""
    if shutil.which("azurite-blob") is None:
        raise NotInstalled("azurite-blob is not on PATH (npm install -g azurite@3.37.0, as .ci/run does)")
    port = port or free_port()
    location = location or tempfile.mkdtemp(prefix="azurite-")
    errors = open(os.path.join(location, "azurite.stderr"), "ab")  # a file: a pipe nobody reads could fill up
    server = subprocess.Popen(["azurite-blob", "--silent", "--location", location, "--blobHost", "127.0.0.1",
                               "--blobPort", str(port), "--skipApiVersionCheck"],
                              stdout=subprocess.DEVNULL, stderr=errors)
    errors.close()  # the child has its own descriptor
    server.location = location
    deadline = time.monotonic() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                server.kill()
                with open(os.path.join(location, "azurite.stderr"), errors="replace") as f:
                    raise RuntimeError(f"azurite-blob did not start on port {port}: {f.read()[-2000:]}")
            time.sleep(0.2)
    env = {"AZURE_STORAGE_CONNECTION_STRING": connection_string(port)}
    container = blob_client(env).get_container_client(CONTAINER)
    if not container.exists():
        container.create_container()
    return server, env


def stop_server(server) -> None:
    server.terminate()  # Azurite then waits for open keep-alive connections (this process's clients hold some)
    try:
        server.wait(timeout=3)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()


@pytest.fixture(scope="session")
def azurite_server():
    try:
        server, env = start_server()
    except NotInstalled as e:
        pytest.skip(str(e))
    try:
        yield env
    finally:
        stop_server(server)
        shutil.rmtree(server.location, ignore_errors=True)


@pytest.fixture
def azure_env(azurite_server, monkeypatch):
    for key in ("AZURE_STORAGE_ACCOUNT_NAME", "AZURE_STORAGE_ACCOUNT_KEY", "AZURE_STORAGE_SAS_TOKEN"):
        monkeypatch.delenv(key, raising=False)
    for key, value in azurite_server.items():
        monkeypatch.setenv(key, value)
    return azurite_server


def blob_client(env: dict):
    """An SDK client of the emulator (for checks the code under test must not do itself)."""
    from azure.storage.blob import BlobServiceClient

    return BlobServiceClient.from_connection_string(env["AZURE_STORAGE_CONNECTION_STRING"])

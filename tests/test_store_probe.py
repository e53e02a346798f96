"""The object store's guarantees checked on the store, not assumed: the probe (ckpt/storage/base.py
`Storage.check_guarantees`) on the moto test server, which enforces If-None-Match and If-Match, and behind a proxy
that strips those headers (tests/s3_server.py `S3Proxy.strip`), a server that really ignores them.

    python -m pytest tests/test_store_probe.py -q -p no:cacheprovider
"""

from __future__ import annotations


import pytest

from ckpt.commit_protocol import verify_checkpoint
from ckpt.layout import list_step_dirs
from ckpt.storage import LocalStorage
from ckpt.storage.s3 import S3Storage
from ckpt.storage.azure import AzureStorage
from ckpt.storage import base as storage_base
from ckpt.storage.base import GuaranteeError
from conftest import ckpt_cli, losses, run_train
from azurite_server import CONTAINER, azure_env, azurite_server  # noqa: F401 - fixtures
from s3_server import BUCKET, s3_env, s3_proxy, s3_server  # noqa: F401 - fixtures
from test_launch import TORCHRUN_EXIT, assert_one_error

CONDITIONS = {"if-none-match", "if-match"}


@pytest.fixture(autouse=True)
def fresh_verdicts(monkeypatch):
    """Each test probes afresh: verdicts are kept per process and store, and a proxy's port may come back."""
    monkeypatch.setattr(storage_base, "_VERDICTS", {})
CREATE_ONLY = "create-only writes are not enforced: a second PUT with If-None-Match: * overwrote the object"
SWAP = "compare-and-swap is not enforced: a PUT with If-Match on a stale ETag overwrote the object"


def test_the_probe_passes_on_a_store_that_enforces_both_asks_once_and_leaves_nothing(s3_proxy, tmp_path):
    """Six requests on one probe object under the run's prefix, then none: the verdict is kept for the process."""
    root = f"s3://{BUCKET}/probe-{tmp_path.name}"
    store = S3Storage()
    store.check_guarantees(root, False, "ckpt.unchecked_store=true", pytest.fail)
    assert [r[0] for r in s3_proxy.requests] == ["PUT", "PUT", "HEAD", "PUT", "PUT", "DELETE"]
    assert len({r[1] for r in s3_proxy.requests}) == 1 and s3_proxy.requests[0][1].startswith(
        f"/{BUCKET}/probe-{tmp_path.name}/.probe-")
    assert store.list_objects(root) == []
    s3_proxy.requests.clear()
    S3Storage().check_guarantees(f"{root}/other", False, "ckpt.unchecked_store=true", pytest.fail)
    assert s3_proxy.requests == []  # the same store (endpoint and bucket): asked once
    LocalStorage().check_guarantees(str(tmp_path), False, "ckpt.unchecked_store=true", pytest.fail)
    assert list(tmp_path.iterdir()) == []  # a folder's guarantees are the OS's: nothing written


@pytest.mark.parametrize("strip, named, not_named", [
    ({"if-none-match"}, [CREATE_ONLY, "a commit marker can be written twice"], [SWAP]),
    ({"if-match"}, [SWAP, "two jobs on one prefix may both run"], [CREATE_ONLY, "marker"]),
    (CONDITIONS, [CREATE_ONLY, SWAP], []),
], ids=["no-create-only", "no-compare-and-swap", "neither"])
def test_a_store_ignoring_a_condition_is_named_with_what_it_fails(strip, named, not_named, s3_proxy, tmp_path):
    s3_proxy.strip = strip
    root = f"s3://{BUCKET}/probe-{tmp_path.name}"
    with pytest.raises(GuaranteeError) as e:
        S3Storage().check_guarantees(root, False, "ckpt.unchecked_store=true", pytest.fail)
    message = str(e.value)
    assert message.startswith(f"the object store at {s3_proxy.endpoint} (s3://{BUCKET}) does not keep the checkpoint "
                              "guarantees: ") and "set ckpt.unchecked_store=true to run at your own risk" in message
    assert all(n in message for n in named) and not any(n in message for n in not_named), message
    warned = []
    S3Storage().check_guarantees(root, True, "ckpt.unchecked_store=true", warned.append)
    assert len(warned) == 1 and warned[0].startswith("warning: ") and all(n in warned[0] for n in named)
    assert S3Storage().list_objects(root) == []  # the probe is deleted when it fails too


def _stripping(s3_env, s3_proxy) -> dict:
    s3_proxy.strip = set(CONDITIONS)
    return {**s3_env, "AWS_ENDPOINT_URL": s3_proxy.endpoint}


def test_training_on_a_store_that_ignores_the_conditions_stops_with_one_line_under_torchrun(s3_env, s3_proxy,
                                                                                            tmp_path):
    url = f"s3://{BUCKET}/{tmp_path.name}/ckpt"
    proc = run_train(tmp_path / "run", nproc=2, overrides=["train.max_steps=2", f"ckpt.dir={url}"],
                     env=_stripping(s3_env, s3_proxy), check=False, timeout=180)
    assert_one_error(proc, f"the object store at {s3_proxy.endpoint} (s3://{BUCKET}) does not keep the checkpoint "
                           f"guarantees: {CREATE_ONLY}; {SWAP}. ", TORCHRUN_EXIT)
    assert "set ckpt.unchecked_store=true to run at your own risk" in proc.stderr  # torchrun adds its own summary
    assert S3Storage().list_objects(url) == [] and not (tmp_path / "run").exists()  # nothing written, no lock taken


def test_with_the_risk_key_training_goes_on_and_says_what_is_no_longer_guaranteed(s3_env, s3_proxy, tmp_path):
    url, run = f"s3://{BUCKET}/{tmp_path.name}/ckpt", tmp_path / "run"
    proc = run_train(run, nproc=2, overrides=["train.max_steps=2", "ckpt.interval=2", f"ckpt.dir={url}",
                                              "ckpt.unchecked_store=true"], env=_stripping(s3_env, s3_proxy),
                     timeout=180)
    warned = [line for line in proc.stderr.splitlines() if "does not keep the checkpoint guarantees" in line]
    assert len(warned) == 1 and warned[0].startswith("warning: ") and "running anyway (ckpt.unchecked_store=true), " \
        "so a commit marker can be written twice and two jobs on one prefix may both run" in warned[0], warned
    assert max(losses(run)) == 2 and [s for s, _ in list_step_dirs(url)] == [2]
    assert verify_checkpoint(f"{url}/step-000002")["step"] == 2



def test_verify_and_reshard_on_a_store_that_ignores_the_conditions_say_so(s3_env, s3_proxy, tmp_path):
    """verify trusts a marker, reshard writes one: on such a store each stops with one line (exit 2), or with
    --unchecked-store goes on after one warning line."""
    from test_ckpt_unit import fake_checkpoint

    url = f"s3://{BUCKET}/{tmp_path.name}/ckpt/step-000005"
    S3Storage().put_folder(fake_checkpoint(tmp_path / "local", 5), url)  # through the proxy, before it strips
    env = _stripping(s3_env, s3_proxy)
    needle = f"error: the object store at {s3_proxy.endpoint} (s3://{BUCKET}) does not keep the checkpoint guarantees"
    for args in (["verify", url], ["reshard", url, f"{url}-w1", "--world-size", "1"]):
        proc = ckpt_cli(*args, env=env)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith(needle), proc.stderr
        assert "set --unchecked-store to run at your own risk" in lines[0] and "Traceback" not in proc.stderr
    assert S3Storage().list_objects(f"{url}-w1") == []
    risky = ckpt_cli("verify", url, "--unchecked-store", env=env)
    assert risky.returncode == 0 and risky.stdout.startswith(f"OK: {url}: step 5"), risky.stderr
    assert [line[:9] for line in risky.stderr.strip().splitlines()] == ["warning: "]
    assert ckpt_cli("verify", url, env=s3_env).returncode == 0  # the server itself enforces both: no line


def _read_only_verify_warns_and_reshard_stops(url: str, env: dict) -> str:
    """With credentials that may only read: verify says in one warning that it could not probe and verifies step 5;
    reshard, which writes, stops (exit 2). Returns both commands' stderr."""
    proc = ckpt_cli("verify", url, env=env)
    assert proc.returncode == 0 and proc.stdout.startswith(f"OK: {url}: step 5"), proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("warning: could not check the store's create-only writes"), lines
    resharded = ckpt_cli("reshard", url, f"{url}-w1", "--world-size", "1", env=env)
    assert resharded.returncode == 2 and resharded.stderr.startswith("error: "), resharded.stderr
    return proc.stderr + resharded.stderr


def test_verify_with_read_only_credentials_warns_that_it_could_not_probe_and_verifies(s3_env, s3_proxy, tmp_path):
    """An auditor's read-only credentials cannot write the probe: verify says so in one warning and checks the bytes;
    reshard, which writes, stops (exit 2)."""
    from test_ckpt_unit import fake_checkpoint

    url = f"s3://{BUCKET}/{tmp_path.name}/ckpt/step-000005"
    S3Storage().put_folder(fake_checkpoint(tmp_path / "local", 5), url)
    s3_proxy.refuse = lambda method, path: (403, "AccessDenied") if method in ("PUT", "POST", "DELETE") else None
    env = {**s3_env, "AWS_ENDPOINT_URL": s3_proxy.endpoint}
    _read_only_verify_warns_and_reshard_stops(url, env)


def test_on_azure_a_store_that_overwrites_is_named_by_its_endpoint_and_container(azure_env, tmp_path, monkeypatch):
    """Azurite enforces both conditions (the shared backend suite's probe test), so a store that ignores
    If-None-Match is stood in for by a create that overwrites; the line names the account's endpoint."""
    monkeypatch.setattr(AzureStorage, "create", AzureStorage.put)
    root = f"az://{CONTAINER}/probe-{tmp_path.name}"
    with pytest.raises(GuaranteeError) as e:
        AzureStorage().check_guarantees(root, False, "ckpt.unchecked_store=true", pytest.fail)
    endpoint = azure_env["AZURE_STORAGE_CONNECTION_STRING"].split("BlobEndpoint=")[1].rstrip(";/")
    assert str(e.value).startswith(f"the object store at {endpoint} (az://{CONTAINER}) does not keep the checkpoint "
                                   "guarantees: create-only writes are not enforced: a second Put Blob with "
                                   "If-None-Match: * overwrote the object"), e.value
    assert AzureStorage().list_objects(root) == []


def test_azure_verify_with_a_read_only_sas_warns_verifies_and_never_prints_the_token(azure_env, tmp_path):
    """A read-only SAS (the service answers the probe's write 403) is the same one warning as on S3, and the SAS,
    a secret, appears in no line: the endpoint is named without its query."""
    import datetime

    from azure.storage.blob import ContainerSasPermissions, generate_container_sas
    from azurite_server import ACCOUNT, KEY
    from test_ckpt_unit import fake_checkpoint

    url = f"az://{CONTAINER}/{tmp_path.name}/ckpt/step-000005"
    AzureStorage().put_folder(fake_checkpoint(tmp_path / "local", 5), url)
    sas = generate_container_sas(ACCOUNT, CONTAINER, account_key=KEY, permission=ContainerSasPermissions(
        read=True, list=True), expiry=datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(hours=1))
    endpoint = azure_env["AZURE_STORAGE_CONNECTION_STRING"].split("BlobEndpoint=")[1].rstrip(";")
    env = {"AZURE_STORAGE_CONNECTION_STRING": f"BlobEndpoint={endpoint};SharedAccessSignature={sas}"}
    said = _read_only_verify_warns_and_reshard_stops(url, env)
    assert "sig=" not in said and sas.split("sig=")[1][:8] not in said

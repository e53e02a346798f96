"""Checkpoint bytes on S3: multipart uploads with parallel parts, retries, ranged reads, distributed deletion, and the
checkpoint commands on s3://, against a real S3-compatible server (moto) and a proxy that refuses or records requests.

    python -m pytest tests/test_s3_transfer.py -q -p no:cacheprovider
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from ckpt.storage import s3 as s3_backend
from ckpt.storage import s3_transfer
from ckpt.layout import list_step_dirs
from ckpt.commit_protocol import verify_checkpoint
from ckpt.storage.s3_transfer import PartUploadStream, part_size, read_ranges, s3_filesystem
from ckpt.storage.s3 import S3Storage
from conftest import ROOT, ckpt_cli, events, free_port, losses, run_train, start_python
from test_cli_errors import one_error
from test_launch import TORCHRUN_EXIT, assert_one_error
from s3_server import BUCKET, S3Proxy, s3_env, s3_proxy, s3_server  # noqa: F401 - fixtures



# ---------------------------------------------------------------- uploads and reads, in this process

def test_part_sizes_stay_within_s3_limits():
    """S3: parts of 5 MiB to 5 GiB, at most 10,000 of them. The schedule keeps the first 2,000 parts at the base size
    (bounded upload buffers) and still fits objects far larger than a rank's share of a 70B checkpoint."""
    sizes = [part_size(n) for n in range(1, 10_001)]
    assert sizes[0] == sizes[1999] == s3_transfer.PART_BYTES and sizes[2000] == 2 * s3_transfer.PART_BYTES
    assert min(sizes) >= 5 << 20 and max(sizes) <= 5 << 30 and sum(sizes) >= 1 << 40


def test_a_large_file_goes_up_in_parallel_parts_and_a_failed_one_leaves_nothing(s3_proxy):
    fs, url = s3_filesystem(), f"s3://{BUCKET}/parts/shard.distcp"
    data = os.urandom(23 << 20)
    s3_proxy.hold_parts_s = 0.3  # each part upload takes a while: parallel ones overlap for sure
    with PartUploadStream(fs, url, part_bytes=5 << 20, parallel=3) as out:
        for i in range(0, len(data), 3 << 20):
            out.write(data[i:i + (3 << 20)])
        assert out.tell() == len(data)
    assert fs.cat_file(url) == data
    assert fs.info(url)["ETag"].strip('"').endswith("-5")  # 4 parts of 5 MiB and one of 3: a multipart upload
    assert s3_proxy.max_parallel_parts == 3, s3_proxy.max_parallel_parts

    with pytest.raises(RuntimeError, match="the writer failed"):
        with PartUploadStream(fs, f"{url}.torn", part_bytes=5 << 20, parallel=3) as out:
            out.write(data[:12 << 20])
            raise RuntimeError("the writer failed")
    assert not fs.exists(f"{url}.torn")  # the stock fsspec file would have committed the bytes written so far
    assert not fs.call_s3("list_multipart_uploads", Bucket=BUCKET).get("Uploads")  # aborted: no parts to pay for


def test_ranged_reads_fetch_only_the_wanted_bytes(s3_proxy):
    fs, url = s3_filesystem(), f"s3://{BUCKET}/ranges/shard.distcp"
    data = os.urandom(20 << 20)
    fs.pipe_file(url, data)
    wanted = [(url, 100, 200), (url, 150, 300), (url, 5 << 20, 11 << 20), (url, 19 << 20, 20 << 20)]
    s3_proxy.requests.clear()
    got = list(read_ranges(fs, wanted, part=4 << 20, parallel=3))
    assert got == [data[a:b] for _, a, b in wanted]
    gets = [r[4] for r in s3_proxy.requests if r[0] == "GET"]
    spans = [tuple(int(x) for x in g.removeprefix("bytes=").split("-")) for g in gets]
    assert sorted(spans) == [(100, 299), (5 << 20, (9 << 20) - 1), (9 << 20, (11 << 20) - 1),
                             (19 << 20, (20 << 20) - 1)], spans  # merged, cut into 4 MiB pieces, no whole file


def test_deletes_go_in_batches(s3_proxy, monkeypatch):
    store = S3Storage()
    paths = [f"s3://{BUCKET}/batches/step-000002/{n}" for n in "abcde"]
    for p in paths:
        store.create(p, b"x")
    assert store.list_objects(f"s3://{BUCKET}/batches/step-000002") == paths
    monkeypatch.setattr(s3_backend, "DELETE_BATCH", 2)
    s3_proxy.requests.clear()
    store.delete_many(paths)
    assert [len(keys) for keys in s3_proxy.delete_requests()] == [2, 2, 1]
    assert store.list_objects(f"s3://{BUCKET}/batches") == []


# ---------------------------------------------------------------- training through the proxy (torchrun, 2 ranks)

def test_refused_uploads_are_retried_then_fail_the_save_with_one_line(s3_proxy, s3_env, tmp_path):
    """The server answers 503 SlowDown: twice to step 2's shard uploads (retried with backoff: the save commits), and
    to every upload of step 4's (attempts spent: that save fails with one line naming the object; step 2 stays)."""
    url, run = f"s3://{BUCKET}/{tmp_path.name}/ckpt", tmp_path / "run"
    refused_at_step2 = []

    def refuse(method, path):
        if method != "PUT" or not path.endswith(".distcp"):
            return None
        if "step-000002" in path and len(refused_at_step2) < 2:
            refused_at_step2.append(path)
            return 503, "SlowDown"
        return (503, "SlowDown") if "step-000004" in path else None
    s3_proxy.refuse = refuse
    env = {**s3_env, "AWS_ENDPOINT_URL": s3_proxy.endpoint, "AWS_RETRY_MODE": "standard", "AWS_MAX_ATTEMPTS": "3"}
    proc = run_train(run, nproc=2, overrides=["train.max_steps=4", "ckpt.interval=2", "ckpt.keep_last=0",
                                              "ckpt.async_mode=off", f"ckpt.dir={url}"], env=env, check=False)
    assert_one_error(proc, f"writing checkpoint {url}/step-000004 failed: rank ", TORCHRUN_EXIT)
    assert "An error occurred (SlowDown) when calling the PutObject operation (reached max retries: 2)" in \
        next(line for line in proc.stderr.splitlines() if line.startswith("error: "))
    assert len(refused_at_step2) == 2 and [e["step"] for e in events(run, "checkpoint")] == [2]
    assert verify_checkpoint(f"{url}/step-000002")["world_size"] == 2
    assert not S3Storage().exists(f"{url}/step-000004/commit.json") and max(losses(run)) == 4


def test_s3_retention_deletes_on_every_rank_and_a_crash_after_the_marker_leaves_an_unmarked_prefix(
        s3_proxy, s3_env, tmp_path):
    """Rank 0 deletes the doomed markers, then each rank deletes its share of the objects. SIGKILL in between: the old
    checkpoint is an unmarked prefix, never resumed from, and the next retention removes it."""
    url, run = f"s3://{BUCKET}/{tmp_path.name}/ckpt", tmp_path / "run"
    store = S3Storage()
    store.create(f"{url}/step-000001/__0_0.distcp", b"a crashed save's shard, never marked")
    overrides = ["ckpt.interval=2", "ckpt.keep_last=1", f"ckpt.dir={url}", "ckpt.async_mode=process"]
    killed = run_train(run, nproc=2, overrides=["train.max_steps=4", *overrides],
                       env={**s3_env, "CKPT_FAULT": "kill@sweep:4"}, check=False)
    assert killed.returncode != 0
    assert [s for s, _ in list_step_dirs(url)] == [2, 4] and not store.exists(f"{url}/step-000002/commit.json")
    left = store.list_objects(f"{url}/step-000002")  # every object but the marker: the kill came before the deletes

    s3_proxy.requests.clear()
    run_train(run, nproc=2, overrides=["train.max_steps=6", *overrides],
              env={**s3_env, "AWS_ENDPOINT_URL": s3_proxy.endpoint})
    assert [e["step"] for e in events(run, "resume")] == [4]
    assert store.listdir(url) == ["step-000006"]  # step 2's leftover and step 4 gone, and the lock object
    deleted = [p for e in events(run, "retention") for p in e["deleted"]]
    assert deleted[-2:] == [f"{url}/step-000002", f"{url}/step-000004"], deleted
    batches = s3_proxy.delete_requests()
    step4 = len(verify_checkpoint(f"{url}/step-000006")["files"])  # the same files as step 6 (the marker: a DELETE)
    # before: rank 0 alone, one request per checkpoint; now one request per rank, each an interleaved half of both
    assert len(batches) == 2 and sorted(map(len, batches)) == [(len(left) + step4) // 2, (len(left) + step4 + 1) // 2]
    assert all(any("step-000002" in k for k in b) and any("step-000004" in k for k in b) for b in batches), batches


@pytest.mark.parametrize("problem", ["no such bucket", "access denied"])
def test_s3_refusing_at_start_is_one_error_line_under_torchrun(problem, s3_proxy, s3_env, tmp_path):
    bucket = "no-such-bucket-i28" if problem == "no such bucket" else BUCKET
    env = {**s3_env, "AWS_ENDPOINT_URL": s3_proxy.endpoint}
    if problem == "access denied":
        s3_proxy.refuse = lambda method, path: (403, "AccessDenied")
    proc = run_train(tmp_path / "run", nproc=2, overrides=["train.max_steps=2", f"ckpt.dir=s3://{bucket}/run"],
                     env=env, check=False, timeout=180)
    assert_one_error(proc, f"ckpt.dir s3://{bucket}/run is not writable: ", TORCHRUN_EXIT)
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------- the checkpoint commands on s3://

@pytest.fixture(scope="module")
def trained_on_s3(s3_server, tmp_path_factory):
    """One 2-rank run with ckpt.dir on S3 and export.at_end (every rank exports its share): (ckpt.dir URL, run dir)."""
    run = tmp_path_factory.mktemp("cli") / "run"
    url = f"s3://{BUCKET}/cli-{run.parent.name}/ckpt"
    run_train(run, nproc=2, overrides=["train.max_steps=4", "ckpt.interval=2", "ckpt.keep_last=0", f"ckpt.dir={url}",
                                       "export.at_end=true"], env=s3_server)
    return url, run


def test_inspect_reshard_and_export_read_and_write_s3(trained_on_s3, s3_env, tmp_path):
    url, run = trained_on_s3
    listing = ckpt_cli("inspect", url, env=s3_env)
    assert listing.returncode == 0 and [line.split()[0] for line in listing.stdout.splitlines()[1:]] == ["2", "4"] \
        and listing.stdout.count("committed, verified") == 2, listing.stdout + listing.stderr
    shown = ckpt_cli("inspect", f"{url}/step-000004", env=s3_env)
    assert shown.returncode == 0 and shown.stdout.startswith(f"{url}/step-000004: step 4, saved by 2 ranks, committed, "
                                                             "verified") and "train state:" in shown.stdout, shown.stderr
    dry = ckpt_cli("inspect", f"{url}/step-000004", "--world-size", "1", env=s3_env)
    assert dry.returncode == 0 and "OK: resume with 1 rank" in dry.stdout, dry.stdout + dry.stderr

    resharded = f"s3://{BUCKET}/{tmp_path.name}/resharded"
    proc = ckpt_cli("reshard", f"{url}/step-000004", resharded, "--world-size", "1", env=s3_env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    marker = verify_checkpoint(f"{resharded}/step-000004")
    assert marker["world_size"] == 1 and "__0_0.distcp" in marker["files"] and "__1_0.distcp" not in marker["files"]
    meta = json.loads(S3Storage().read(f"{resharded}/step-000004/meta.json"))
    assert meta["resharded_from"] == f"{url}/step-000004"

    # the end-of-run export read the S3 checkpoint into run.dir/hf (local); the CLI writes the same folder to S3
    hf_url = f"s3://{BUCKET}/{tmp_path.name}/hf"
    proc = ckpt_cli("export", f"{url}/step-000004", hf_url, env=s3_env)
    assert proc.returncode == 0 and proc.stdout.startswith(f"OK: {url}/step-000004 -> {hf_url}: "), proc.stderr[-2000:]
    local = sorted(os.listdir(run / "hf"))
    assert S3Storage().listdir(hf_url) == local and "config.json" in local
    S3Storage().fs.get(f"{hf_url}/model.safetensors", str(tmp_path / "from-s3.safetensors"))
    a, b = load_file(str(run / "hf" / "model.safetensors")), load_file(str(tmp_path / "from-s3.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    again = ckpt_cli("export", f"{url}/step-000004", hf_url, env=s3_env)
    one_error(again, f"{hf_url} is not empty; choose a new prefix")


@pytest.mark.parametrize("problem", ["no such bucket", "unreachable", "access denied"])
def test_checkpoint_commands_on_s3_say_what_is_wrong_in_one_line(problem, s3_env):
    env, path, proxy = dict(s3_env), f"s3://{BUCKET}/run/step-000002", None
    if problem == "no such bucket":
        path = "s3://no-such-bucket-i28/run/step-000002"
    elif problem == "unreachable":
        env.update(AWS_ENDPOINT_URL=f"http://127.0.0.1:{free_port()}", AWS_MAX_ATTEMPTS="1")
    else:
        proxy = S3Proxy(s3_env["AWS_ENDPOINT_URL"])
        proxy.refuse = lambda method, p: (403, "AccessDenied")
        env["AWS_ENDPOINT_URL"] = proxy.endpoint
    commands = (["inspect", path], ["export", path, "out-hf"], ["reshard", path, f"{path}-2", "--world-size", "2"])
    try:  # the three at once
        running = [start_python(["-m", "ckpt", *args], env, ROOT, forked=True) for args in commands]
        for args, proc in zip(commands, running):
            _, err = proc.communicate(timeout=300)
            assert proc.returncode in (1, 2) and err.startswith("error: ") and err.strip().count("\n") == 0, (args, err)
            assert "Traceback" not in err and path in err, (args, err)
        assert not os.path.exists(os.path.join(ROOT, "s3:")) and not os.path.exists(os.path.join(ROOT, "out-hf"))
    finally:
        if proxy is not None:
            proxy.stop()


def test_s3_bench_tiny(tmp_path):
    """bench/s3_bench.py end to end at a tiny size: both methods, their spread and ratios, and its provenance."""
    from test_bench import check_provenance, run

    out = tmp_path / "out"
    args = ["--hidden", "64", "--layers", "1", "--vocab", "256", "--rounds", "2", "--out", str(out)]
    run("s3_bench", args, 300)
    r = check_provenance(out, "s3_bench", args)
    assert r["rounds_measured"] == 1 and r["world_size"] == 2 and r["server"].startswith("moto ") and r["store"] == "s3"
    for method in ("local", "s3"):
        p = r["methods"][method]
        assert p["bytes"] > 0 and all(0 < p[k]["min"] <= p[k]["median"] <= p[k]["max"] for k in ("committed_s", "resume_s"))
    assert set(r["s3_over_local"]) == {"committed_s", "resume_s"} and "| s3 |" in (out / "s3_bench.md").read_text()

"""TensorBoard and W&B (offline) loggers: what a run writes, read back with each tool's own format reader.

    python -m pytest tests/test_loggers.py -q
"""

from __future__ import annotations

import glob
import importlib.util
import math
import os
import re
import struct

import pytest

from conftest import ROOT, events, losses, run_train

import train_fsdp
from finetune import loggers
from finetune.loggers import PER_RANK, SCALARS, ScalarStream
from finetune.metrics import read_metrics


@pytest.fixture(scope="module")
def logged_run(tmp_path_factory):
    """One W=2 run with both loggers on: 6 steps, eval and async checkpoints at 3 and 6."""
    pytest.importorskip("tensorboard")
    pytest.importorskip("wandb")
    run = tmp_path_factory.mktemp("loggers") / "run"
    run_train(run, nproc=2, overrides=["train.max_steps=6", "ckpt.interval=3", "train.eval_interval=3",
                                       "run.tensorboard=true", "run.wandb=offline"])
    return run


def test_tensorboard_event_files_hold_the_run(logged_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(logged_run / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/loss", "train/lr", "train/grad_norm", "train/tokens_per_s", "eval/loss", "checkpoint/blocking_s",
            "checkpoint/committed_s"} <= tags, tags
    evals = {ev["step"]: ev["eval_loss"] for ev in events(logged_run, "eval")}
    assert sorted(evals) == [3, 6]
    assert {e.step: round(e.value, 5) for e in acc.Scalars("eval/loss")} == {s: round(v, 5) for s, v in evals.items()}
    loss = {e.step: e.value for e in acc.Scalars("train/loss")}
    want = losses(logged_run)
    assert sorted(loss) == sorted(want) == [1, 2, 3, 4, 5, 6]
    assert all(math.isclose(loss[s], want[s], rel_tol=1e-6) for s in want)  # stored as float32
    assert [e.step for e in acc.Scalars("train/tokens_per_s")] == [2, 3, 4, 5, 6]
    assert all(e.value > 0 for e in acc.Scalars("train/tokens_per_s"))
    blocking = {e.step: e.value for e in acc.Scalars("checkpoint/blocking_s")}
    assert sorted(blocking) == [3, 6]
    for ev in events(logged_run, "checkpoint"):
        assert math.isclose(blocking[ev["step"]], ev["blocking_s"], rel_tol=1e-6)
    peaks = peak_records(logged_run)  # each rank's peak memory, gathered at every log interval (1 here)
    for r in (0, 1):
        logged = {e.step: e.value for e in acc.Scalars(f"memory/peak_gib/rank_{r}")}
        assert sorted(logged) == sorted(peaks)  # stored as float32: close, not equal after rounding (0.4325 ...)
        assert all(math.isclose(logged[s], p[r], rel_tol=1e-6) for s, p in peaks.items()), (logged, peaks)


def peak_records(run) -> dict[int, list[float]]:
    """{step: [rank 0's peak, rank 1's]} of the W=2 run: every step is a log interval, every peak a process's."""
    steps = read_metrics(os.path.join(str(run), "metrics.jsonl"))[0]
    peaks = {s: r["peak_memory_gib"] for s, r in steps.items()}
    assert sorted(peaks) == [1, 2, 3, 4, 5, 6] and all(len(p) == 2 and min(p) > 0.1 for p in peaks.values())
    return peaks


def read_wandb_history(path: str) -> list[dict]:
    """History rows of an offline .wandb file: a ':W&B' header, then LevelDB-log records (32 KiB blocks, 7-byte
    record headers: crc, length, type full/first/middle/last) holding protobuf `Record`s."""
    from wandb.proto import wandb_internal_pb2 as pb
    import json
    data, pos, buf, rows = open(path, "rb").read(), 7, b"", []
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # block trailer too small for a header: padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:
            break
        buf += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(buf)
            buf = b""
            if record.WhichOneof("record_type") == "history":
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                             for item in record.history.item})
    return rows


def test_wandb_offline_run_holds_the_run_under_run_dir(logged_run):
    files = glob.glob(str(logged_run / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert len(files) == 1, os.listdir(logged_run / "wandb")
    rows = read_wandb_history(files[0])
    loss = {r["train/step"]: r["train/loss"] for r in rows if "train/loss" in r}
    assert loss == losses(logged_run)
    assert {r["train/step"] for r in rows if "checkpoint/blocking_s" in r} == {3, 6}
    assert {r["train/step"]: r["memory/peak_gib/rank_1"] for r in rows if "memory/peak_gib/rank_1" in r} == \
        {s: p[1] for s, p in peak_records(logged_run).items()}
    run_id = open(logged_run / "wandb" / "run-id").read().strip()
    assert files[0].endswith(f"run-{run_id}.wandb")  # a resumed job continues the same W&B run


def test_scalars_cover_eval_and_checkpoint_events():
    stream = ScalarStream()
    assert stream.scalars({"step": 1, "loss": 2.0, "lr": 1e-3, "grad_norm": 0.5, "tokens": 100, "time": 10.0}) == [
        ("train/loss", 2.0, 1), ("train/lr", 1e-3, 1), ("train/grad_norm", 0.5, 1)]
    assert ("train/tokens_per_s", 50.0, 2) in stream.scalars({"step": 2, "loss": 1.0, "tokens": 200, "time": 12.0})
    assert stream.scalars({"event": "eval", "step": 2, "eval_loss": 0.7, "eval_accuracy": 0.25, "time": 13.0}) == [
        ("eval/loss", 0.7, 2), ("eval/accuracy", 0.25, 2)]
    assert stream.scalars({"event": "checkpoint", "step": 2, "blocking_s": 0.1, "committed_s": 0.4, "time": 14.0}) == [
        ("checkpoint/blocking_s", 0.1, 2), ("checkpoint/committed_s", 0.4, 2)]
    assert stream.scalars({"event": "resume_skip", "path": "x"}) == []


def test_the_scalar_lists_in_the_docs_are_the_codes():
    """loggers.py's docstring and docs/loggers.md name every scalar the code sends, and no other."""
    named = set(SCALARS.values()) | {"train/tokens_per_s"} | {f"{n}/rank_<r>" for n in PER_RANK.values()}
    docs = open(os.path.join(ROOT, "docs", "loggers.md")).read()
    for text in (loggers.__doc__, docs[docs.index("Scalars, against"):docs.index("They come")]):
        listed = set(re.findall(r"\b(?:train|eval|checkpoint|memory)/[a-z_]+(?:/rank_<r>)?", text))
        assert listed == named, f"listed but not sent: {listed - named}; sent but not listed: {named - listed}"


@pytest.mark.parametrize("key,package", [("run.tensorboard=true", "tensorboard"), ("run.wandb=offline", "wandb")])
def test_missing_logger_package_is_one_clear_error(key, package, monkeypatch, capsys, tmp_path):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == package else real(name, *a))
    rc = train_fsdp.main(["--config", os.path.join(ROOT, "configs", "tiny.yaml"), key, f"run.dir={tmp_path}"])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith(f"error: config key '{key.split('=')[0]}' needs the {package} package")
    assert len(err.strip().splitlines()) == 1 and not os.listdir(tmp_path)

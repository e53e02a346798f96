"""Parallel verification on resume agrees with the offline check on every kind of damage, at W=2 and W=1.

    python -m pytest tests/test_ckpt_verify.py -q

One real 2-rank training run makes the checkpoints; each case damages a copy, then `python -m ckpt
verify` (offline, threads; its main() called here, a process start saved per case) and CheckpointManager.choose_checkpoint in 1 and 2 gloo processes (each rank
checks its share of the files) must reach the same verdict, name the same problem, and walk back.
"""

import json
import os
import shutil
import sys

import pytest

from ckpt.__main__ import main as ckpt_cli
from conftest import ROOT, start_on_free_port, run_train

sys.path.insert(0, ROOT)


def flip(path, at=200):
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x10]))


def drop_from_manifest(ckpt, name):
    with open(os.path.join(ckpt, "commit.json")) as f:
        marker = json.load(f)
    del marker["files"][name]
    with open(os.path.join(ckpt, "commit.json"), "w") as f:
        json.dump(marker, f)


CASES = {  # name -> (damage applied to step-000004, text the verdict must contain)
    "flip_rank0": (lambda c: flip(os.path.join(c, "__0_0.distcp")), "__0_0.distcp: checksum mismatch"),
    "flip_rank1": (lambda c: flip(os.path.join(c, "__1_0.distcp")), "__1_0.distcp: checksum mismatch"),
    "truncate_rank0": (lambda c: os.truncate(os.path.join(c, "__0_0.distcp"), 1000), "__0_0.distcp: size 1000"),
    "truncate_rank1": (lambda c: os.truncate(os.path.join(c, "__1_0.distcp"), 1000), "__1_0.distcp: size 1000"),
    "missing_rank1": (lambda c: os.remove(os.path.join(c, "__1_0.distcp")), "__1_0.distcp: missing"),
    "unlisted_rank0": (lambda c: drop_from_manifest(c, "__0_0.distcp"),
                       "__0_0.distcp: referenced by .metadata but not in the manifest"),
    "flip_metadata": (lambda c: flip(os.path.join(c, ".metadata"), 30), ".metadata"),
    "flip_meta_json": (lambda c: flip(os.path.join(c, "meta.json"), 3), "meta.json"),
    "intact": (lambda c: None, None),
}


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    root = tmp_path_factory.mktemp("verify")
    run_train(root / "run", nproc=2, overrides=["train.max_steps=4", "ckpt.interval=2", "ckpt.keep_last=0",
                                                "ckpt.async_mode=thread"])
    out = {}
    for name, (damage, _) in CASES.items():
        ckpt_dir = root / name
        shutil.copytree(root / "run" / "checkpoints", ckpt_dir)
        damage(str(ckpt_dir / "step-000004"))
        out[name] = str(ckpt_dir)
    return out


def _resume_worker(rank, world_size, port, dirs, out):
    import torch.distributed as dist
    from ckpt import CheckpointManager
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        found = {}
        for name, d in dirs.items():
            logs = []
            chosen = CheckpointManager(d, "off", on_log=logs.append).choose_checkpoint("auto")
            found[name] = {"chosen": os.path.basename(chosen), "logs": logs}
        with open(f"{out}.{rank}", "w") as f:
            json.dump(found, f)
    finally:
        dist.destroy_process_group()


def resume_choices(dirs, world_size, tmp_path) -> list[dict]:
    out = str(tmp_path / f"w{world_size}")
    start_on_free_port(_resume_worker, lambda port: (world_size, port, dirs, out), nprocs=world_size)
    return [json.load(open(f"{out}.{r}")) for r in range(world_size)]


def test_parallel_and_offline_verification_agree(cases, tmp_path, capsys):
    offline = {}
    for name, d in cases.items():
        code = ckpt_cli(["verify", os.path.join(d, "step-000004"), "--jobs", "2"])
        printed = capsys.readouterr()
        offline[name] = (code, (printed.out + printed.err).strip())
    per_world = {w: resume_choices(cases, w, tmp_path) for w in (1, 2)}
    for name, (_, needle) in CASES.items():
        code, text = offline[name]
        if needle is None:
            assert code == 0 and text.startswith("OK") and "xxh3_128" in text, text
        else:
            assert code == 1 and needle in text, (name, text)
        for w, ranks in per_world.items():
            for rank, found in enumerate(ranks):
                got = found[name]
                skips = [line for line in got["logs"] if "skipping" in line]  # besides each verification's start/end
                if needle is None:
                    assert got["chosen"] == "step-000004" and not skips, (name, w, got)
                    continue
                assert got["chosen"] == "step-000002", (name, w, rank, got)  # walked back past the bad one
                if rank == 0:  # the skip line names the same problem the offline check found
                    assert len(skips) == 1 and needle in skips[0], (name, w, got)
                    assert skips[0].split(": ", 2)[-1] == text.split("INVALID: ", 1)[-1], (name, w)

"""Bad input: every mistake a user can make stops the job with one line naming the problem, and exit != 0.

    python -m pytest tests/test_bad_input.py -q

Plain `python train_fsdp.py` (W=1) must exit 2 with `error: ...` as the last line of stderr and no
traceback. Under torchrun (W=2) the same line must come from the ranks, above torchrun's own failure
report, and the job must end: a rank that stops alone must not leave another waiting in a collective.
"""

import fcntl
import json
import os
import re
import shutil
import time

import pytest

from conftest import ROOT, run_train

TIMEOUT = 120  # generous: the slowest case builds the model; a hang is the failure being looked for


def launched(run_dir, **kwargs):
    """run_train exec'd as a user launches it (python or torchrun, not forked): what they print is under test."""
    return run_train(run_dir, forked=False, **kwargs)


def assert_clear_error(proc, needle: str, torchrun: bool) -> None:
    err = proc.stderr
    lines = [line for line in err.splitlines() if line.strip()]
    ours = [line for line in lines if line.startswith("error: ")]
    assert proc.returncode != 0, f"exit 0 on bad input:\n{proc.stdout[-2000:]}"
    assert ours and all(needle in line for line in ours), f"no 'error: ...{needle}...' line:\n{err[-3000:]}"
    assert 'train_fsdp.py", line' not in err, f"a rank printed a traceback:\n{err[-3000:]}"
    if not torchrun:
        assert proc.returncode == 2
        assert lines[-1] == ours[0], f"the error is not the last line:\n{err[-2000:]}"


def write_rows(path, n: int) -> None:
    rows = [{"messages": [{"role": "user", "content": f"reverse: w{i}"}, {"role": "assistant", "content": f"{i}w"}]}
            for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.mark.parametrize("overrides,needle", [
    (["train.max_stepz=3"], "unknown config key 'train.max_stepz'"),
    (["data.seq_len=4096"], "data.seq_len=4096 is larger than the model allows (max_position_embeddings=128)"),
    (["data.seq_len=8"], "at data.seq_len=8 has a token that carries loss ("),
], ids=["unknown-key", "seq-len-too-long", "no-loss-token"])
def test_bad_config(tmp_path, overrides, needle):
    proc = launched(tmp_path / "run", nproc=0, overrides=overrides, check=False, timeout=TIMEOUT)
    assert_clear_error(proc, needle, torchrun=False)
    if needle.startswith(("unknown config key", "config key")):  # found before any process group: nothing written
        assert not os.path.exists(tmp_path / "run" / "metrics.jsonl")


@pytest.mark.parametrize("make,needle", [
    (lambda p: None, "data file not found: {p}"),
    (lambda p: write_rows(p, 5), "has 5 samples x 1 epoch(s), fewer than one global batch (data.global_batch_size=12)"),
], ids=["missing", "smaller-than-one-batch"])
def test_bad_data_file(tmp_path, make, needle):
    data = tmp_path / "train.jsonl"
    make(data)
    proc = launched(tmp_path / "run", nproc=0, check=False, timeout=TIMEOUT,
                     overrides=[f"data.path={data}", "data.epochs=1"])
    assert_clear_error(proc, needle.format(p=data), torchrun=False)


def test_unwritable_ckpt_dir(tmp_path):
    blocker = tmp_path / "a-file"  # as root, chmod does not stop writes; a path under a file always fails
    blocker.write_text("")
    proc = launched(tmp_path / "run", nproc=0, check=False, timeout=TIMEOUT, overrides=[f"ckpt.dir={blocker}/ckpt"])
    assert_clear_error(proc, f"ckpt.dir {blocker}/ckpt is not writable: Not a directory", torchrun=False)


# ---------------------------------------------------------------- W=2 under torchrun: every rank must stop

def test_missing_data_file_two_ranks(tmp_path):
    """Tokenizing runs on rank 0 only: its error must reach rank 1, which waits for the result."""
    proc = launched(tmp_path / "run", nproc=2, check=False, timeout=TIMEOUT,
                     overrides=[f"data.path={tmp_path}/nope.jsonl"])
    assert_clear_error(proc, f"data file not found: {tmp_path}/nope.jsonl", torchrun=True)


def test_global_batch_not_divisible_by_world_size(tmp_path):
    proc = launched(tmp_path / "run", nproc=2, check=False, timeout=TIMEOUT, overrides=["data.global_batch_size=13"])
    assert_clear_error(proc, "data.global_batch_size=13 is not divisible by world size 2; world sizes that work: "
                             "[1, 13]", torchrun=True)


def test_unwritable_ckpt_dir_two_ranks(tmp_path):
    """Only rank 0 touches ckpt.dir (the lock): rank 1 must stop with it, not wait for it."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    proc = launched(tmp_path / "run", nproc=2, check=False, timeout=TIMEOUT, overrides=[f"ckpt.dir={blocker}/x"])
    assert_clear_error(proc, f"ckpt.dir {blocker}/x is not writable", torchrun=True)


def test_second_job_on_same_ckpt_dir_two_ranks(tmp_path):
    """A live job holds <ckpt.dir>/.lock (played here by this test process): a W=2 job must refuse it at once."""
    ckpt_dir = tmp_path / "ckpt"
    ckpt_dir.mkdir()
    with open(ckpt_dir / ".lock", "a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        held.write(json.dumps({"host": "node-7", "pid": 4242, "started": "2026-01-01T00:00:00",
                               "heartbeat": time.time()}) + "\n")  # ckpt/lock.py's record
        held.flush()
        proc = launched(tmp_path / "run", nproc=2, check=False, timeout=TIMEOUT, overrides=[f"ckpt.dir={ckpt_dir}"])
    assert_clear_error(proc, f"ckpt.dir {ckpt_dir} is in use by another job (pid 4242 on node-7", torchrun=True)


def test_resume_other_model_shape_two_ranks(tmp_path, two_step_run):
    """A W=1 checkpoint of the tiny model, resumed at W=2 by a wider model: every rank stops, naming the tensor."""
    run = two_step_run
    wide = tmp_path / "wide"
    shutil.copytree(os.path.join(ROOT, "assets", "tiny-llama"), wide)
    cfg = json.loads((wide / "config.json").read_text())
    cfg["intermediate_size"] = 256
    (wide / "config.json").write_text(json.dumps(cfg))
    proc = launched(run, nproc=2, check=False, timeout=TIMEOUT,
                     overrides=[f"model.config_path={wide}", "ckpt.resume_config_check=warn"])  # past the config check
    assert_clear_error(proc, "does not match the model: 'model.layers.0.mlp.", torchrun=True)
    assert re.search(r"is \[\d+, \d+\] in the checkpoint but \[\d+, \d+\] in the model", proc.stderr)


def test_refused_job_writes_nothing_in_run_dir(tmp_path):
    """A second job refused by the lock must leave the running job's run.dir alone (config.yaml, metrics.jsonl)."""
    run = tmp_path / "run"
    ckpt_dir = run / "checkpoints"
    ckpt_dir.mkdir(parents=True)
    (run / "config.yaml").write_text("the running job's config\n")
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    with open(ckpt_dir / ".lock", "a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        proc = launched(run, nproc=0, check=False, timeout=TIMEOUT, overrides=["train.max_steps=21"])
    assert_clear_error(proc, f"ckpt.dir {ckpt_dir} is in use by another job", torchrun=False)
    assert (run / "config.yaml").read_text() == "the running job's config\n"
    assert (run / "metrics.jsonl").read_text() == '{"step": 1, "loss": 1.0}\n'
    assert sorted(os.listdir(run)) == ["checkpoints", "config.yaml", "metrics.jsonl"]


def test_resume_deeper_checkpoint_into_shallower_model(tmp_path):
    """A 3-layer model's checkpoint resumed after its config.json was edited to 2 layers: refused, naming a
    saved tensor the model lacks (the resume-config check cannot see this: the config path is the same)."""
    model = tmp_path / "model"
    shutil.copytree(os.path.join(ROOT, "assets", "tiny-llama"), model)
    cfg = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 3}))
    run = tmp_path / "run"
    run_train(run, nproc=0, overrides=["train.max_steps=1", "ckpt.interval=0", f"model.config_path={model}"],
              timeout=TIMEOUT)
    (model / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 2}))
    proc = launched(run, nproc=0, check=False, timeout=TIMEOUT,
                     overrides=["train.max_steps=2", "ckpt.interval=0", f"model.config_path={model}"])
    assert_clear_error(proc, "does not match the model: the model has no 'model.layers.2.", torchrun=False)


def test_some_samples_without_loss_tokens_warn(tmp_path):
    """One warning with the count; at W=2 each rank counts half the samples and the all-reduced count is the same.
    Forked (run_train): a run that trains, no error line whose neighbours are under test."""
    counts = []
    for nproc in (0, 2):
        run = tmp_path / f"run{nproc}"
        proc = run_train(run, nproc=nproc, timeout=TIMEOUT,
                         overrides=["data.seq_len=20", "train.max_steps=1", "ckpt.interval=0", "ckpt.save_at_end=false",
                                    f"data.cache_dir={run}-cache"])  # its own cache: counted, not read back
        m = re.search(r"warning: (\d+) of (\d+) samples \([\d.]+%\) of \S+ at data.seq_len=20 have no token that "
                      r"carries loss", proc.stdout)
        assert m and 0 < int(m.group(1)) < int(m.group(2)), proc.stdout[-2000:]
        counts.append(m.groups())
    assert counts[0] == counts[1], counts

"""Bad input under every supported launcher: one `error:` line, whoever launched, however many ranks.

    python -m pytest tests/test_launch.py -q

These run the README's own commands for real (torchrun, python -m torch.distributed.run, accelerate launch).
Bad input fails before any model is built, so each run takes seconds.
"""

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from conftest import FAST, ROOT

TIMEOUT = 120
TORCHRUN_EXIT = 1  # torchrun's own status when a worker fails; the workers' 2 is in its summary (README)


def launch(cmd: list[str], tmp_path, *args: str, **env: str) -> subprocess.CompletedProcess:
    return launch_script(cmd, "train_fsdp.py", "--config", "configs/tiny.yaml", *FAST, f"run.dir={tmp_path}/run", *args,
                         **env)


def launch_script(cmd: list[str], script: str, *args: str, **extra_env: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(extra_env)
    return subprocess.run([*cmd, script, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT)


def assert_one_error(proc, needle: str, exit_code: int) -> None:
    err = proc.stderr
    ours = [line for line in err.splitlines() if "error:" in line]
    assert ours == [f"error: {needle}"] or (len(ours) == 1 and ours[0].startswith("error: ") and needle in ours[0]), \
        f"want exactly one 'error: ...{needle}' line, got {ours}:\n{err[-4000:]}"
    assert 'train_fsdp.py", line' not in err and "finetune/" not in err, f"a traceback from our code:\n{err[-4000:]}"
    assert proc.returncode == exit_code, (proc.returncode, err[-3000:])


README_TORCHRUN = ["torchrun", "--nproc_per_node", "2"]
PYTHON_M = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]


@pytest.mark.parametrize("attempt", range(3))
def test_readme_torchrun_command_reports_a_bad_key_once(tmp_path, attempt):
    """The race: torchrun stops the other workers as soon as one exits. Several runs in a row, one line each."""
    proc = launch(README_TORCHRUN, tmp_path, "train.lrr=1e-3")
    assert_one_error(proc, "unknown config key 'train.lrr'", TORCHRUN_EXIT)
    assert "exitcode  : 2" in proc.stderr  # torchrun's summary: what the workers exited with
    assert "traceback : exit 2: bad input (its one-line message is above): unknown config key" in proc.stderr


SLOW_RANK_SCRIPT = """
import sys, time
sys.path.insert(0, {root!r})
from finetune.launch import launch_rank, report_bad_input
if launch_rank() == 1:
    time.sleep(3)  # this rank is still checking (a compiler probe, a slow disk) when rank 0 has its verdict
report_bad_input("the same bad input on every rank", 2)
sys.exit(2)
"""


def test_rank_0_waits_for_a_slower_rank_to_reach_the_verdict(tmp_path):
    """Without the wait, torchrun stops rank 1 (SIGTERM, exit -15) as soon as rank 0 exits; with it, both exit 2."""
    script = tmp_path / "slow_rank.py"
    script.write_text(SLOW_RANK_SCRIPT.format(root=str(ROOT)))
    proc = launch_script(README_TORCHRUN, str(script))
    assert_one_error(proc, "the same bad input on every rank", TORCHRUN_EXIT)
    assert len(re.findall(r"^\s*exitcode\s+:\s*2\b", proc.stderr, re.M)) == 2, proc.stderr[-3000:]


@pytest.mark.parametrize("bad,needle", [
    ("train.lr=abc", "config key 'train.lr' must be float, got 'abc' (str)"),
    ("data.path={tmp}/nope.jsonl", "data file not found: {tmp}/nope.jsonl"),
    ("model.config_path={tmp}", "model.config_path={tmp}: the folder has no config.json"),
], ids=["wrong-type", "missing-data-file", "empty-model-folder"])
@pytest.mark.parametrize("launcher", [README_TORCHRUN, PYTHON_M], ids=["torchrun", "python-m"])
def test_bad_input_once_under_torchrun(tmp_path, launcher, bad, needle):
    proc = launch(launcher, tmp_path, bad.format(tmp=tmp_path))
    assert_one_error(proc, needle.format(tmp=tmp_path), TORCHRUN_EXIT)


def test_a_torch_older_than_supported_is_one_line_under_torchrun(tmp_path):
    """torch 2.10 (its version faked in every process by a sitecustomize) is refused before any process group,
    once, naming the oldest supported release, instead of failing later inside DCP."""
    (tmp_path / "sitecustomize.py").write_text("import torch\ntorch.__version__ = '2.10.0+cu128'\n")
    fake_older_torch = os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])
    proc = launch(README_TORCHRUN, tmp_path, PYTHONPATH=fake_older_torch)
    assert_one_error(proc, "torch 2.10.0+cu128 is older than this project supports (2.11.0 to 2.13.0 were checked; "
                           "docs/dependencies.md): install torch>=2.11.0", TORCHRUN_EXIT)
    assert not os.path.exists(tmp_path / "run" / "metrics.jsonl")


# ---------------------------------------------------------------- accelerate

def test_accelerate_cpu_several_processes_is_refused(tmp_path):
    """`--cpu --num_processes 2` starts one process without RANK/WORLD_SIZE: it would train at world size 1."""
    pytest.importorskip("accelerate")
    proc = launch(["accelerate", "launch", "--quiet", "--cpu", "--num_processes", "2"], tmp_path)
    assert_one_error(proc, "accelerate launch asked for several processes", 1)  # accelerate --quiet: exit 1
    assert "torchrun --nproc_per_node N train_fsdp.py" in proc.stderr
    assert not os.path.exists(tmp_path / "run" / "metrics.jsonl")


def test_accelerate_multi_gpu_trains_at_world_size_two(tmp_path):
    """The README's accelerate example (torch's elastic launcher underneath) works on CPU too."""
    pytest.importorskip("accelerate")
    proc = launch(["accelerate", "launch", "--multi_gpu", "--num_processes", "2"], tmp_path, "train.max_steps=2",
                  "ckpt.async_mode=off")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "world 2 | device cpu" in proc.stdout
    with open(tmp_path / "run" / "metrics.jsonl") as f:
        assert max(json.loads(line).get("step", 0) for line in f) == 2


# ---------------------------------------------------------------- model folders

def make_folder(tmp_path, keep: tuple[str, ...]) -> str:
    folder = tmp_path / "model"
    folder.mkdir()
    for name in keep:
        shutil.copy(os.path.join(ROOT, "assets", "tiny-llama", name), folder / name)
    return str(folder)


@pytest.mark.parametrize("key,keep,needle", [
    ("model.config_path", (), "model.config_path={m}: the folder has no config.json (not a HF model folder)"),
    ("model.config_path", ("config.json",), "model.config_path={m}: the folder has no tokenizer file (one of "
                                            "tokenizer.json, tokenizer.model"),
    ("model.name_or_path", ("tokenizer.json", "tokenizer_config.json"),
     "model.name_or_path={m}: the folder has no config.json"),
    ("model.config_path", "missing", "model.config_path={m}: no such model folder"),
], ids=["empty", "no-tokenizer", "pretrained-no-config", "missing"])
def test_incomplete_model_folder_is_one_line(tmp_path, key, keep, needle):
    folder = str(tmp_path / "model") if keep == "missing" else make_folder(tmp_path, keep)
    proc = launch([sys.executable], tmp_path, f"{key}={folder}")
    assert_one_error(proc, needle.format(m=folder), 2)
    assert proc.stderr.strip().splitlines() == [line for line in proc.stderr.strip().splitlines() if "error:" in line]

"""The command lines' own words: errors that point at the mistake, exit 2 for bad input, help for every
argument, every config key listed, counts in good English.

    python -m pytest tests/test_cli_errors.py -q
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest

from conftest import ROOT, run_python


def cli(*args: str, cwd=ROOT) -> subprocess.CompletedProcess:
    """`python *args` exec'd (not forked): everything the command prints, its imports' included, is under test."""
    return run_python(list(args), cwd=cwd, timeout=120, forked=False)


def one_error(proc, needle: str, code: int = 2) -> None:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == code and len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], \
        (proc.returncode, proc.stderr[-2000:])


# ---------------------------------------------------------------- checkpoints CLI

def test_verify_of_a_folder_that_is_no_checkpoint_says_so(tmp_path):
    one_error(cli("-m", "ckpt", "verify", str(tmp_path)), f"{tmp_path} is not a checkpoint folder")
    for step in (2, 10):
        (tmp_path / f"step-{step:06d}").mkdir()
    one_error(cli("-m", "ckpt", "verify", str(tmp_path)),
              f"{tmp_path} is a checkpoints folder (2 step-* folders), not a checkpoint: verify one of them, e.g. the "
              f"newest: python -m ckpt verify {tmp_path}/step-000010")


def test_reshard_of_a_source_that_is_no_checkpoint_exits_2(tmp_path):
    """Bad input, as for verify and export; a damaged checkpoint is what exits 1 (test_world_size)."""
    one_error(cli("-m", "ckpt", "reshard", str(tmp_path / "nope"), str(tmp_path / "out"), "--world-size", "1"),
              f"{tmp_path / 'nope'}: no such folder")
    assert not (tmp_path / "out").exists()


def test_export_and_plot_exit_2_on_bad_input(tmp_path):
    one_error(cli("-m", "ckpt", "export", str(tmp_path / "nope"), str(tmp_path / "out")), "")
    (tmp_path / "metrics.jsonl").write_text("not json\n")
    one_error(cli("-m", "finetune.metrics", str(tmp_path / "metrics.jsonl")), "cannot plot")


def test_ckpt_cli_refuses_a_transformers_older_than_supported(tmp_path):
    """transformers 5.16 (its installed version faked by a sitecustomize): refused before the path is looked at."""
    (tmp_path / "sitecustomize.py").write_text(
        "import importlib.metadata as m\n_version = m.version\n"
        "m.version = lambda name: '5.16.0' if name == 'transformers' else _version(name)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), ROOT])}
    proc = subprocess.run([sys.executable, "-m", "ckpt", "verify", str(tmp_path / "nope")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    one_error(proc, "transformers 5.16.0 is older than this project supports (5.17.0 to 5.23.0 were checked; "
                    "docs/dependencies.md): install transformers>=5.17.0")


def test_every_positional_and_option_has_help():
    from ckpt.__main__ import build_parser
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    missing = [f"{name} {a.dest}" for name, p in sub.choices.items() for a in p._actions if not a.help]
    assert missing == []


# ---------------------------------------------------------------- train_fsdp.py's command line

@pytest.mark.parametrize("args,needle", [
    (["--plan", "--gpu-memory", "-5"], "argument --gpu-memory: must be a float > 0, got '-5'"),
    (["--gpu-memory", "80"], "--gpu-memory only changes the plan: add --plan (or drop it)"),
    (["--nodes", "2", "--write-gbps", "3"], "--nodes, --write-gbps only change the plan: add --plan"),
    (["--bogus"], "unrecognized arguments: --bogus (python train_fsdp.py --help lists the arguments)"),
    (["train.lrr=1e-3"], "unknown config key 'train.lrr'; did you mean 'train.lr'?"),
    (["trian.max_steps=3"], "no section 'trian'; did you mean 'train.max_steps'?"),
], ids=["negative-gpu-memory", "planner-flag-without-plan", "two-planner-flags", "unknown-flag", "typo-key",
        "typo-section"])
def test_command_line_mistakes_are_one_line(args, needle):
    one_error(cli("train_fsdp.py", "--config", "configs/tiny.yaml", *args), needle)


def test_help_config_lists_every_key_with_type_default_and_doc():
    from finetune.config import all_keys
    proc = cli("train_fsdp.py", "--help-config")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert [line.split(" ", 1)[0] for line in lines] == all_keys()
    assert "train.lr (float, default 0.001): peak learning rate" in lines
    assert "model.lora.r (int, default 0): LoRA rank" in "\n".join(lines)
    assert all(line.split("): ", 1)[1].strip() for line in lines), [x for x in lines if not x.split("): ", 1)[1]]


# ---------------------------------------------------------------- counts

def test_counts_are_singular_for_one(two_step_run, capsys):
    from ckpt.__main__ import main as ckpt_cli
    from common.words import plural
    assert (plural(1, "rank"), plural(2, "rank"), plural(0, "item")) == ("1 rank", "2 ranks", "0 items")
    ck = two_step_run / "checkpoints"
    capsys.readouterr()
    assert ckpt_cli(["inspect", str(ck)]) == ckpt_cli(["inspect", str(ck / "step-000002")]) == 0  # in this process
    text = capsys.readouterr().out
    assert "saved by 1 rank," in text, text
    assert " 1 ranks" not in text and " 1 items" not in text and "bytes items" not in text, text

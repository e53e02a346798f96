"""What a new user meets outside the training loop: every command's --help, errors on stderr, quiet logs, the plot.

    python -m pytest tests/test_usability.py -q
"""

from __future__ import annotations

import json
import os
import sys

import pytest

from conftest import ROOT, run_train, start_python

sys.path.insert(0, os.path.join(ROOT, "bench"))


def command_lines() -> list[list[str]]:
    """Every file with a `__main__` block, as a user would start it: `python -m pkg.mod` inside a package,
    `python path.py` otherwise. Found, not listed, so a new command is covered the day it is added."""
    cmds = []
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in ("tests", "runs", "__pycache__")]
        for name in sorted(f for f in files if f.endswith(".py")):
            path = os.path.join(folder, name)
            if 'if __name__ == "__main__"' not in open(path).read():
                continue
            rel = os.path.relpath(path, ROOT)
            if os.path.isfile(os.path.join(folder, "__init__.py")):
                module = rel[:-3].replace(os.sep, ".").removesuffix(".__main__")
                cmds.append([sys.executable, "-m", module])
            else:
                cmds.append([sys.executable, path])
    return cmds


def test_every_command_has_working_help(tmp_path, capsys):
    """Run from an empty folder: --help must print usage and exit 0 without doing any work. Each command is forked
    from tests/zygote.py (torch and transformers imported once, not once per command: ~100 CPU-s a run); its own
    modules are still run as `python` would, as __main__."""
    cmds = command_lines()
    assert len(cmds) >= 6, cmds
    procs = [(cmd, start_python([*cmd[1:], "--help"], {}, tmp_path, forked=True)) for cmd in cmds]
    for cmd, proc in procs:
        out, err = proc.communicate(timeout=300)
        shown = " ".join(os.path.relpath(c, ROOT) if c.startswith(ROOT) else c for c in cmd[1:])
        assert proc.returncode == 0 and "usage:" in out, f"{shown} --help:\n{out}{err}"
        assert "Traceback" not in err, shown
    assert os.listdir(tmp_path) == [], "a --help wrote files"
    from ckpt.__main__ import main as ckpt_cli
    for sub in ("verify", "inspect", "reshard", "export"):
        with pytest.raises(SystemExit) as exit_:
            ckpt_cli([sub, "--help"])
        assert exit_.value.code == 0 and f"usage: python -m ckpt {sub}" in capsys.readouterr().out


def test_ckpt_errors_go_to_stderr(tmp_path, capsys):
    from ckpt.__main__ import main as ckpt_cli
    for args, code in ((["verify", str(tmp_path / "nope")], 2), (["inspect", str(tmp_path / "nope")], 2),
                       (["inspect", str(tmp_path)], 1), (["export", str(tmp_path / "nope"), str(tmp_path / "out")], 2)):
        assert ckpt_cli(args) == code, args  # 2: bad input (a path that is no checkpoint), as README says
        out, err = capsys.readouterr()
        assert out == "" and len(err.strip().splitlines()) == 1, (args, out, err)


def test_process_mode_prints_no_dcp_info_lines(tmp_path):
    """DCP's uploader process logs ~3 INFO lines per rank per save; only our own lines may show."""
    proc = run_train(tmp_path / "r", nproc=2, overrides=["train.max_steps=4", "ckpt.interval=2",
                                                         "ckpt.async_mode=process"])
    assert "checkpoint step 2 committed" in proc.stdout and "checkpoint step 4 committed" in proc.stdout
    output = proc.stdout + proc.stderr
    assert " - INFO - " not in output, output[-3000:]


def test_bench_summary_says_faster_or_slower_the_right_way_round():
    from ckpt_bench import speed_words
    assert speed_words(1.77) == "1.77x faster"
    assert speed_words(1 / 1.25) == "1.25x slower"  # the ratio 0.8 once read "0.80x slower"


# ---------------------------------------------------------------- the loss plot

def _write_metrics(run_dir, ckpt_dir) -> str:
    """A W=2 run to step 6 (checkpoints 2, 4, 6; 2 deleted by retention), resumed at W=1 to step 10."""
    recs = [{"step": s, "loss": 5.0 - 0.3 * s, "world_size": 2 if s <= 6 else 1} for s in range(1, 11)]
    events = [{"event": "checkpoint", "step": s, "path": str(ckpt_dir / f"step-{s:06d}")} for s in (2, 4, 6, 8, 10)]
    events.append({"event": "resume", "step": 6, "world_size": 1, "saved_world_size": 2})
    for s in (4, 6, 8, 10):  # retained: a committed folder is on disk
        os.makedirs(ckpt_dir / f"step-{s:06d}")
        open(ckpt_dir / f"step-{s:06d}" / "commit.json", "w").write("{}")
    path = os.path.join(run_dir, "metrics.jsonl")
    with open(path, "w") as f:
        for r in recs[:6] + events[:3] + [events[5]] + recs[6:] + events[3:5]:
            f.write(json.dumps(r) + "\n")
    return path


def test_plot_marks_what_happened(tmp_path):
    from finetune.metrics import event_marks, read_metrics, world_size_spans
    path = _write_metrics(tmp_path, tmp_path / "checkpoints")
    steps, events = read_metrics(path)
    marks = event_marks(steps, events, str(tmp_path))
    assert sorted(marks) == [(2, "deleted"), (4, "kept"), (6, "kept"), (6, "resume"), (8, "kept"), (10, "kept")]
    assert world_size_spans(steps) == [(1, 6, 2), (7, 10, 1)]
    fresh = {s: r for s, r in steps.items() if s <= 6}
    assert "resume" not in {k for _, k in event_marks(fresh, events[:3], str(tmp_path))}


def test_plot_has_title_and_only_the_legend_entries_that_happened(tmp_path, monkeypatch):
    import matplotlib.axes  # in requirements.txt, like every test that plots: a missing install fails, never skips
    from finetune.metrics import plot_metrics
    seen = {}
    real_legend = matplotlib.axes.Axes.legend

    def spy(ax, *a, **k):
        seen["labels"] = ax.get_legend_handles_labels()[1]
        seen["title"] = ax.get_title()
        return real_legend(ax, *a, **k)

    monkeypatch.setattr(matplotlib.axes.Axes, "legend", spy)
    run = tmp_path / "run"
    run.mkdir()
    path = _write_metrics(run, run / "checkpoints")
    out = plot_metrics(path, str(tmp_path / "a.png"))
    assert open(out, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    assert seen["labels"] == ["loss", "checkpoint (deleted by retention)", "checkpoint (still on disk)", "resume"]
    assert seen["title"].startswith("run: loss over 10 steps") and "5 checkpoints, 1 resume" in seen["title"]
    lines = open(path).read().splitlines()  # the same run without its resume and its W=1 steps
    with open(path, "w") as f:
        f.write("\n".join(ln for ln in lines if '"resume"' not in ln and '"world_size": 1' not in ln) + "\n")
    plot_metrics(path, str(tmp_path / "b.png"))
    assert "resume" not in seen["labels"] and "0 resumes" in seen["title"]

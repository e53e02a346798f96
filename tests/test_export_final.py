"""export.at_end exports what this job trained, and `python -m ckpt export` never replaces a user's file.

    python -m pytest tests/test_export_final.py -q
"""

from safetensors.torch import load_file

from ckpt.__main__ import main as ckpt_cli
from conftest import run_train

TIMEOUT = 240


def test_export_at_end_is_this_jobs_final_state_and_export_refuses_a_file(tmp_path, capsys):
    run = tmp_path / "run"
    opts = ["ckpt.interval=3", "ckpt.keep_last=0", "ckpt.async_mode=off"]
    run_train(run, nproc=0, timeout=TIMEOUT, overrides=["train.max_steps=9", *opts])  # steps 3, 6, 9
    ckpt = run / "checkpoints"
    proc = run_train(run, nproc=0, timeout=TIMEOUT, overrides=[
        "train.max_steps=5", *opts, f"ckpt.resume={ckpt}/step-000003", "export.at_end=true"])
    assert f"export: step 5 -> {run}/hf " in proc.stdout, proc.stdout[-2000:]
    # the long phases a person waits on say when they start and how long they took (issue #26)
    assert f"resume: verifying {ckpt}/step-000003 ...\n" in proc.stdout, proc.stdout[-2000:]
    assert f"resume: verifying {ckpt}/step-000003: done in " in proc.stdout
    assert f"resume: loading {ckpt}/step-000003 ...\n" in proc.stdout, proc.stdout[-2000:]
    assert f"resume: loading {ckpt}/step-000003: done in " in proc.stdout
    assert f"export: writing step 5 to {run}/hf ...\n" in proc.stdout
    assert f"export: writing step 5 to {run}/hf: done in " in proc.stdout

    # the export holds step 5's weights: export step 5 and step 9 by hand (python -m ckpt export) and compare
    for step in (5, 9):
        assert ckpt_cli(["export", f"{ckpt}/step-{step:06d}", str(tmp_path / f"s{step}")]) == 0, capsys.readouterr()
    at_end, s5, s9 = (load_file(str(d / "model.safetensors")) for d in (run / "hf", tmp_path / "s5", tmp_path / "s9"))
    assert all((at_end[k] == s5[k]).all() for k in s5)
    assert any((at_end[k] != s9[k]).any() for k in s9)

    # OUT is an existing file: refused, the file untouched, nothing renamed beside it
    out = tmp_path / "notes.txt"
    out.write_text("mine\n")
    capsys.readouterr()
    code = ckpt_cli(["export", f"{ckpt}/step-000005", str(out)])
    printed = capsys.readouterr()
    assert code != 0 and f"{out} exists and is not a folder" in printed.out + printed.err
    assert out.read_text() == "mine\n"
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("notes")) == ["notes.txt"]

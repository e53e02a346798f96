"""export.at_end exports what this job trained, `python -m ckpt export` never replaces a user's file, and tied
embeddings are saved once, survive a resume and export tied.

    python -m pytest tests/test_export_final.py -q
"""

import json
import os

from safetensors.torch import load_file

from ckpt.__main__ import main as ckpt_cli
from conftest import ROOT, losses, run_train

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


def _tied_model_dir(path) -> str:
    """The tiny Llama of configs/tiny.yaml with its embeddings tied (lm_head.weight is embed_tokens.weight)."""
    config = json.loads(open(os.path.join(ROOT, "assets", "tiny-llama", "config.json")).read())
    os.makedirs(path)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({**config, "tie_word_embeddings": True}, f)
    return str(path)


def test_tied_embeddings_are_saved_once_resume_bit_identical_and_export_tied(tmp_path):
    """A tied weight is one tensor: the checkpoint holds it once (not lm_head.weight as well), a resume keeps the
    tie (the losses after it are the straight run's, bit for bit), and the export loads with the tie intact and
    gives the trained model's logits."""
    import torch
    import torch.distributed.checkpoint as dcp
    from transformers import AutoConfig, AutoModelForCausalLM

    model_dir = _tied_model_dir(tmp_path / "tied")
    opts = [f"model.config_path={model_dir}", "model.tokenizer_path=assets/tiny-llama", "train.max_steps=4",
            "ckpt.interval=2", "ckpt.keep_last=0", "ckpt.async_mode=thread", "export.at_end=true",
            "export.dtype=fp32"]
    straight, resumed = tmp_path / "a", tmp_path / "b"
    run_train(straight, nproc=2, timeout=TIMEOUT, overrides=opts)
    run_train(resumed, nproc=2, timeout=TIMEOUT,
              overrides=[*opts, f"ckpt.resume={straight}/checkpoints/step-000002"])
    a, b = losses(straight), losses(resumed)
    assert sorted(b) == [3, 4] and all(a[k] == b[k] for k in b), (a, b)

    ckpt = str(resumed / "checkpoints" / "step-000004")
    saved = dcp.FileSystemReader(ckpt).read_metadata().state_dict_metadata
    assert "app.model.model.embed_tokens.weight" in saved and "app.model.lm_head.weight" not in saved

    trained = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), dtype=torch.float32)
    state = {"app.model." + k: v for k, v in trained.state_dict().items() if k != "lm_head.weight"}
    dcp.load(state, checkpoint_id=ckpt, no_dist=True)  # in place: lm_head follows through the tie
    exported = AutoModelForCausalLM.from_pretrained(str(resumed / "hf")).eval()
    assert exported.lm_head.weight is exported.model.embed_tokens.weight, "tie lost in the export"
    assert "lm_head.weight" not in load_file(str(resumed / "hf" / "model.safetensors"))
    ids = torch.arange(3, 30).view(1, -1)
    with torch.no_grad():
        assert torch.equal(exported(input_ids=ids).logits, trained.eval()(input_ids=ids).logits)

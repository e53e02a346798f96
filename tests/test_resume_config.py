"""Resume with a changed config: every difference is listed, meaningless ones are refused, the schedule
after the resume is the new config's (docs/resume-rules.md).

    python -m pytest tests/test_resume_config.py -q
"""

import json
import os
import shutil

import pytest

from conftest import ROOT, events, run_train
from finetune.config import load_config, to_yaml
from finetune.model_identity import content_change_since
from finetune.resume_rules import GENERATED, ConfigChange, resume_changes, rules_table
from finetune.resume_rules import main as resume_rules_main
from finetune.data import GlobalOrder
from finetune.schedule import lr_factor

TIMEOUT = 180
BASE = ["ckpt.interval=2", "ckpt.async_mode=off", "train.warmup_steps=3", "train.lr=1e-3"]


def metrics(run):
    steps = {}
    with open(os.path.join(str(run), "metrics.jsonl")) as f:
        for line in f:
            rec = json.loads(line)
            if "event" not in rec:
                steps[rec["step"]] = rec
    return steps


def test_rules_per_field(monkeypatch):
    saved = to_yaml(load_config(None))
    changes = {c.key: c for c in resume_changes(saved, load_config(None, [
        "train.seed=7", "data.seq_len=48", "train.lr=0.5", "train.grad_clip=2", "model.config_path=elsewhere"]))}
    assert {k: c.verdict for k, c in changes.items()} == {
        "train.seed": "refused", "data.seq_len": "refused", "model.config_path": "refused",
        "train.lr": "applied", "train.grad_clip": "applied"}
    warned = resume_changes(saved, load_config(None, ["train.seed=7", "ckpt.resume_config_check=warn"]))
    assert [(c.key, c.verdict) for c in warned] == [("train.seed", "warned"), ("ckpt.resume_config_check", "applied")]
    monkeypatch.chdir(ROOT)  # the default's relative path and this absolute one name the same folder from here
    same_path = resume_changes(saved, load_config(None, [f"model.config_path={os.path.abspath('assets/tiny-llama')}"]))
    assert same_path == []


def test_the_docs_table_is_the_declared_rules():
    """docs/resume-rules.md's table per key is generated from the declarations (finetune/config.py resume=)."""
    with open(os.path.join(ROOT, "docs", "resume-rules.md"), encoding="utf-8") as f:
        doc = f.read()
    assert rules_table() in doc, "docs/resume-rules.md is stale: python -m finetune.resume_rules --write " \
                                 "docs/resume-rules.md"


def test_the_docs_table_is_rewritten_in_place(tmp_path):
    """--write replaces the table under the generated-by line and keeps the text around it."""
    doc = tmp_path / "rules.md"
    doc.write_text(f"intro\n\n{GENERATED}\n| old | table |\n|---|---|\n| `x` | gone |\n\nafter\n")
    assert resume_rules_main(["--write", str(doc)]) == 0
    assert doc.read_text() == f"intro\n\n{GENERATED}\n{rules_table()}\n\nafter\n"


def test_lr_and_max_steps_changed_on_resume_follow_the_new_schedule(tmp_path):
    """max_steps 4 -> 8 and lr 1e-3 -> 2e-3: steps 5..8 use exactly the new config's schedule, and it is logged."""
    run = tmp_path / "run"
    run_train(run, nproc=0, timeout=TIMEOUT, overrides=[*BASE, "train.max_steps=4"])
    proc = run_train(run, nproc=0, timeout=TIMEOUT, overrides=[*BASE, "train.max_steps=8", "train.lr=2e-3"])
    got = {s: r["lr"] for s, r in metrics(run).items() if s > 4}
    t = load_config(None, [*BASE, "train.max_steps=8", "train.lr=2e-3"]).train
    want = {s: 2e-3 * lr_factor(s - 1, t) for s in range(5, 9)}
    assert got == want
    assert "resume: config changed since" in proc.stdout and "train.lr: 0.001 -> 0.002 (applied" in proc.stdout
    assert "train.max_steps: 4 -> 8 (applied: the LR schedule follows the new config" in proc.stdout
    assert "resume: LR at step 5 is " in proc.stdout


def test_seed_change_refused_then_continues_the_saved_order_with_warn(tmp_path):
    run = tmp_path / "run"
    run_train(run, nproc=0, timeout=TIMEOUT, overrides=[*BASE, "train.max_steps=2", "train.seed=11"])
    refused = run_train(run, nproc=0, check=False, timeout=TIMEOUT,
                        overrides=[*BASE, "train.max_steps=4", "train.seed=12", "data.seq_len=48"])
    err = [x for x in refused.stderr.splitlines() if x.strip()]
    assert refused.returncode == 2 and len(err) == 1, refused.stderr[-3000:]
    assert err[0].startswith("error: resuming ") and "with a changed data.seq_len, train.seed (" in err[0], err[0]
    assert "ckpt.resume_config_check=warn" in err[0]
    assert max(metrics(run)) == 2  # nothing trained

    proc = run_train(run, nproc=0, timeout=TIMEOUT,
                     overrides=[*BASE, "train.max_steps=4", "train.seed=12", "ckpt.resume_config_check=warn"])
    assert "train.seed: 11 -> 12 (warned: " in proc.stdout and "continues with the checkpoint's seed" in proc.stdout
    rows = sum(1 for _ in open(os.path.join(ROOT, "data", "tiny", "train.jsonl")))
    order = GlobalOrder(rows, 11)  # the saved order, not seed 12's
    assert [metrics(run)[s]["sample_ids"] for s in (3, 4)] == [order.rows(24, 12), order.rows(36, 12)]
    assert "train.seed" in [c["key"] for c in events(run, "resume_config_changes")[-1]["changes"]]


def copy_model(dst, edit: dict | None = None) -> str:
    shutil.copytree(os.path.join(ROOT, "assets", "tiny-llama"), dst)
    if edit:
        cfg = json.load(open(os.path.join(dst, "config.json")))
        cfg.update(edit)
        json.dump(cfg, open(os.path.join(dst, "config.json"), "w"))
    return str(dst)


def test_moved_model_folder_resumes_an_edited_one_is_refused(tmp_path):
    """Continuing on another machine: model.config_path names an identical copy elsewhere. What the model is
    (its config.json, recorded in meta.json) decides, not where it lives; an edited copy is refused naming the
    fields that differ, with both values, from meta.json alone (the old machine's folder is gone)."""
    run = tmp_path / "run"
    first = copy_model(tmp_path / "machine-a" / "tiny")
    run_train(run, nproc=0, timeout=TIMEOUT, overrides=[*BASE, "train.max_steps=2", f"model.config_path={first}"])
    moved = copy_model(tmp_path / "machine-b" / "tiny")
    edited = copy_model(tmp_path / "edited", edit={"hidden_size": 96, "num_hidden_layers": 3})
    shutil.rmtree(first)  # the old machine's folder is gone: meta.json's fingerprint and record decide
    refused = run_train(run, nproc=0, check=False, timeout=TIMEOUT,
                        overrides=[*BASE, "train.max_steps=4", f"model.config_path={edited}"])
    err = [x for x in refused.stderr.splitlines() if x.strip()]
    assert refused.returncode == 2 and len(err) == 1, refused.stderr[-2000:]
    assert "with a changed model.config_path (" in err[0] and "the architecture trained is another one" in err[0]
    assert "(hidden_size: 64 -> 96, num_hidden_layers: 2 -> 3)" in err[0], err[0]
    proc = run_train(run, nproc=0, timeout=TIMEOUT, overrides=[*BASE, "train.max_steps=4", f"model.config_path={moved}"])
    assert f"model.config_path: '{first}' -> '{moved}' (applied: the same files at another path" in proc.stdout
    assert max(metrics(run)) == 4


def test_moved_model_of_an_older_checkpoint_compared_by_its_saved_folder(tmp_path):
    """A checkpoint without meta.json's model_content: compared with the saved folder while it exists."""
    first, moved = copy_model(tmp_path / "a"), copy_model(tmp_path / "b")
    edited = copy_model(tmp_path / "c", edit={"hidden_act": "gelu"})
    saved = to_yaml(load_config(None, [f"model.config_path={first}"]))
    for folder, verdict in ((moved, "applied"), (edited, "refused")):
        cfg = load_config(None, [f"model.config_path={folder}"])
        changes = resume_changes(saved, cfg, content_change_since({}, cfg.model))
        assert [(c.key, c.verdict) for c in changes] == [("model.config_path", verdict)], changes
        assert isinstance(changes[0], ConfigChange)
    assert changes[0].why == "the architecture trained is another one (hidden_act: 'silu' -> 'gelu')", changes[0].why


def test_a_base_with_other_weights_is_refused_naming_the_fingerprints(tmp_path):
    """model.name_or_path at a copy whose config.json is the same but whose weights are not."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from ckpt.lora_base import base_fingerprint

    first = copy_model(tmp_path / "a")
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(first)).save_pretrained(first)
    other = str(shutil.copytree(first, tmp_path / "b"))
    weights = os.path.join(other, "model.safetensors")
    save_file({k: v + 0.01 for k, v in load_file(weights).items()}, weights, metadata={"format": "pt"})
    saved = to_yaml(load_config(None, [f"model.name_or_path={first}"]))
    cfg = load_config(None, [f"model.name_or_path={other}"])
    changes = {c.key: c for c in resume_changes(saved, cfg, content_change_since({}, cfg.model))}
    a, b = base_fingerprint(first)["fingerprint"], base_fingerprint(other)["fingerprint"]
    assert changes["model.name_or_path"].verdict == "refused"
    assert changes["model.name_or_path"].why == \
        f"the weights trained on are another model's (the weights' fingerprint differs ({a} -> {b}))"

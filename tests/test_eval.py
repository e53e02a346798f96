"""Document-aware packing, the validation loss and ckpt.keep_best (issue 13).

    python -m pytest tests/test_eval.py -q
"""

import json
import os

import numpy as np
import pytest
import torch

from conftest import ROOT, events, losses, run_train
from finetune.data import IGNORE, Samples
from finetune.eval_metrics import EVAL_METRICS
from finetune.evaluate import token_loss_sum


def _model_config(attn_implementation: str):
    from finetune.config import ModelConfig
    return ModelConfig(config_path=os.path.join(ROOT, "assets", "tiny-llama"), attn_implementation=attn_implementation)


@pytest.fixture(scope="module")
def tiny_models():
    """The tiny Llama under each CPU attention implementation (model.attn_implementation), with the same weights."""
    from finetune.model import causal_lm_from_config
    torch.manual_seed(0)
    models = {impl: causal_lm_from_config(_model_config(impl)).eval() for impl in ("sdpa", "eager")}
    models["eager"].load_state_dict(models["sdpa"].state_dict())
    return models


@pytest.fixture(scope="module")
def tiny_model(tiny_models):
    return tiny_models["sdpa"]


def _cache(docs):
    from types import SimpleNamespace
    tokens = np.concatenate([np.asarray(d, dtype=np.int32) for d in docs])
    offsets = np.cumsum([0] + [len(d) for d in docs]).astype(np.int64)
    return SimpleNamespace(tokens=tokens, mask=np.ones(len(tokens), np.uint8), offsets=offsets,
                           meta={"n_docs": len(docs), "n_tokens": len(tokens), "pad_id": 0, "source": "x"})


@torch.no_grad()
@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_packed_loss_equals_the_sum_of_each_documents_own_loss(tiny_models, impl):
    """Two packed rows of 24 tokens holding 6 documents (one cut across the rows): the summed token loss of
    the packed batch equals the sum of each document's (piece's) loss computed alone, padded to nothing."""
    tiny_model = tiny_models[impl]
    rng = np.random.default_rng(0)
    docs = [rng.integers(3, 100, n).tolist() for n in (5, 9, 12, 5, 13, 4)]  # 48 tokens
    samples = Samples(_cache(docs), seq_len=24, pack=True)
    ids, labels, pos = samples.batch([0, 1])
    packed = token_loss_sum(tiny_model, ids, labels, pos).double()
    alone = torch.zeros((), dtype=torch.float64)
    for row in range(2):
        starts = (pos[row] == 0).nonzero().flatten().tolist() + [24]
        for a, b in zip(starts[:-1], starts[1:]):  # each document, or piece of one, in its own forward
            piece = ids[row, a:b][None]
            alone += token_loss_sum(tiny_model, piece, piece.clone()).double()
    assert len(torch.nonzero(pos == 0)) == 7  # 6 documents, one of them cut in two
    assert torch.allclose(packed, alone, rtol=1e-5), (packed.item(), alone.item())
    # without position ids the documents see each other: the loss differs (the test can fail)
    leaky = token_loss_sum(tiny_model, ids, labels, None).double()
    assert not torch.allclose(leaky, alone, rtol=1e-5)


@torch.no_grad()
def test_padding_free_rows_give_the_same_loss(tiny_model):
    """The flattened layout varlen/flash attention uses on GPU (one row, per-document positions) equals the
    [batch, seq_len] layout: what the packing test proves on CPU/SDPA carries to the flash path."""
    rng = np.random.default_rng(1)
    docs = [rng.integers(3, 100, n).tolist() for n in (7, 11, 6, 12, 12)]
    rows = token_loss_sum(tiny_model, *Samples(_cache(docs), seq_len=16, pack=True).batch([0, 1, 2])).double()
    ids, labels, pos = Samples(_cache(docs), seq_len=16, pack=True, padding_free=True).batch([0, 1, 2])
    assert ids.shape == (1, 48)
    flat = token_loss_sum(tiny_model, ids, labels, pos).double()
    assert torch.allclose(rows, flat, rtol=1e-5)


@torch.no_grad()
def test_attn_implementation_reaches_the_model_and_eager_equals_sdpa(tiny_models):
    from finetune.config import load_config
    from finetune.model import causal_lm_from_config
    assert load_config(None, ["model.attn_implementation=eager"]).model.attn_implementation == "eager"
    with torch.device("meta"):  # what build_sharded_model builds before fully_shard
        assert causal_lm_from_config(_model_config("eager")).config._attn_implementation == "eager"
    assert {k: m.config._attn_implementation for k, m in tiny_models.items()} == {"sdpa": "sdpa", "eager": "eager"}
    rng = np.random.default_rng(2)
    batch = Samples(_cache([rng.integers(3, 100, n).tolist() for n in (9, 3, 14, 6)]), 16, pack=True).batch([0, 1])
    eager, sdpa = (token_loss_sum(tiny_models[k], *batch).double() for k in ("eager", "sdpa"))
    assert torch.allclose(eager, sdpa, rtol=1e-5), (eager.item(), sdpa.item())


def test_flash_attention_is_refused_in_one_line_where_it_cannot_run(tmp_path, monkeypatch):
    """A value outside the list names the key; flash without CUDA, without its package, or with fp32 compute is
    a one-line ModelError, and train_fsdp.py exits 2 with it before any process group."""
    import subprocess

    import transformers.utils

    from conftest import train_cmd
    from finetune.config import ConfigError, load_config
    from finetune.model import ModelError, check_attn_implementation
    with pytest.raises(ConfigError, match=r"config key 'model.attn_implementation' must be one of "
                                          r"eager\|sdpa\|flash_attention_2\|flash_attention_3, got 'flash'"):
        load_config(None, ["model.attn_implementation=flash"])
    check_attn_implementation(_model_config("eager"))  # nothing to check
    if not torch.cuda.is_available():
        with pytest.raises(ModelError, match=r"^model.attn_implementation=flash_attention_2 needs a CUDA GPU"):
            check_attn_implementation(_model_config("flash_attention_2"))
        proc = subprocess.run(train_cmd(0, [f"run.dir={tmp_path}", "model.attn_implementation=flash_attention_3"]),
                              cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and proc.stderr.startswith(
            "error: model.attn_implementation=flash_attention_3 needs a CUDA GPU") and proc.stderr.count("\n") == 1
        assert not os.path.exists(tmp_path / "metrics.jsonl")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(transformers.utils, "is_flash_attn_2_available", lambda: False)
    with pytest.raises(ModelError, match=r"^model.attn_implementation=flash_attention_2 needs the flash_attn package"):
        check_attn_implementation(_model_config("flash_attention_2"))
    monkeypatch.setattr(transformers.utils, "is_flash_attn_2_available", lambda: True)
    fp32 = _model_config("flash_attention_2")
    fp32.param_dtype = "fp32"
    with pytest.raises(ModelError, match=r"computes in bf16/fp16 only, but model.param_dtype=fp32"):
        check_attn_implementation(fp32)
    check_attn_implementation(_model_config("flash_attention_2"))  # auto: bf16 on CUDA


def test_each_eval_metric_adds_up_exactly_over_chunks():
    """Next-token accuracy counts the scored tokens whose argmax is the label (3 of 4 here); every metric's chunk
    sums are integers, so two chunks' add up exactly, in any order: what makes a metric the same at any W."""
    labels = torch.tensor([[IGNORE, 1, 2, 3, 0], [IGNORE, IGNORE, 2, 2, 1]])  # row 0 scores positions 0-3 (1, 2, 3, 0)
    logits = torch.full((2, 5, 4), -5.0)
    for row, predicted in enumerate([[1, 2, 0, 0, 3], [0, 2, 2, 0, 0]]):  # row 0: wrong at 2; row 1: right at 1, 2
        for pos, tok in enumerate(predicted):
            logits[row, pos, tok] = 5.0
    accuracy = {m.field: m for m in EVAL_METRICS}["eval_accuracy"]
    assert accuracy.sums(logits[:1], labels[:1]) == (3, 4) and accuracy.value([3, 4]) == 0.75
    assert accuracy.sums(logits, labels) == (5, 7)
    for m in EVAL_METRICS:
        chunks = [m.sums(logits[r:r + 1], labels[r:r + 1]) for r in (0, 1)]
        assert all(type(n) is int for c in chunks for n in c), m.field


# ---------------------------------------------------------------- validation loss in real runs

EVAL = ["data.eval_path=data/tiny/eval.jsonl", "data.micro_batch_size=5"]  # 64 eval rows -> 13 chunks of 5


def test_eval_loss_identical_at_one_and_two_ranks(tmp_path):
    """lr=1e-30 leaves the initial weights (the same at any W) unchanged in fp32: the eval loss must then be the
    same number, exactly,
    with W=2 running an odd number of chunks (one dummy forward)."""
    common = [*EVAL, "train.max_steps=2", "train.eval_interval=1", "train.lr=1e-30", "ckpt.interval=0",
              "ckpt.save_at_end=false"]
    run_train(tmp_path / "w1", nproc=0, overrides=common)
    proc = run_train(tmp_path / "w2", nproc=2, overrides=common)
    a, b = events(tmp_path / "w1", "eval"), events(tmp_path / "w2", "eval")
    assert [e["step"] for e in a] == [e["step"] for e in b] == [1, 2]
    for m in EVAL_METRICS:
        assert [e[m.field] for e in a] == [e[m.field] for e in b], m.field
    assert 0 < a[0]["eval_accuracy"] < 1
    assert a[0]["eval_rows"] == 64 and a[0]["eval_tokens"] == b[0]["eval_tokens"] > 0
    assert "eval        2 | eval_loss " in proc.stdout


def test_eval_does_not_change_the_training_trajectory_and_runs_at_the_end(tmp_path):
    """Losses bit-identical with and without eval; max_steps=6 is no multiple of eval_interval=4, so the run
    evaluates at 4 and once more at the end (6); the loss plot draws those two eval points."""
    common = [*EVAL, "train.max_steps=6", "ckpt.interval=0", "ckpt.save_at_end=false"]
    run_train(tmp_path / "plain", nproc=0, overrides=[*common, "train.eval_interval=0"])
    run_train(tmp_path / "eval", nproc=0, overrides=[*common, "train.eval_interval=4", "train.eval_batches=2"])
    assert losses(tmp_path / "plain") == losses(tmp_path / "eval")  # bit-identical floats
    ev = events(tmp_path / "eval", "eval")
    assert [e["step"] for e in ev] == [4, 6] and all(e["eval_rows"] == 24 for e in ev)
    assert ev[-1]["eval_loss"] < ev[0]["eval_loss"]
    from finetune.metrics import loss_figure, plot_metrics
    fig = loss_figure(str(tmp_path / "eval" / "metrics.jsonl"))
    lines = {line.get_label(): line for line in fig.axes[0].get_lines()}
    assert list(lines["eval loss"].get_xdata()) == [4, 6]
    assert list(lines["eval loss"].get_ydata()) == [e["eval_loss"] for e in ev]
    assert list(lines["loss"].get_xdata()) == [1, 2, 3, 4, 5, 6]
    accuracy = {line.get_label(): line for line in fig.axes[-1].get_lines()}["eval next-token accuracy"]
    assert list(accuracy.get_ydata()) == [e["eval_accuracy"] for e in ev] and fig.axes[-1].get_ylim() == (0, 1)
    legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert "eval loss" in legend and "eval next-token accuracy" in legend and not any(t[0] == "_" for t in legend)
    assert [a.get_xlabel() for a in fig.axes].count("optimizer step") == 1  # on the bottom panel, not the twin
    assert os.path.getsize(plot_metrics(str(tmp_path / "eval" / "metrics.jsonl"), str(tmp_path / "p.png"))) > 0


def test_packed_run_has_the_same_losses_at_one_and_two_ranks(tmp_path):
    """data.pack=true end to end: position ids and loss masks per document give the same losses at W=1 and W=2."""
    common = ["data.pack=true", "train.max_steps=3", "ckpt.interval=0", "ckpt.save_at_end=false"]
    run_train(tmp_path / "w1", nproc=0, overrides=common)
    run_train(tmp_path / "w2", nproc=2, overrides=common)
    a, b = losses(tmp_path / "w1"), losses(tmp_path / "w2")
    assert sorted(a) == sorted(b) == [1, 2, 3]
    for k in a:
        assert a[k] == pytest.approx(b[k], rel=1e-5), f"step {k}: W=1 {a[k]} vs W=2 {b[k]}"


# ---------------------------------------------------------------- ckpt.keep_best

def _fake_checkpoint(ckpt_dir, step: int, score=None) -> None:
    from ckpt.layout import COMMIT_FILE, step_dir
    path = step_dir(str(ckpt_dir), step)
    os.makedirs(path)
    meta = {"step": step} if score is None else {"step": step, "score": score}
    with open(os.path.join(path, "meta.json"), "w") as f:
        json.dump(meta, f)
    open(os.path.join(path, COMMIT_FILE), "w").close()


def test_keep_best_survives_retention_and_restarts(tmp_path):
    from ckpt import CheckpointManager
    from ckpt.layout import list_step_dirs
    scores = {2: 3.0, 4: 1.5, 6: 2.5, 8: 1.0, 10: 2.0, 12: None}
    mgr = CheckpointManager(str(tmp_path), "off", keep_last=1, keep_best=2)
    for step, score in list(scores.items())[:4]:
        _fake_checkpoint(tmp_path, step, score)
        mgr.committer.apply_retention(step)
    assert [s for s, _ in list_step_dirs(str(tmp_path))] == [4, 8]  # best two (8 is also the newest)
    mgr.close()
    again = CheckpointManager(str(tmp_path), "off", keep_last=1, keep_best=2)  # a restarted job
    for step, score in list(scores.items())[4:]:
        _fake_checkpoint(tmp_path, step, score)
        again.committer.apply_retention(step)
    assert [s for s, _ in list_step_dirs(str(tmp_path))] == [4, 8, 12]  # an unscored newest never evicts the best
    again.close()


def test_eval_loss_is_the_checkpoint_score_and_inspect_shows_it(tmp_path, capsys):
    run = tmp_path / "run"
    run_train(run, nproc=0, overrides=[*EVAL, "train.max_steps=6", "train.eval_interval=2", "train.eval_batches=1",
                                       "ckpt.interval=2", "ckpt.keep_last=1", "ckpt.keep_best=1",
                                       "ckpt.async_mode=off"])
    ev = {e["step"]: e["eval_loss"] for e in events(run, "eval")}
    from ckpt.describe import list_checkpoints
    from ckpt.layout import list_step_dirs
    kept = list_step_dirs(str(run / "checkpoints"))
    best = min(ev, key=ev.get)
    assert {s for s, _ in kept} == {best, 6}
    for s, path in kept:
        assert json.load(open(os.path.join(path, "meta.json")))["score"] == ev[s]
    list_checkpoints(str(run / "checkpoints"))
    assert f"{ev[6]:.4f}" in capsys.readouterr().out

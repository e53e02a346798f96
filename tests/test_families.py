"""The model families the project supports, each through the same checks: the conformance list.

    python -m pytest tests/test_families.py -q -n 0
    python -m pytest tests/test_families.py -q -n 0 -k mixtral     # one family

A new family: one entry in finetune/tiny_assets.py FAMILIES (its tiny config, generated into assets/families/ by
`python -m finetune.tiny_assets`), nothing here. A family the code cannot take is refused at model build, in one line
naming what is missing (finetune/model.py check_family). Every entry is checked for:
- random init: every parameter equal, in full, at W=1 and W=2 (tests/family_ranks.py: one torchrun for all families);
- a folder as transformers' own save_pretrained writes it (the Hub's layout) loads at W=2: every parameter equal to
  from_pretrained's, and the same logits;
- train at W=2 from random init, resume its step-2 checkpoint at W=1: the same losses; the export written at the end
  (export.at_end, every rank a share) has the tensor names and values transformers' save_pretrained writes for the
  same weights, and from_pretrained of it gives the checkpoint's logits;
- LoRA on the saved folder: the adapter export and the merged export agree with peft's own merge.
MoE entries published one tensor per expert (Qwen3-MoE, Mixtral) load and export through transformers' own conversion
rules (ckpt/hf/convert.py); gpt-oss is published fused.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from conftest import ROOT, losses, read_hf_tensors, run_python, run_train
from family_ranks import ids as _ids
from family_ranks import model_cfg as _model_cfg
from finetune.tiny_assets import FAMILIES, family_dir

TOKENIZER = os.path.join(ROOT, "assets", "tiny-llama")
STEPS = ["train.max_steps=4", "ckpt.interval=2", "ckpt.keep_last=0", "ckpt.async_mode=off", "train.eval_interval=0",
         f"model.tokenizer_path={TOKENIZER}"]


def families(runs: bool = False) -> list:
    """FAMILIES as test parameters; with runs, a family's run tests in one xdist group (one worker makes its runs
    once, families spread out)."""
    return [pytest.param(name, marks=[pytest.mark.xdist_group(f"family-{name}")] if runs else []) for name in FAMILIES]


@pytest.mark.quick
def test_committed_family_configs_are_what_the_generator_writes(tmp_path):
    from finetune.tiny_assets import write_family
    for name in FAMILIES:
        with open(os.path.join(write_family(str(tmp_path), name), "config.json")) as f, \
                open(os.path.join(family_dir(ROOT, name), "config.json")) as g:
            assert json.load(f) == json.load(g), f"assets/families/{name}: run python -m finetune.tiny_assets"
    assert sorted(os.listdir(os.path.join(ROOT, "assets", "families"))) == sorted(FAMILIES)


def save_family(path: str, name: str) -> str:
    """Random weights from transformers' own init, every parameter perturbed (norms and biases too), written by its
    own save_pretrained (the Hub's layout), the character tokenizer beside them."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(FAMILIES[name].config(), dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(path)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(os.path.join(TOKENIZER, f), path)
    return path


_saved: dict[str, str] = {}


def saved_folder(tmp_path_factory, name: str) -> str:
    """The family's save_pretrained folder, made once per pytest process."""
    if name not in _saved:
        _saved[name] = save_family(str(tmp_path_factory.mktemp(f"hub-{name}")), name)
    return _saved[name]


@pytest.fixture(scope="module")
def in_process(tmp_path_factory) -> dict:
    """One pair of gloo ranks (tests/family_ranks.py, forked from tests/zygote.py: imports done) for every family's
    init and load checks: {rank: {family: what it found}}."""
    root = tmp_path_factory.mktemp("family-ranks")
    with open(root / "saved.json", "w") as f:
        json.dump({name: saved_folder(tmp_path_factory, name) for name in FAMILIES}, f)
    proc = run_python(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                       os.path.join(ROOT, "tests", "family_ranks.py"), str(root / "saved.json"), str(root)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    out = {}
    for rank in (0, 1):
        with open(root / f"rank{rank}.json") as f:
            out[rank] = json.load(f)
    return out


@pytest.mark.parametrize("name", families())
def test_random_init_is_the_same_at_one_and_two_ranks(in_process, name):
    """Every parameter, not only Linear/Embedding: MoE experts and routers, norms, biases, attention sinks."""
    for rank in (0, 1):
        r = in_process[rank][name]
        assert r["init_names"] and r["init_params"] > 0
        assert r["init_differ"] == [], f"{name}: W=1 and W=2 drew other values for {r['init_differ']}"


@pytest.mark.parametrize("name", families())
def test_a_save_pretrained_folder_loads_exactly(in_process, name):
    for rank in (0, 1):
        r = in_process[rank][name]["load"]
        assert "error" not in r, r.get("error")
        assert r["differ"] == [], f"{name}: loaded parameters differ from from_pretrained's: {r['differ']}"
        assert r["logits_diff"] < 1e-5


# ---------------------------------------------------------------- runs: W=2 from random init, resume at W=1, export

_runs: dict[str, object] = {}


def trained(tmp_path_factory, name: str):
    """Run A: W=2 from random init, 4 steps, checkpoints at 2 and 4, exported at the end (once per family)."""
    if name not in _runs:
        run = tmp_path_factory.mktemp(f"family-{name}") / "a"
        run_train(run, 2, [*STEPS, *FAMILIES[name].overrides, f"model.config_path={family_dir(ROOT, name)}",
                           "export.at_end=true"])
        _runs[name] = run
    return _runs[name]


@pytest.mark.parametrize("name", families(runs=True))
def test_train_at_two_ranks_resumes_at_one_with_the_same_losses(tmp_path_factory, tmp_path, name):
    a = trained(tmp_path_factory, name)
    run_train(tmp_path / "b", 0, [*STEPS, *FAMILIES[name].overrides, f"model.config_path={family_dir(ROOT, name)}",
                                  f"ckpt.resume={a / 'checkpoints' / 'step-000002'}"])
    la, lb = losses(a), losses(tmp_path / "b")
    assert sorted(lb) == [3, 4]
    for s in (3, 4):
        assert lb[s] == pytest.approx(la[s], rel=1e-4), f"{name} step {s}: {lb[s]} at W=1 after {la[s]} at W=2"


def _checkpoint_model(ckpt: str, name: str):
    """transformers' model of the family with the checkpoint's weights put in by name (ties left to transformers)."""
    from transformers import AutoModelForCausalLM

    from ckpt.reading import dcp_metadata, read_items
    from ckpt.schema import schema_of

    prefix = schema_of(ckpt).model_prefix
    keys = [k for k in dcp_metadata(ckpt).state_dict_metadata if k.startswith(prefix)]
    state = {k[len(prefix):]: v for k, v in read_items(ckpt, keys).items()}
    model = AutoModelForCausalLM.from_config(FAMILIES[name].config(), dtype=torch.float32,
                                             attn_implementation=_model_cfg(name).attn_implementation)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    return model.eval()


@pytest.mark.parametrize("name", families(runs=True))
def test_export_is_what_transformers_writes_and_gives_the_checkpoints_logits(tmp_path_factory, tmp_path, name):
    """transformers' reference: its model of the family built from the config, the checkpoint's weights put in by
    state-dict name, written by its save_pretrained (a model it did not load, so in the Hub's layout)."""
    from transformers import AutoModelForCausalLM

    a = trained(tmp_path_factory, name)
    export, reference = str(a / "hf"), _checkpoint_model(str(a / "checkpoints" / "step-000004"), name)
    reference.save_pretrained(tmp_path / "theirs")
    written, theirs = read_hf_tensors(export), read_hf_tensors(str(tmp_path / "theirs"))
    assert sorted(written) == sorted(theirs), f"{name}: tensor names differ from save_pretrained's"
    assert [n for n in written if not torch.equal(written[n], theirs[n])] == []
    ours = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32,
                                                attn_implementation=_model_cfg(name).attn_implementation).eval()
    with torch.no_grad():
        assert float((ours(input_ids=_ids()).logits - reference(input_ids=_ids()).logits).abs().max()) < 1e-5


@pytest.mark.parametrize("name", families(runs=True))
def test_lora_adapter_and_merged_exports_agree_with_peft(tmp_path_factory, tmp_path, name):
    """LoRA on the saved folder at W=1, 2 steps, merged export at the end; the adapter alone exported after: peft's
    merge of that adapter into the base has the merged export's names, values and logits."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from ckpt.hf.export import export_checkpoint

    saved = {name: saved_folder(tmp_path_factory, name)}
    run = tmp_path / "lora"
    run_train(run, 0, [*STEPS, "train.max_steps=2", *FAMILIES[name].overrides, f"model.name_or_path={saved[name]}",
                       "model.lora.r=4", f"model.lora.target_modules={FAMILIES[name].lora_targets}",
                       "export.at_end=true"])
    export_checkpoint(str(run / "checkpoints" / "step-000002"), str(tmp_path / "adapter"), adapter=True)
    attn = _model_cfg(name).attn_implementation
    base = AutoModelForCausalLM.from_pretrained(saved[name], dtype=torch.float32, attn_implementation=attn)
    peft_merged = PeftModel.from_pretrained(base, str(tmp_path / "adapter")).merge_and_unload().eval()
    peft_merged.save_pretrained(tmp_path / "peft-merged")
    merged, reference = read_hf_tensors(str(run / "hf")), read_hf_tensors(str(tmp_path / "peft-merged"))
    assert sorted(merged) == sorted(reference) == sorted(read_hf_tensors(saved[name]))
    assert [n for n in merged if not torch.allclose(merged[n], reference[n], atol=1e-6)] == []
    ours = AutoModelForCausalLM.from_pretrained(str(run / "hf"), dtype=torch.float32, attn_implementation=attn).eval()
    with torch.no_grad():
        assert float((ours(input_ids=_ids()).logits - peft_merged(input_ids=_ids()).logits).abs().max()) < 1e-5
    assert any(not torch.equal(merged[n], read_hf_tensors(saved[name])[n]) for n in merged), "the adapters did nothing"


# ---------------------------------------------------------------- what a family must have: refused in one line

def _meta_model(name: str = "llama"):
    from finetune.model import causal_lm_from_config
    with torch.device("meta"):
        return causal_lm_from_config(_model_cfg(name, config_path=family_dir(ROOT, name)))


@pytest.mark.quick
def test_a_family_missing_what_the_code_needs_is_refused_by_name():
    import types

    from finetune.model import ModelError, check_family

    for name in FAMILIES:
        check_family(_meta_model(name))
    model = _meta_model()
    model.get_output_embeddings = lambda: None
    with pytest.raises(ModelError, match="LlamaForCausalLM has no language-model head"):
        check_family(model)
    model = _meta_model()
    model.forward = types.MethodType(lambda self, input_ids, use_cache=False: None, model)
    with pytest.raises(ModelError, match="forward takes no position_ids"):
        check_family(model)


@pytest.mark.quick
def test_a_parameter_transformers_does_not_initialise_is_refused_by_name():
    """A random init that drew it from nothing (to_empty's garbage) would differ per run and per world size."""
    import torch.nn as nn

    from finetune.model import ModelError, init_buffers, init_random

    model = _meta_model()
    model.model.layers[1].self_attn.scale = nn.Parameter(torch.empty(4, device="meta"))
    model.to_empty(device="cpu")
    init_buffers(model)
    with pytest.raises(ModelError, match=r"leaves model\.layers\.1\.self_attn\.scale \(LlamaAttention\) uninit"):
        init_random(model, 0, 0.02)


@pytest.mark.quick
def test_random_init_restores_the_global_rng_and_takes_init_std():
    from finetune.model import init_buffers, init_random

    model = _meta_model()
    model.to_empty(device="cpu")
    init_buffers(model)
    torch.manual_seed(5)
    state = torch.get_rng_state()
    init_random(model, 0, 0.5)
    assert torch.equal(torch.get_rng_state(), state)
    assert model.config.initializer_range == 0.02  # put back
    assert float(model.model.embed_tokens.weight.detach().std()) == pytest.approx(0.5, rel=0.05)


@pytest.mark.quick
@pytest.mark.parametrize("name", families())
def test_random_init_draws_what_transformers_draws(name):
    """Per parameter, init_random's values have transformers' own init: the same constants (norms' ones or zeros,
    biases' zeros) and, for the drawn ones, the same spread (GPT-2's scaled projections, gpt-oss's router bias)."""
    from transformers import AutoModelForCausalLM

    from finetune.model import init_buffers, init_random

    torch.manual_seed(0)
    theirs = dict(AutoModelForCausalLM.from_config(FAMILIES[name].config(), dtype=torch.float32).named_parameters())
    model = _meta_model(name)
    model.to_empty(device="cpu")
    model.tie_weights()  # to_empty makes each module's tensors anew
    init_buffers(model)
    init_random(model, 0, model.config.initializer_range)
    for n, p in model.named_parameters():
        ours, ref = p.detach(), theirs[n].detach()
        if bool((ref == ref.flatten()[0]).all()):
            assert torch.equal(ours, ref), f"{name} {n}: transformers initialises it to {float(ref.flatten()[0])}"
        elif ref.numel() >= 64:
            assert float(ours.std()) == pytest.approx(float(ref.std()), rel=0.25), f"{name} {n}"

"""Config: defaults < YAML < command line, and errors that name the key.

    python -m pytest tests/test_config.py -q
"""

import dataclasses
import os
import re
from dataclasses import dataclass, field

import pytest

from conftest import ROOT

from finetune.config import Config, ConfigError, DataConfig, declarations, load_config
from finetune.config_keys import Resume, key, refused
from finetune.data.cache import cache_key


def test_precedence_defaults_yaml_cli(tmp_path):
    y = tmp_path / "c.yaml"
    y.write_text("train:\n  max_steps: 7\n  lr: 0.5\nrun:\n  dir: from_yaml\n")
    cfg = load_config(str(y), ["train.max_steps=9"])
    assert cfg.train.max_steps == 9          # command line beats YAML
    assert cfg.train.lr == 0.5               # YAML beats default
    assert cfg.train.seed == 1234            # default kept
    assert cfg.ckpt.dir == "from_yaml/checkpoints"  # derived from run.dir


def test_types_are_coerced_from_strings():
    cfg = load_config(None, ["train.lr=1e-4", "ckpt.async_mode=process", "model.activation_checkpointing=true"])
    assert cfg.train.lr == pytest.approx(1e-4) and isinstance(cfg.train.lr, float)
    assert cfg.ckpt.async_mode == "process"
    assert cfg.model.activation_checkpointing is True


@pytest.mark.parametrize("override,needle", [
    ("train.max_stepz=3", "train.max_stepz"),
    ("bogus.x=1", "bogus.x"),
    ("max_steps=3", "max_steps"),
])
def test_unknown_key_is_named(override, needle):
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
        load_config(None, [override])


@pytest.mark.parametrize("override,needle", [
    ("train.max_steps=abc", "train.max_steps"),
    ("train.max_steps=1.5", "train.max_steps"),
    ("model.cpu_offload=maybe", "model.cpu_offload"),
    ("ckpt.async_mode=fast", "ckpt.async_mode"),
    ("data.global_batch_size=0", "data.global_batch_size"),
])
def test_wrong_type_or_value_is_named(override, needle):
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
        load_config(None, [override])


def test_unknown_key_in_yaml(tmp_path):
    y = tmp_path / "c.yaml"
    y.write_text("train:\n  learning_rate: 0.1\n")
    with pytest.raises(ConfigError, match="train.learning_rate"):
        load_config(str(y))


def test_missing_yaml_file():
    with pytest.raises(ConfigError, match="not found"):
        load_config("configs/nope.yaml")


# ---------------------------------------------------------------- ranges and YAML syntax (issue 18, points 11-12)

@pytest.mark.parametrize("override,needle", [
    ("run.log_interval=0", "config key 'run.log_interval' must be >= 1, got 0"),
    ("train.max_steps=ten", "config key 'train.max_steps' must be int, got 'ten'"),
    ("ckpt.timeout_minutes=-1", "config key 'ckpt.timeout_minutes' must be > 0, got -1.0"),
    ("train.lr=-1e-3", "config key 'train.lr' must be > 0, got -0.001"),
    ("train.lr=nan", "config key 'train.lr' must be > 0, got nan"),
    ("train.min_lr_ratio=1.5", "config key 'train.min_lr_ratio' must be in [0, 1], got 1.5"),
    ("train.beta2=1", "config key 'train.beta2' must be in [0, 1), got 1.0"),
    ("train.warmup_steps=-1", "config key 'train.warmup_steps' must be >= 0, got -1"),
    ("data.seq_len=1", "config key 'data.seq_len' must be >= 2, got 1"),
    ("train.collective_timeout_minutes=0", "config key 'train.collective_timeout_minutes' must be > 0"),
    ("train.hang_timeout=600", "config key 'train.hang_timeout=600' must be at most 480s, 0.8 x "
                               "train.collective_timeout_minutes (10 min = 600s)"),
    ("train.hang_timeout=599", "config key 'train.hang_timeout=599' must be at most 480s"),  # NCCL would fire first
    ("train.hang_timeout=481", "config key 'train.hang_timeout=481' must be at most 480s"),
    ("ckpt.keep_last=-2", "config key 'ckpt.keep_last' must be >= 0, got -2"),
    ("ckpt.interval=-1", "config key 'ckpt.interval' must be a step count >= 0 or auto, got '-1'"),
    ("ckpt.interval=often", "config key 'ckpt.interval' must be a step count >= 0 or auto, got 'often'"),
    ("ckpt.mtbf_hours=0", "config key 'ckpt.mtbf_hours' must be > 0"),
    ("ckpt.interval_minutes=-5", "config key 'ckpt.interval_minutes' must be >= 0"),
])
def test_numeric_range_names_key_and_range(override, needle):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert needle in str(e.value)


def test_hang_timeout_up_to_the_share_auto_is_held_to_is_accepted():
    """The limit is CAP_SHARE x the collective timeout (issue 58, point 6): 480 s with 10 min, 48 s with 1 min."""
    assert load_config(None, ["train.hang_timeout=480"]).train.hang_timeout == "480"
    assert load_config(None, ["train.collective_timeout_minutes=1", "train.hang_timeout=48"]).train.hang_timeout == "48"
    with pytest.raises(ConfigError, match="must be at most 48s"):
        load_config(None, ["train.collective_timeout_minutes=1", "train.hang_timeout=50"])


def test_every_numeric_field_has_a_range():
    """A new int/float field without a range would let 0 or a negative value reach the code as a traceback."""
    import dataclasses
    import typing

    from finetune.config import Config, declarations

    def numeric(cls, prefix=""):  # nested sections too: model.lora.r
        hints = typing.get_type_hints(cls)
        keys = set()
        for f in dataclasses.fields(cls):
            if dataclasses.is_dataclass(hints[f.name]):
                keys |= numeric(hints[f.name], f"{prefix}{f.name}.")
            elif hints[f.name] in (int, float):
                keys.add(prefix + f.name)
        return keys
    assert sorted(k for k in numeric(Config) if not declarations()[k].get("range")) == []


# ---------------------------------------------------------------- one declaration per key (issue 45)

@dataclass
class _DataWithResponse(DataConfig):  # what a forker adds for a prompt/response format, declared
    response_field: str = key("response", "column holding the response", cache=True,
                              resume=refused("samples would come from another column"))


@dataclass
class _DataForgotten(DataConfig):  # the same field written the old way: no declaration
    response_field: str = "response"


@dataclass
class _ConfigForgotten(Config):
    data: _DataForgotten = field(default_factory=_DataForgotten)


def undecided(config_class) -> list[str]:
    """Each key of `config_class` whose declaration leaves out a decision, with what to add."""
    problems = []
    for name, d in declarations(config_class).items():
        if not isinstance(d.get("resume"), Resume):
            problems.append(f"{name}: no resume rule (key(..., resume=refused(why) or applies(what)))")
        if name.startswith("data.") and d.get("cache") not in (True, False, "files"):
            problems.append(f"{name}: no token-cache decision (key(..., cache=True, 'files' or False))")
    return problems


def test_every_key_declares_its_resume_rule_and_every_data_key_its_cache_decision():
    assert undecided(Config) == []
    assert undecided(_ConfigForgotten) == [  # the check can fail, and names the field
        "data.response_field: no resume rule (key(..., resume=refused(why) or applies(what)))",
        "data.response_field: no token-cache decision (key(..., cache=True, 'files' or False))"]


class _Tokenizer:  # what cache_key reads of a tokenizer
    chat_template = None

    def get_vocab(self):
        return {"a": 0}


def _keys(cfg_data) -> tuple[str, str]:
    return cache_key(cfg_data, _Tokenizer()), cache_key(cfg_data, _Tokenizer(), eval_set=True)


def _another_value(name: str, f, value):
    if f.metadata.get("choices"):
        return next(c for c in f.metadata["choices"] if c != value)
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value + 1
    return {"mixture": "other.jsonl:1"}.get(name, "other.jsonl")


def test_the_token_cache_key_changes_exactly_with_the_data_keys_declared_to_enter_it():
    """cache=True or "files": another value is another token cache; cache=False: the same one."""
    for f in dataclasses.fields(DataConfig):
        before = DataConfig()
        after = dataclasses.replace(before, **{f.name: _another_value(f.name, f, getattr(before, f.name))})
        assert (_keys(before) != _keys(after)) == bool(f.metadata.get("cache")), f"data.{f.name}"


def test_a_declared_new_data_field_enters_the_cache_key_so_no_stale_cache_is_reused():
    """On main, a new data.response_field was left out of cache_key's hand-kept list: a run with another column
    trained on the cache tokenized from the first. Declared with cache=True, it enters the key."""
    assert _keys(_DataWithResponse(response_field="answer")) != _keys(_DataWithResponse())
    assert _keys(_DataForgotten(response_field="answer")) == _keys(_DataForgotten())  # undeclared: the test above


def test_docs_name_exactly_the_data_keys_declared_to_enter_the_cache_key():
    """docs/data.md lists the keys of each kind (cache="files", cache=True) in its sentence about `<key>`."""
    text = open(os.path.join(ROOT, "docs", "data.md")).read()
    sentence = text[text.index("`<key>` hashes"):text.index("not seq_len or packing")]
    for kind, part in (("files", sentence.split("with each file")[0]), (True, sentence.split("chat template")[1])):
        declared = {f"data.{f.name}" for f in dataclasses.fields(DataConfig) if f.metadata.get("cache") == kind}
        assert set(re.findall(r"`(data\.[a-z_]+)`", part)) == declared, kind


def test_choices_come_from_the_registries_that_implement_them():
    from ckpt.manager import ASYNC_MODES
    from finetune.data.sources import FORMATS
    from finetune.schedule import SCHEDULES

    d = declarations()
    assert (d["train.lr_schedule"]["choices"], d["data.format"]["choices"], d["ckpt.async_mode"]["choices"]) == \
        (SCHEDULES, FORMATS, ASYNC_MODES)
    assert key("b", "doc", choices={"a": 1, "b": 2}).metadata["choices"] == ("a", "b")  # a registry dict: its names


def test_yaml_syntax_error_names_file_and_line(tmp_path):
    y = tmp_path / "broken.yaml"
    y.write_text("train:\n  max_steps: 5\n  lr: [0.1\ndata:\n  seq_len: 32\n")
    with pytest.raises(ConfigError) as e:
        load_config(str(y))
    assert str(e.value).startswith(f"config file {y} is not valid YAML at line ")


def test_yaml_syntax_error_is_one_line_and_exit_2(tmp_path, capsys):
    from train_fsdp import main
    y = tmp_path / "broken.yaml"
    y.write_text("run:\n  dir: x\n   log_interval: 3\n")
    assert main(["--config", str(y)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: config file {y} is not valid YAML at line 3"), err


def test_interval_takes_steps_or_auto():
    assert load_config(None, ["ckpt.interval=auto"]).ckpt.interval == "auto"
    assert load_config("configs/tiny.yaml").ckpt.interval == "200"


@pytest.mark.parametrize("memory_dir", ["{ckpt}", "{ckpt}/mem", "{ckpt}/../.."])
def test_a_memory_dir_inside_or_around_ckpt_dir_is_refused(tmp_path, memory_dir):
    """The memory tier removes its step folders when a run ends: it must never see the disk tier's."""
    ckpt = tmp_path / "run" / "checkpoints"
    with pytest.raises(ConfigError, match="ckpt.memory_dir=.* must be a folder apart from ckpt.dir"):
        load_config(None, [f"ckpt.dir={ckpt}", f"ckpt.memory_dir={memory_dir.format(ckpt=ckpt)}"])
    assert load_config(None, [f"ckpt.dir={ckpt}", f"ckpt.memory_dir={tmp_path / 'mem'}"]).ckpt.memory_dir

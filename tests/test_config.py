"""Config: defaults < YAML < command line, and errors that name the key.

    python -m pytest tests/test_config.py -q
"""

import pytest

from finetune.config import ConfigError, load_config


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

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


# ---------------------------------------------------------------- ranges and YAML syntax (issue 18, points 11-12)

@pytest.mark.parametrize("override,needle", [
    ("run.log_interval=0", "config key 'run.log_interval' must be >= 1, got 0"),
    ("train.lr=-1e-3", "config key 'train.lr' must be > 0, got -0.001"),
    ("train.lr=nan", "config key 'train.lr' must be > 0, got nan"),
    ("train.min_lr_ratio=1.5", "config key 'train.min_lr_ratio' must be in [0, 1], got 1.5"),
    ("train.beta2=1", "config key 'train.beta2' must be in [0, 1), got 1.0"),
    ("train.warmup_steps=-1", "config key 'train.warmup_steps' must be >= 0, got -1"),
    ("data.seq_len=1", "config key 'data.seq_len' must be >= 2, got 1"),
    ("train.collective_timeout_minutes=0", "config key 'train.collective_timeout_minutes' must be > 0"),
    ("train.hang_timeout=600", "config key 'train.hang_timeout=600' must be below train.collective_timeout_minutes "
                               "(10 min = 600s)"),
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


def test_every_numeric_field_has_a_range():
    """A new int/float field without a range would let 0 or a negative value reach the code as a traceback."""
    import dataclasses
    import typing

    from finetune.config import _RANGES, Config

    def numeric(cls, prefix=""):  # nested sections too: model.lora.r
        hints = typing.get_type_hints(cls)
        keys = set()
        for f in dataclasses.fields(cls):
            if dataclasses.is_dataclass(hints[f.name]):
                keys |= numeric(hints[f.name], f"{prefix}{f.name}.")
            elif hints[f.name] in (int, float):
                keys.add(prefix + f.name)
        return keys
    assert numeric(Config) == set(_RANGES)


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

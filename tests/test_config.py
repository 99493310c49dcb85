import dataclasses
import json

import pytest

from dmltrain.config import SECTIONS, CheckpointConfig, LoopConfig, TrainConfig
from dmltrain.config.files import load_config_file, to_yaml
from dmltrain.errors import ConfigError
from tiny import TinyOptions


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"epochs": -1}, "--epochs must be at least 1, or 0 for 10"),
        ({"batch_size": -2}, "--batch-size must be at least 1"),
        ({"lr": 0.0}, "--lr must be a positive number"),
        ({"log_every": 0}, "--log-every must be at least 1"),
        ({"num_workers": -1}, "--num-workers must be auto or a number >= 0"),
        ({"num_workers": "all"}, "--num-workers must be auto or a number >= 0"),
        ({"weight_decay": -0.1}, "--weight-decay must be a number >= 0"),
        ({"preempt_check_seconds": -1.0}, "--preempt-check-seconds must be a number >= 0"),
    ],
)
def test_validation_names_the_flag(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        TrainConfig(**kwargs)


def test_train_config_is_made_of_sections_and_reads_flat():
    config = TrainConfig(epochs=3, data_dir="/d")
    assert config.loop.epochs == 3 and config.data.data_dir == "/d"
    assert config.epochs == 3 and config.data_dir == "/d"  # flat reads, as users write them
    with pytest.raises(AttributeError):
        config.epochs = 4  # type: ignore[misc]
    with pytest.raises(AttributeError, match="no setting 'epochz'"):
        config.epochz  # noqa: B018
    names = [f.name for _, _, cls in SECTIONS for f in dataclasses.fields(cls)]
    assert len(names) == len(set(names)), "two sections share a setting name"
    assert not set(names) & {attr for attr, _, _ in SECTIONS}, "a setting named like a section"
    assert config.precision == "fp32" and config.numerics.precision == "fp32"


def test_train_config_from_sections_flat_settings_override_them():
    config = TrainConfig(
        loop=LoopConfig(epochs=5, lr=0.5), checkpoint=CheckpointConfig(keep_last=1)
    )
    assert (config.epochs, config.lr, config.keep_last) == (5, 0.5, 1)
    assert TrainConfig(loop=LoopConfig(epochs=5), epochs=7).epochs == 7
    changed = config.replace(run_dir="r", keep_last=2)
    assert (changed.run_dir, changed.keep_last, changed.epochs) == ("r", 2, 5)
    assert dataclasses.replace(config, epochs=9).loop == LoopConfig(epochs=9, lr=0.5)
    with pytest.raises(TypeError, match="unknown settings: epochz"):
        TrainConfig(epochz=1)
    with pytest.raises(TypeError, match="must be a LoopConfig"):
        TrainConfig(loop=CheckpointConfig())


def test_yaml_file_accepts_dashes_and_experiment_keys(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("epochs: 2\nbatch-size: 16\nlr: 1\nsamples: 10\nrun_dir: null\n")
    values = load_config_file(str(path), [TrainConfig, TinyOptions])
    assert values == {"epochs": 2, "batch_size": 16, "lr": 1.0, "samples": 10, "run_dir": None}
    assert isinstance(values["lr"], float)


def test_json_file(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"optimizer": "sgd", "seed": 5}))
    assert load_config_file(str(path), [TrainConfig]) == {"optimizer": "sgd", "seed": 5}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("epochz: 3\n", "unknown key 'epochz'"),
        ("epochs: three\n", "'epochs' must be of type int"),
        ("epochs: true\n", "'epochs' must be of type int"),
        ("lr: [1]\n", "'lr' must be of type float"),
        ("optimizer: rmsprop\n", "'optimizer' must be one of"),
        ("- 1\n- 2\n", "must hold a mapping"),
        ("epochs: [1\n", "cannot be parsed"),
    ],
)
def test_bad_file_names_key_and_file(tmp_path, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message) as info:
        load_config_file(str(path), [TrainConfig])
    assert str(path) in str(info.value)
    assert "\n" not in str(info.value)


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config_file(str(tmp_path / "nope.yaml"), [TrainConfig])


def test_resolved_yaml_loads_back_to_the_same_config(tmp_path):
    config = TrainConfig(epochs=7, lr=0.5, run_dir="r", num_workers=1)
    path = tmp_path / "config.yaml"
    path.write_text(to_yaml(config))
    assert "# run_dir: r  (this run's own: not loaded back by --config)" in path.read_text()
    loaded = TrainConfig(**load_config_file(str(path), [TrainConfig]))
    assert loaded == dataclasses.replace(config, run_dir=None)  # a copy starts a run of its own


NAMED = """
base: &base
  lr: 0.005
  batch_size: 16
  epochs: 2
short:
  <<: *base
  epochs: 1
"""


def test_a_file_of_named_configs_gives_one_by_its_name(tmp_path):
    """A training script's YAML of named configs with anchors and merges: --config FILE:NAME
    takes that one (merged with what it inherits); the whole file, or a name it lacks, is
    one line naming its configs (it was "unknown key 'base'")."""
    path = tmp_path / "configs.yaml"
    path.write_text(NAMED)
    classes = [TrainConfig, TinyOptions]
    assert load_config_file(f"{path}:short", classes) == {"lr": 0.005, "batch_size": 16,
                                                          "epochs": 1}  # fmt: skip
    assert load_config_file(f"{path}:base", classes)["epochs"] == 2
    with pytest.raises(ConfigError, match=r"holds named configs \(base, short\): choose one"):
        load_config_file(str(path), classes)
    with pytest.raises(ConfigError, match=r"has no config named 'long' \(it has base, short\)"):
        load_config_file(f"{path}:long", classes)

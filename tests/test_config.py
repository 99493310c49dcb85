import json

import pytest

from dmltrain.config import CONCERNS, TrainConfig, load_config_file, section, to_yaml
from dmltrain.errors import ConfigError
from tiny import TinyOptions


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"epochs": 0}, "--epochs must be at least 1"),
        ({"batch_size": -2}, "--batch-size must be at least 1"),
        ({"lr": 0.0}, "--lr must be positive"),
        ({"log_every": 0}, "--log-every must be at least 1"),
        ({"num_workers": -1}, "--num-workers must be >= 0"),
        ({"weight_decay": -0.1}, "--weight-decay must be >= 0"),
        ({"preempt_check_seconds": -1.0}, "--preempt-check-seconds must be >= 0"),
    ],
)
def test_validation_names_the_flag(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        TrainConfig(**kwargs)


def test_train_config_is_flat_union_of_concerns():
    config = TrainConfig(epochs=3, data_dir="/d")
    assert config.epochs == 3 and config.data_dir == "/d"
    names = {title: cls for title, cls in CONCERNS}
    assert section(config, names["data"]).data_dir == "/d"
    with pytest.raises(AttributeError):
        config.epochs = 4  # type: ignore[misc]


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
    path.write_text(to_yaml([(t, section(config, c)) for t, c in CONCERNS]))
    assert TrainConfig(**load_config_file(str(path), [TrainConfig])) == config

"""dmltrain from-credit: a CREDIT model.yml's training settings as a dmltrain --config file,
read back by the bundled forecast experiment (--print-config)."""

import textwrap

import pytest
import yaml
from helpers import run_cli

from dmltrain.errors import UserError
from dmltrain.tools.from_credit import convert

MODEL_YML = textwrap.dedent("""
    save_loc: /glade/work/me/wxformer
    seed: 1000
    data:
      variables: [U, V, T, Q]
      history_len: 2
      forecast_len: 2
    trainer:
      mode: fsdp
      train_batch_size: 8
      learning_rate: 1.0e-3
      epochs: 70
      num_epoch: 5
      amp: True
      use_ema: True
      ema_decay: 0.9999
      activation_checkpoint: True
      grad_max_norm: dynamic
      thread_workers: 4
      stopping_patience: 50
      use_scheduler: True
    model:
      type: crossformer
    loss:
      use_latitude_weights: True
""")


def test_a_credit_config_becomes_flags_the_forecast_experiment_reads(tmp_path):
    (tmp_path / "model.yml").write_text(MODEL_YML)
    done = run_cli("from-credit", "model.yml", "-o", "my.yml", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    text = (tmp_path / "my.yml").read_text()
    assert ("# Not converted; your experiment's to read: trainer: use_scheduler, data: "
            "variables, data: history_len, save_loc:, model:, loss:") in text  # fmt: skip
    shown = run_cli("forecast", "--config", "my.yml", "--print-config", cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    config = yaml.safe_load(shown.stdout)
    expected = {"strategy": "fsdp", "precision": "bf16", "batch_size": 8, "lr": 0.001,
                "epochs": 70, "epochs_per_job": 5, "ema_decay": 0.9999,
                "activation_checkpointing": True, "grad_clip": 0.0, "num_workers": 4,
                "early_stop_patience": 50, "seed": 1000, "rollout": "0:3"}  # fmt: skip
    assert {key: config[key] for key in expected} == expected


def test_amp_under_ddp_is_fp16_and_a_number_clips():
    settings, _ = convert({"trainer": {"mode": "ddp", "amp": True, "grad_max_norm": 1.0,
                                       "use_ema": False, "ema_decay": 0.99}})  # fmt: skip
    assert settings == {"strategy": "ddp", "precision": "fp16", "grad_clip": 1.0}
    settings, _ = convert({"parallelism": {"data": "fsdp2"}, "trainer": {"amp": True}})
    assert settings == {"precision": "bf16", "strategy": "fsdp"}


def test_what_is_not_a_credit_config_is_one_line(tmp_path):
    with pytest.raises(UserError, match="no 'trainer:' section"):
        convert({"epochs": 3})
    with pytest.raises(UserError, match="mode: 'tp' is none of"):
        convert({"trainer": {"mode": "tp"}})
    (tmp_path / "bad.yml").write_text("trainer: [")
    done = run_cli("from-credit", "bad.yml", cwd=tmp_path)
    assert done.returncode == 2 and "bad.yml cannot be read as YAML" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize(
    "given, args, said",
    [
        (b"\x89PNG\r\n\x1a\n\x00\xff", [], "model.yml cannot be read as YAML: 'utf-8' codec"),
        (b"trainer: {use_ema: true, ema_decay: fast}", [], "ema_decay: 'fast' is not a number"),
        (b"trainer: {}\ndata: {forecast_len: 2.5}", [], "forecast_len: 2.5 is not a number (a"),
        (b"trainer: {}", ["-o", "missing/my.yml"], "the folder missing does not exist"),
        (b"trainer: {}", ["-o", "."], "-o . is a folder; name a file"),
        (b"trainer: {}", ["-o", "model.yml", "--force"], "is the CREDIT config itself"),
        (b"trainer: {}", ["-o", "mine.yml"], "-o mine.yml exists; add --force"),
    ],
)
def test_bad_files_values_and_outputs_are_one_line(tmp_path, given, args, said):
    (tmp_path / "model.yml").write_bytes(given)
    (tmp_path / "mine.yml").write_text("# the user's own\n")
    done = run_cli("from-credit", "model.yml", *args, cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert said in done.stderr and "Traceback" not in done.stderr
    assert (tmp_path / "model.yml").read_bytes() == given
    assert (tmp_path / "mine.yml").read_text() == "# the user's own\n"

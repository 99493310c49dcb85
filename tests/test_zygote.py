"""The tests' zygote (tests/zygote.py): a run forked from it is what a fresh
``python -m dmltrain`` gives, and it never stands in where it cannot."""

import subprocess

import pytest
from helpers import (
    ROOT,
    TINY_RUN,
    assert_same_mnist,
    assert_same_run,
    cli_env,
    readme_experiment,
    run_fresh,
)
from zygote import Zygote


@pytest.fixture(scope="module")
def zygote():
    return Zygote(cli_env(), ROOT)


def test_a_forked_run_trains_as_a_fresh_one(zygote, tmp_path):
    forked = zygote.run([*TINY_RUN, "--run-dir", "forked"], tmp_path, cli_env(), timeout=300)
    assert forked is not None and forked.returncode == 0, forked and forked.stderr
    new = run_fresh([*TINY_RUN, "--run-dir", "fresh"], tmp_path, cli_env())
    assert new.returncode == 0, new.stderr
    assert_same_run(tmp_path / "forked", tmp_path / "fresh")


def test_a_forked_mnist_run_ends_bitwise_as_a_fresh_one(zygote, tmp_path):
    """The bundled CNN, with its dropout and its multi-threaded convolutions: the forked
    run draws the same numbers and computes with the same threads."""
    args = ["mnist", "--no-download", "--max-steps", "12", "--progress", "off"]
    forked = zygote.run([*args, "--run-dir", "forked"], tmp_path, cli_env(), timeout=600)
    assert forked is not None and forked.returncode == 0, forked and forked.stderr
    new = run_fresh([*args, "--run-dir", "fresh"], tmp_path, cli_env(), timeout=600)
    assert new.returncode == 0, new.stderr
    assert_same_mnist(tmp_path / "forked", tmp_path / "fresh")


def test_the_working_directory_its_files_and_the_output_are_the_runs(zygote, tmp_path):
    """A file experiment in the working directory imports as under ``python -m``; its error
    output and exit status are the same to the letter."""
    readme_experiment(tmp_path)
    for args in (["my_experiment.py", "--epochs", "-1"], ["tiny", "--no-such-flag"]):
        forked = zygote.run(args, tmp_path, cli_env(), timeout=300)
        new = run_fresh(args, tmp_path, cli_env())
        assert forked is not None
        assert (forked.returncode, forked.stdout, forked.stderr) == (
            new.returncode, new.stdout, new.stderr), args  # fmt: skip
        assert forked.returncode == 2


def test_a_run_past_its_timeout_is_killed(zygote, tmp_path):
    with pytest.raises(subprocess.TimeoutExpired) as timed_out:
        zygote.run(["tiny", "--epochs", "100000", "--run-dir", "r"], tmp_path, cli_env(), 5)
    assert "epoch 1/100000" in timed_out.value.stdout
    children = subprocess.run(["pgrep", "-P", str(zygote.proc.pid)], capture_output=True)
    assert children.stdout == b"", "the run outlived its timeout"
    # the zygote serves the next run
    done = zygote.run(["tiny", "--max-steps", "1", "--run-dir", "s"], tmp_path, cli_env(), 300)
    assert done is not None and done.returncode == 0, done and done.stderr


def test_another_environment_gets_a_fresh_interpreter(zygote, tmp_path):
    assert zygote.run(["--help"], tmp_path, cli_env(OMP_NUM_THREADS="1"), 300) is None

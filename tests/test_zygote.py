"""The tests' zygote (tests/zygote.py): a run forked from it is what a fresh
``python -m dmltrain`` gives, and it never stands in where it cannot."""

import subprocess
import sys

import pytest
from helpers import ROOT, TINY_RUN, assert_same_run, cli_env, readme_experiment
from zygote import Zygote


@pytest.fixture(scope="module")
def zygote():
    return Zygote(cli_env(), ROOT)


def fresh(*args: str, cwd) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "dmltrain", *args]
    return subprocess.run(command, cwd=cwd, env=cli_env(), capture_output=True, text=True)


def test_a_forked_run_trains_as_a_fresh_one(zygote, tmp_path):
    forked = zygote.run([*TINY_RUN, "--run-dir", "forked"], tmp_path, cli_env(), timeout=300)
    assert forked is not None and forked.returncode == 0, forked and forked.stderr
    new = fresh(*TINY_RUN, "--run-dir", "fresh", cwd=tmp_path)
    assert new.returncode == 0, new.stderr
    assert_same_run(tmp_path / "forked", tmp_path / "fresh")


def test_the_working_directory_its_files_and_the_output_are_the_runs(zygote, tmp_path):
    """A file experiment in the working directory imports as under ``python -m``; its error
    output and exit status are the same to the letter."""
    readme_experiment(tmp_path)
    for args in (["my_experiment.py", "--epochs", "0"], ["tiny", "--no-such-flag"]):
        forked = zygote.run(args, tmp_path, cli_env(), timeout=300)
        new = fresh(*args, cwd=tmp_path)
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

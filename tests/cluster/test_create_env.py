"""environment/create_env.sh for real, on its venv path (no conda here: its channels are
out of reach from this machine): create a venv, train MNIST in it, run horovodrun -np 2 in
it, break it and repair it by running the script again."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ROOT, own_port, require

SCRIPT = str(ROOT / "environment" / "create_env.sh")
# The sample MNIST shipped with dmltrain, without a download attempt (no network here).
MNIST = ["mnist", "--epochs", "1", "--no-download", "--progress", "log"]


def clean_env(**extra: str) -> dict[str, str]:
    """This machine's environment without the test suite's PYTHONPATH or any venv."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["CUDA_VISIBLE_DEVICES"] = ""
    env.update(extra)
    return env


def create(name: str, cwd: Path, *options: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", SCRIPT, *options, name],
        cwd=cwd,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=1200,
    )


@pytest.fixture(scope="module")
def venv(tmp_path_factory):
    require("mpicc")
    cwd = tmp_path_factory.mktemp("create_env")
    done = create("myenv", cwd, "--venv", "--python", sys.executable)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "dmltrain doctor: all required checks passed" in done.stdout
    assert "create_env.sh: done in" in done.stdout
    assert (cwd / "create_env-myenv.log").stat().st_size > 0
    return cwd / "myenv"


def run_in(venv: Path, *command: str, cwd: Path) -> subprocess.CompletedProcess:
    env = clean_env(PATH=f"{venv / 'bin'}{os.pathsep}{os.environ['PATH']}", VIRTUAL_ENV=str(venv),
                    **own_port())  # fmt: skip
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def test_help_and_bad_options(tmp_path):
    done = subprocess.run(["bash", SCRIPT, "--help"], capture_output=True, text=True)
    assert done.returncode == 0 and "usage: bash environment/create_env.sh" in done.stdout
    done = subprocess.run(["bash", SCRIPT, "--bogus", "x"], capture_output=True, text=True)
    assert done.returncode == 2 and "unknown option --bogus" in done.stderr


def test_an_existing_directory_not_made_by_the_script_is_left_alone(tmp_path):
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "data.txt").write_text("keep me")
    done = create("taken", tmp_path, "--venv")
    assert done.returncode == 1
    assert "taken exists and is not a venv made by this script" in done.stderr
    assert (tmp_path / "taken" / "data.txt").read_text() == "keep me"
    assert sorted(p.name for p in (tmp_path / "taken").iterdir()) == ["data.txt"]


def test_the_venv_trains_mnist(venv, tmp_path):
    done = run_in(venv, "dmltrain", *MNIST, "--run-dir", "run", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (
        str(venv)
        in run_in(venv, "python", "-c", "import torch; print(torch.__file__)", cwd=tmp_path).stdout
    )
    assert (tmp_path / "run" / "training_log.csv").read_text().count("\n") == 2


def test_a_users_own_experiments_package_and_dmltrains_live_side_by_side(venv, tmp_path):
    """A project of the user's that installs a package named ``experiments``, into the
    venv beside dmltrain (whose bundled ones install as ``dmltrain_experiments``): each
    imports its own."""
    project = tmp_path / "project"
    (project / "experiments").mkdir(parents=True)
    (project / "experiments" / "__init__.py").write_text("WHOSE = 'the user'\n")
    (project / "setup.py").write_text(
        "from setuptools import setup\n"
        "setup(name='user-project', version='1', packages=['experiments'])\n"
    )
    pip = run_in(venv, "python", "-m", "pip", "install", "--no-build-isolation", "--no-deps",
                 str(project), cwd=tmp_path)  # fmt: skip
    assert pip.returncode == 0, pip.stdout[-2000:] + pip.stderr[-2000:]
    work = tmp_path / "work"
    work.mkdir()
    mine = run_in(venv, "python", "-c", "import experiments; print(experiments.WHOSE)", cwd=work)
    assert mine.stdout.strip() == "the user", mine.stderr[-2000:]
    done = run_in(venv, "dmltrain", *MNIST, "--max-steps", "3", "--run-dir", "run", cwd=work)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (work / "run" / "training_log.csv").read_text().count("\n") == 2


def test_the_venv_runs_horovodrun_with_two_processes(venv, tmp_path):
    done = run_in(
        venv,
        "horovodrun",
        "--gloo",
        "-np",
        "2",
        "-H",
        "localhost:2",
        "dmltrain",
        *MNIST,
        "--run-dir",
        "run",
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "2 process(es), launcher horovod, strategy horovod" in done.stdout + done.stderr
    assert (tmp_path / "run" / "training_log.csv").is_file()


def test_running_it_again_repairs_the_venv(venv):
    """Horovod removed from the venv comes back; what is there stays."""
    subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "uninstall", "-y", "horovod"],
        check=True,
        capture_output=True,
    )
    done = create(str(venv), venv.parent, "--venv")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "creating venv" not in done.stdout  # the venv was kept
    check = run_in(venv, "python", "-c", "import horovod.torch", cwd=venv.parent)
    assert check.returncode == 0, check.stderr

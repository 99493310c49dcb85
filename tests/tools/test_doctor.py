"""``dmltrain doctor`` on this machine (CPU, Gloo, Horovod built by tests/run.sh), with a
missing component, and inside a real 2-task Slurm job step."""

import os
import re
import subprocess

import pytest
import torch
from helpers import cli_env, run_cli


def row(output: str, name: str) -> str:
    return next(line for line in output.splitlines() if line.startswith(name + " "))


def test_doctor_passes_here(tmp_path):
    done = run_cli("doctor", "--horovod", cwd=tmp_path, WANDB_API_KEY="0" * 40)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "PASS" in row(done.stdout, "Gloo backend")
    gloo = row(done.stdout, "gloo all-reduce")
    assert "PASS" in gloo and "2 processes on this node: sum 3 (expected 3)" in gloo
    horovod = row(done.stdout, "Horovod")
    assert "PASS" in horovod and "framework PyTorch" in horovod and "gloo" in horovod
    assert "sum 3 (expected 3)" in row(done.stdout, "horovod all-reduce")
    assert re.search(r"[\d.]+ s from this process's start to here", row(done.stdout, "start-up"))
    assert "logged in" in row(done.stdout, "wandb") and "not logged" not in done.stdout
    assert done.stdout.strip().endswith("all required checks passed")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present")
def test_a_missing_gpu_is_reported_with_its_fix(tmp_path):
    plain = run_cli("doctor", cwd=tmp_path)
    assert plain.returncode == 0  # not required unless asked for
    assert "MISSING" in row(plain.stdout, "CUDA") and "MISSING" in row(plain.stdout, "NCCL backend")
    done = run_cli("doctor", "--gpu", cwd=tmp_path)
    assert done.returncode == 1
    assert "FAIL" in row(done.stdout, "CUDA") and "FAIL" in row(done.stdout, "NCCL backend")
    lines = done.stdout.splitlines()
    fix = lines[lines.index(row(done.stdout, "CUDA")) + 1]
    assert "fix:" in fix and "CUDA build of torch" in fix
    assert "FAILED: CUDA, NCCL backend" in done.stdout


def test_a_missing_horovod_is_reported(tmp_path):
    """The stand-in: a ``horovod`` package that fails to import, as a missing one does."""
    fake = tmp_path / "nohorovod" / "horovod"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError(\"No module named 'horovod'\")\n")
    path = os.pathsep.join([str(fake.parent), cli_env()["PYTHONPATH"]])
    done = run_cli("doctor", "--horovod", cwd=tmp_path, PYTHONPATH=path)
    assert done.returncode == 1
    assert "FAIL" in row(done.stdout, "Horovod")
    assert "pip install 'dmltrain[horovod]'" in done.stdout


def test_doctor_checks_all_tasks_of_a_slurm_job_step(tmp_path, slurm):
    out = tmp_path / "doctor.out"
    submitted = subprocess.run(
        ["sbatch", "--parsable", "--wait", "--ntasks", "2", "--cpus-per-task", "1", "--time",
         "5", "--output", str(out), "--wrap", "srun python -m dmltrain doctor"],
        cwd=tmp_path, env=cli_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    text = out.read_text() if out.exists() else ""
    assert submitted.returncode == 0, submitted.stderr + text
    assert text.count("dmltrain doctor on") == 1  # rank 0 prints
    assert "(2 processes)" in text
    assert "2 processes: sum 3 (expected 3)" in row(text, "gloo all-reduce")
    assert re.search(r"slowest node \S+ [\d.]+ s, fastest \S+ [\d.]+ s, over 1 node ",
                     row(text, "start-up"))  # fmt: skip

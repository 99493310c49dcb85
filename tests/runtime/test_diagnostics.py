"""Startup diagnostics of real 1- and 2-process runs: diagnostics.json and the printed block."""

import json
import subprocess

import helpers
import pytest
import torch
from helpers import ROOT, run_cli

TINY = [*helpers.TINY, "--epochs", "1", "--batch-size", "16"]


def git(*args):
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True)


@pytest.mark.parametrize("nprocs", [1, 2])
def test_diagnostics_json_and_block(tmp_path, nprocs):
    run = tmp_path / "run"
    secrets = {"WANDB_API_KEY": "s3cret-wandb", "NCCL_IB_SECRET_TOKEN": "s3cret-nccl"}
    done = run_cli(*TINY, "--nprocs", str(nprocs), "--run-dir", str(run), cwd=tmp_path,
                   NCCL_DEBUG="WARN", **secrets)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    text = (run / "diagnostics.json").read_text()
    assert "s3cret" not in text
    info = json.loads(text)
    assert info["world_size"] == nprocs
    assert [r["rank"] for r in info["ranks"]] == list(range(nprocs))
    assert all(r["host"] and r["device"] == "cpu" for r in info["ranks"])
    expected = ("single", "single", "none") if nprocs == 1 else ("spawn", "ddp", "gloo")
    assert (info["launcher"], info["strategy"], info["backend"]) == expected
    assert info["versions"]["torch"] == torch.__version__
    assert info["versions"]["python"] and info["versions"]["dmltrain"]
    assert info["command"][:4] == ["python", "-m", "dmltrain", "tiny"]
    assert info["config"]["train"]["nprocs"] == nprocs
    env = info["environment"]
    assert env["NCCL_DEBUG"] == "WARN"
    assert env["WANDB_API_KEY"] == "<redacted>" and env["NCCL_IB_SECRET_TOKEN"] == "<redacted>"
    # the experiment's code: tests/tiny.py, in this checkout
    head = git("rev-parse", "HEAD")
    if head.returncode == 0:
        assert info["code"]["commit"] == head.stdout.strip()
        assert info["code"]["dirty"] == bool(git("status", "--porcelain").stdout.strip())
    # the printed block, once
    assert done.stdout.count(f"dmltrain: {nprocs} process(es), launcher") == 1
    assert f"details in {run / 'diagnostics.json'}" in done.stdout

"""``dmltrain export``: what it refuses (its LoRA merge is proven in
tests/engine/test_finetuning.py, on the runs that make adapters)."""

import pytest
from helpers import TINY, run_cli


def _fails(done):
    assert done.returncode == 2, done.stdout + done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    return lines[0]


@pytest.mark.quick
def test_bad_export_input_is_one_line(tmp_path):
    assert "does not exist" in _fails(run_cli("export", str(tmp_path / "nope"), cwd=tmp_path))
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    assert "has no latest checkpoint yet" in _fails(run_cli("export", str(run), cwd=tmp_path))
    assert run_cli(*TINY, "--epochs", "1", "--run-dir", str(run), cwd=tmp_path).returncode == 0
    said = _fails(run_cli("export", str(run), "--merge-lora", cwd=tmp_path))
    assert "this run has no LoRA adapters" in said
    done = run_cli("export", str(run), "--best", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert f"wrote {run / 'model.safetensors'} (4 tensors from" in done.stdout

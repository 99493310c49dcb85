"""--compile: the repeated blocks compiled one by one, and the compiled code kept in the
run directory for the next job (real torch.compile on the CPU)."""

import torch
from helpers import TESTS, run_cli
from torch import nn

from dmltrain.checkpoint.storage import list_checkpoints, load_file
from dmltrain.engine.compiling import CACHE, regions
from dmltrain_experiments.mnist import Net


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.linear(x)) + x


class Tower(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 4)
        self.blocks = nn.ModuleList([Block() for _ in range(3)])
        self.head = nn.Linear(4, 1)


def test_regions_are_the_repeated_blocks_of_the_experiments_own_class():
    tower = Tower()
    assert regions(tower) == list(tower.blocks)
    assert regions(nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))) == []
    assert regions(Net()) == []  # the MNIST CNN: compiled whole


def test_blocks_compile_in_place_and_the_next_job_loads_the_compiled_code(tmp_path):
    run = tmp_path / "run"
    args = ["tiny", "--blocks", "--features", "8", "--compile", "--batch-size", "8",
            "--progress", "off", "--run-dir", str(run)]  # fmt: skip
    first = run_cli(*args, "--epochs", "1", cwd=TESTS)
    assert first.returncode == 0, first.stderr[-2000:]
    assert "--compile: 2 Block blocks, one by one" in first.stdout
    assert (run / CACHE).stat().st_size > 0
    # compiled in place: the checkpoint's names are the plain model's
    names = list(load_file(list_checkpoints(run / "checkpoints")[0])["model"])
    assert names and not any("_orig_mod" in name for name in names), names
    second = run_cli(*args, "--epochs", "2", cwd=TESTS)
    assert second.returncode == 0, second.stderr[-2000:]
    assert "loaded the compiled code of an earlier job" in second.stdout

"""A sharded checkpoint is data: a command planted in its index (``.metadata``) or in one of
its shards' items runs at no entry point that reads it."""

import os
import pickle
import shutil
from pathlib import Path

import pytest
from helpers import TINY, run_cli
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.state_dict_saver import _save_state_dict

from dmltrain.checkpoint import storage

FSDP = [*TINY, "--epochs", "1", "--nprocs", "2", "--strategy", "fsdp"]


class Planted:
    """Unpickled, it runs ``touch PATH``: what a crafted file would do."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A 2-process FSDP run with two sharded checkpoints."""
    run = tmp_path_factory.mktemp("sharded") / "run"
    done = run_cli(*FSDP, "--checkpoint-every-steps", "4", "--run-dir", str(run), cwd=run.parent)
    assert done.returncode == 0, done.stderr[-3000:]
    return run


def plant_in_index(checkpoint: Path, mark: Path) -> None:
    (checkpoint / ".metadata").write_bytes(pickle.dumps(Planted(mark)))


def plant_in_an_item(checkpoint: Path, mark: Path) -> None:
    """The checkpoint's shards written again with one optimizer value (a learning rate,
    read with the optimizer at a resume) that runs ``touch`` when unpickled."""
    state = storage.read_whole(checkpoint)
    shards = {"model": state["model"], "optimizer": state["optimizer"]}
    shards["optimizer"]["param_groups"][0]["lr"] = Planted(mark)
    for shard in checkpoint.glob("*.distcp"):
        shard.unlink()
    _save_state_dict(shards, FileSystemWriter(str(checkpoint), overwrite=True), no_dist=True)


# Each way a sharded checkpoint is read: the command, given the crafted checkpoint's path.
ENTRY_POINTS = {
    "load-weights": lambda ck: [*TINY, "--epochs", "1", "--load-weights", ck],
    "resume": lambda ck: [*FSDP, "--resume", ck],
    "evaluate": lambda ck: ["tiny", "--evaluate", ck],
    "consolidate": lambda ck: ["consolidate", ck],
    "export": lambda ck: ["export", ck],
}


def enter(entry: str, checkpoint: Path, where: Path):
    args = ENTRY_POINTS[entry](str(checkpoint))
    if args[0] == "tiny":  # a run of its own
        args += ["--run-dir", str(where / "new")]
    return run_cli(*args, cwd=where)


@pytest.mark.parametrize("entry", [*ENTRY_POINTS, "automatic-resume"])
def test_a_command_planted_in_the_index_never_runs(run, tmp_path, entry):
    copy = tmp_path / "run"
    shutil.copytree(run, copy, symlinks=True)
    newest = storage.list_checkpoints(copy / "checkpoints")[0]
    mark = tmp_path / "PLANTED-RAN"
    plant_in_index(newest, mark)
    if entry == "automatic-resume":  # the newest is refused; the run goes on from the one before
        done = run_cli(*FSDP, "--epochs", "2", "--run-dir", str(copy), cwd=tmp_path)
        assert done.returncode == 0, done.stderr[-3000:]
        assert f"{newest.name}/.metadata is not a checkpoint's index" in done.stderr
        assert "falling back to the previous checkpoint" in done.stderr
    else:
        done = enter(entry, newest, tmp_path)
        assert done.returncode == 2, done.stderr[-3000:]
        (line,) = [line for line in done.stderr.splitlines() if "error" in line]
        assert f"{newest}/.metadata is not a checkpoint's index: it asks to run posix" in line
        assert "Traceback" not in done.stderr
    assert not mark.exists()


@pytest.mark.parametrize("entry", ["resume", "consolidate"])
def test_a_command_planted_in_a_shards_item_never_runs(run, tmp_path, entry):
    """The two ways shards are read: into the run's own state (a resume), and whole into
    one process (consolidate, export, --load-weights)."""
    checkpoint = tmp_path / "ckpt.dcp"
    shutil.copytree(run / "checkpoints" / "latest.dcp", checkpoint)
    mark = tmp_path / "PLANTED-RAN"
    plant_in_an_item(checkpoint, mark)
    done = enter(entry, checkpoint, tmp_path)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "item 'optimizer.param_groups.0.lr' holds more than plain values" in done.stderr
    assert "Traceback" not in done.stderr
    assert not mark.exists()


def test_an_index_naming_a_shard_outside_its_folder_is_refused(run, tmp_path):
    checkpoint = tmp_path / "ckpt.dcp"
    shutil.copytree(run / "checkpoints" / "latest.dcp", checkpoint)
    index = storage.read_index(checkpoint)
    for info in index.storage_data.values():
        info.relative_path = "../../outside"
    (checkpoint / ".metadata").write_bytes(pickle.dumps(index))
    with pytest.raises(storage.UserError, match="names a shard outside its folder"):
        storage.read_index(checkpoint)


def test_a_sharded_checkpoint_still_reads_whole(run, tmp_path):
    """What DCP writes passes the allow-list: every tensor and plain value comes back."""
    state = storage.read_whole(run / "checkpoints" / "latest.dcp")
    assert state["model"] and state["optimizer"]["param_groups"][0]["lr"] == 0.001

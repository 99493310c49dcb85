"""The node-local tier (dmltrain/checkpoint/tiers.py, --local-checkpoint-dir): checkpoints
written to a local folder and drained to the run directory in the background, with real
files and real mounts. The run directory's checkpoint folder is made read-only with a
bind mount (root, as in CI), so that a drain fails and waits; the process is then killed
(SIGKILL) with a checkpoint still draining.

A run through the tier trains bit for bit as one without it and leaves its local folder
empty. A job killed while a checkpoint drains resumes from the newest durable one, bitwise,
saying in one line that the draining one was lost with its node; on the same node, the
next job drains the local copy first. A local folder that is full makes checkpoints go
straight to the run directory, in one line."""

import os
import shutil
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
from helpers import RANDOM, REQUIRE_ALL, TINY, assert_same_run, cli_env, run_cli

from dmltrain.checkpoint.tiers import local_folder

ARGS = [*TINY, *RANDOM, "--checkpoint-every-steps", "4"]


@contextmanager
def read_only(folder: Path):
    """``folder`` read-only (a bind mount over itself) inside the block."""
    mounted = subprocess.run(["mount", "--bind", str(folder), str(folder)], capture_output=True)
    if mounted.returncode != 0:
        message = f"cannot bind-mount here: {mounted.stderr.decode().strip()}"
        if REQUIRE_ALL:  # CI: root, as the test cluster needs
            pytest.fail(message)
        pytest.skip(message)
    try:
        subprocess.run(["mount", "-o", "remount,ro,bind", str(folder)], check=True)
        yield
    finally:
        subprocess.run(["umount", str(folder)], check=True)


def killed_while_draining(
    tmp_path: Path, run: Path, local: Path, kill: bool = True, args: list[str] = ARGS
) -> str:
    """A run through the tier whose checkpoint folder turns read-only once its first
    checkpoint is durable; killed (SIGKILL, every process of it) once the next one is
    draining (else the folder turns writable again and the run goes on to its end). Its
    stderr."""
    command = [sys.executable, "-m", "dmltrain", *args, "--step-sleep", "0.05",
               "--local-checkpoint-dir", str(local), "--run-dir", str(run)]  # fmt: skip
    latest = "latest.dcp" if "fsdp" in args else "latest.pt"
    errors = tmp_path / "stderr.txt"
    with open(errors, "w") as err:
        process = subprocess.Popen(command, cwd=tmp_path, env=cli_env(), stderr=err,
                                   stdout=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
        try:
            deadline = time.monotonic() + 120
            while not (run / "checkpoints" / latest).exists():
                assert time.monotonic() < deadline and process.poll() is None
                time.sleep(0.01)
            durable = f".draining-{(run / 'checkpoints' / latest).resolve().name}"
            with read_only(run / "checkpoints"):
                # a drain in flight: a rank's failed copy said, and rank 0's mark of it
                # written (another rank may say its failure before rank 0 marks the drain)
                while "retrying" not in errors.read_text() or not [
                    m for m in run.glob(".draining-*") if m.name != durable
                ]:
                    assert time.monotonic() < deadline and process.poll() is None
                    time.sleep(0.05)
                if kill:
                    os.killpg(process.pid, signal.SIGKILL)
                    assert process.wait(30) == -signal.SIGKILL
            assert process.wait(120) == (-signal.SIGKILL if kill else 0)
        finally:
            process.kill()
            process.wait()
    return errors.read_text()


def test_the_tier_trains_as_the_run_directory_alone_and_leaves_nothing_local(tmp_path):
    plain = run_cli(*ARGS, "--run-dir", "plain", cwd=tmp_path)
    assert plain.returncode == 0, plain.stderr[-3000:]
    tiered = run_cli(*ARGS, "--local-checkpoint-dir", "local", "--run-dir", "tiered",
                     cwd=tmp_path)  # fmt: skip
    assert tiered.returncode == 0, tiered.stderr[-3000:]
    assert_same_run(tmp_path / "plain", tmp_path / "tiered")
    names = sorted(p.name for p in (tmp_path / "tiered" / "checkpoints").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "plain" / "checkpoints").iterdir())
    assert (tmp_path / "tiered/checkpoints/latest.pt").resolve().name == "ckpt-000003-00000036.pt"
    folder = local_folder(tmp_path / "local", tmp_path / "tiered")
    assert folder.is_dir() and not list(folder.iterdir())  # only what still drains
    assert not list((tmp_path / "tiered").glob(".draining-*"))


def test_a_drain_that_fails_is_said_and_retried_until_it_is_durable(tmp_path):
    whole = run_cli(*ARGS, "--run-dir", "whole", cwd=tmp_path)
    assert whole.returncode == 0, whole.stderr[-3000:]
    run, local = tmp_path / "run", tmp_path / "local"
    said = killed_while_draining(tmp_path, run, local, kill=False)
    assert said.count("(Read-only file system); retrying") == 1, said[-3000:]
    assert "WARNING: checkpoint ckpt-000001-00000008.pt drained to" in said, said[-3000:]
    assert (run / "checkpoints" / "latest.pt").resolve().name == "ckpt-000003-00000036.pt"
    assert not list(local_folder(local, run).iterdir())
    assert_same_run(tmp_path / "whole", run)


def test_a_node_lost_while_a_checkpoint_drains_resumes_from_the_last_durable_one(tmp_path):
    whole = run_cli(*ARGS, "--run-dir", "whole", cwd=tmp_path)
    assert whole.returncode == 0, whole.stderr[-3000:]
    run, local = tmp_path / "run", tmp_path / "local"
    said = killed_while_draining(tmp_path, run, local)
    (line,) = [x for x in said.splitlines() if "retrying" in x]
    assert "draining checkpoint ckpt-000001-00000008.pt from" in line, line
    assert "(Read-only file system); retrying; the newest durable one is" in line, line
    durable = (run / "checkpoints" / "latest.pt").resolve().name
    assert durable == "ckpt-000001-00000004.pt"
    shutil.rmtree(local)  # the node and its local folder are gone
    again = run_cli(*ARGS, "--local-checkpoint-dir", str(local), "--run-dir", str(run),
                    cwd=tmp_path)  # fmt: skip
    assert again.returncode == 0, again.stderr[-3000:]
    lost = [x for x in again.stderr.splitlines() if "is lost with that node" in x]
    assert lost == [
        f"WARNING: checkpoint ckpt-000001-00000008.pt was still draining from "
        f"{os.uname().nodename}'s local folder when the last job ended and is lost with that "
        "node; going on from the newest durable one, ckpt-000001-00000004.pt"
    ], again.stderr[-3000:]
    assert f"resuming from {run}/checkpoints/ckpt-000001-00000004.pt" in again.stdout
    assert_same_run(tmp_path / "whole", run)


def test_on_the_same_node_the_next_job_drains_what_was_left_and_goes_on_from_it(tmp_path):
    whole = run_cli(*ARGS, "--run-dir", "whole", cwd=tmp_path)
    assert whole.returncode == 0, whole.stderr[-3000:]
    run, local = tmp_path / "run", tmp_path / "local"
    killed_while_draining(tmp_path, run, local)
    left = sorted(p.name.rsplit(".", 1)[0] for p in local_folder(local, run).iterdir())
    assert left and left[0] == "ckpt-000001-00000008.pt", left
    again = run_cli(*ARGS, "--local-checkpoint-dir", str(local), "--run-dir", str(run),
                    cwd=tmp_path)  # fmt: skip
    assert again.returncode == 0, again.stderr[-3000:]
    assert "is lost" not in again.stderr
    assert f"resuming from {run}/checkpoints/{left[-1]}" in again.stdout
    assert_same_run(tmp_path / "whole", run)


def test_a_full_local_folder_writes_straight_to_the_run_directory(tmp_path, small_disk):
    plain = run_cli(*ARGS, "--run-dir", "plain", cwd=tmp_path)
    assert plain.returncode == 0, plain.stderr[-3000:]
    with open(small_disk / "filler", "wb") as filler:  # the node's local disk, full
        os.posix_fallocate(filler.fileno(), 0, os.statvfs(small_disk).f_bavail * 4096 - 4096)
    tiered = run_cli(*ARGS, "--local-checkpoint-dir", str(small_disk), "--run-dir", "tiered",
                     cwd=tmp_path)  # fmt: skip
    assert tiered.returncode == 0, tiered.stderr[-3000:]
    full = [x for x in tiered.stderr.splitlines() if "checkpoints go straight to" in x]
    assert len(full) == 1, tiered.stderr[-3000:]
    assert "no space left" in full[0] and "until the local checkpoint folder can take them" \
        in full[0], full  # fmt: skip
    assert_same_run(tmp_path / "plain", tmp_path / "tiered")


FSDP = [*ARGS, "--nprocs", "2", "--strategy", "fsdp"]  # 6 steps an epoch


def test_sharded_checkpoints_drain_each_ranks_shards_and_a_lost_one_is_said(tmp_path):
    """FSDP on 2 processes: each rank writes its shards to its local folder and drains
    them; rank 0 publishes once both are in. A run killed while the epoch's checkpoint
    (step 6) drains says, when started again, that it is lost, and resumes from step 4's;
    both end bitwise equal to a run with no tier."""
    whole = run_cli(*FSDP, "--run-dir", "whole", cwd=tmp_path)
    assert whole.returncode == 0, whole.stderr[-3000:]
    through = run_cli(*FSDP, "--local-checkpoint-dir", "local", "--run-dir", "through",
                      cwd=tmp_path)  # fmt: skip
    assert through.returncode == 0, through.stderr[-3000:]
    assert_same_run(tmp_path / "whole", tmp_path / "through")
    latest = (tmp_path / "through" / "checkpoints" / "latest.dcp").resolve()
    assert sorted(p.name for p in latest.iterdir()) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp", "trainer.pt"]  # fmt: skip
    assert not [p for p in (tmp_path / "local").rglob("*") if p.is_file()]
    run, local = tmp_path / "run", tmp_path / "local-killed"
    said = killed_while_draining(tmp_path, run, local, args=FSDP)
    assert "draining checkpoint ckpt-000001-00000006.dcp from" in said, said[-3000:]
    assert (run / "checkpoints" / "latest.dcp").resolve().name == "ckpt-000001-00000004.dcp"
    shutil.rmtree(local)  # the nodes' local folders are gone
    again = run_cli(*FSDP, "--local-checkpoint-dir", str(local), "--run-dir", str(run),
                    cwd=tmp_path)  # fmt: skip
    assert again.returncode == 0, again.stderr[-3000:]
    assert (
        "WARNING: checkpoint ckpt-000001-00000006.dcp was still draining from the ranks' local "
        "folders when the last job ended (parts in from rank(s) none) and is lost; going on "
        "from the newest durable one, ckpt-000001-00000004.dcp"
    ) in again.stderr, again.stderr[-3000:]
    assert "resuming from" in again.stdout and "ckpt-000001-00000004.dcp" in again.stdout
    assert_same_run(tmp_path / "whole", run)
    assert not list((run / "checkpoints").glob(".*"))  # no gathering folder left


def test_a_torn_or_crafted_mark_loses_no_local_copy_and_moves_no_other_file(tmp_path):
    """A mark left empty (a full shared folder tore its write) still lets the next job on
    the node drain the local copy; a crafted mark pointing at another file moves nothing,
    and one naming no checkpoint is removed, said."""
    whole = run_cli(*ARGS, "--run-dir", "whole", cwd=tmp_path)
    assert whole.returncode == 0, whole.stderr[-3000:]
    run, local = tmp_path / "run", tmp_path / "local"
    killed_while_draining(tmp_path, run, local)
    (run / ".draining-ckpt-000001-00000008.pt").write_text("")  # torn
    victim = tmp_path / "victim.pt"
    victim.write_bytes(b"someone else's file")
    crafted = run / ".draining-ckpt-000002-00000020.pt"
    crafted.write_text(f'{{"host": "x", "local": "{victim}"}}')
    (run / ".draining-notes").write_text("{")
    again = run_cli(*ARGS, "--local-checkpoint-dir", str(local), "--run-dir", str(run),
                    cwd=tmp_path)  # fmt: skip
    assert again.returncode == 0, again.stderr[-3000:]
    assert victim.read_bytes() == b"someone else's file"
    assert not (run / "checkpoints" / "ckpt-000002-00000020.pt").exists()
    assert f"{run}/.draining-notes names no checkpoint ('notes'); removed" in again.stderr
    assert "ckpt-000001-00000008.pt was still draining" not in again.stderr
    assert f"resuming from {run}/checkpoints/ckpt-000001-00000008.pt" in again.stdout
    assert not list(run.glob(".draining-*"))
    assert_same_run(tmp_path / "whole", run)


def test_a_run_ending_with_checkpoints_only_on_the_local_disk_fails_saying_so(
    tmp_path, monkeypatch
):
    """The shared folder stays read-only to the end: the job does not say "done" (exit
    status 2, its line names the local folder), and the local copies stay."""
    from dmltrain import TrainConfig, UserError
    from dmltrain.checkpoint import tiers
    from tiny import TinyOptions, TinyTrainer

    monkeypatch.setattr(tiers, "SETTLE_SECONDS", 1.0)  # not 5 minutes of retries
    run, local = tmp_path / "run", tmp_path / "local"
    (run / "checkpoints").mkdir(parents=True)
    config = TrainConfig(run_dir=str(run), epochs=1, batch_size=16, progress="off",
                         local_checkpoint_dir=str(local))  # fmt: skip
    with read_only(run / "checkpoints"), pytest.raises(UserError) as said:
        TinyTrainer(config, TinyOptions()).fit()
    assert "checkpoint(s) could not be drained to" in str(said.value)
    assert f"they stay in {local_folder(local, run)} on {os.uname().nodename}" in str(said.value)
    assert [p.name for p in local_folder(local, run).iterdir()] == ["ckpt-000001-00000006.pt.1"]


def test_a_local_folder_that_cannot_be_made_sends_checkpoints_to_the_run_directory(tmp_path):
    (tmp_path / "a-file").write_text("")
    done = run_cli(*ARGS, "--local-checkpoint-dir", "a-file", "--run-dir", "run", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    said = [x for x in done.stderr.splitlines() if "--local-checkpoint-dir" in x]
    assert said == ["WARNING: --local-checkpoint-dir a-file: a rank cannot use it (Not a "
                    "directory); checkpoints go straight to run/checkpoints"]  # fmt: skip
    assert (tmp_path / "run/checkpoints/latest.pt").resolve().name == "ckpt-000003-00000036.pt"

"""Checkpoint files: atomic writes, links, keep-last, safe loading, bit-exact resume."""

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
from helpers import AT_ONCE, ROOT, TESTS, TINY, assert_same_run, run_cli

from dmltrain import TrainConfig, UserError
from dmltrain.checkpoint.storage import (
    CheckpointDir,
    consolidate,
    list_checkpoints,
    load_file,
    load_latest_valid,
    load_sharded,
)
from tiny import TinyOptions, TinyTrainer
from tiny_models import WrapperNames


def fit(run, **config):
    config = {"epochs": 2, "batch_size": 16, "progress": "off", **config}
    trainer = TinyTrainer(TrainConfig(run_dir=str(run), **config), TinyOptions(save_weights=True))
    return trainer, trainer.fit()


def test_submodules_named_like_wrappers_keep_their_names(tmp_path):
    """Submodules named ``module`` and ``attn_module``, trained under DDP and
    torch.compile (both wrap the model and prefix its names) and resumed: the checkpoint
    holds the model's own names and loads into the bare model with strict loading."""
    run = tmp_path / "run"
    args = [*TINY, "--wrapper-names", "--nprocs", "2", "--compile", "--run-dir", str(run)]
    done = run_cli(*args, "--epochs", "2", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    resumed = run_cli(*args, cwd=tmp_path)
    assert resumed.returncode == 0 and "resuming from" in resumed.stdout, resumed.stderr[-2000:]
    state = load_file(run / "checkpoints" / "latest.pt")
    assert state["global_step"] == 3 * 96 // 16
    names = ["attn_module.bias", "attn_module.weight", "module.bias", "module.weight"]
    assert sorted(state["model"]) == names
    assert sorted(state["optimizer"]["state"]) == names
    bare = WrapperNames(features=4)
    bare.load_state_dict(state["model"], strict=True)
    final = torch.load(run / "final_weights.pt", weights_only=True)
    assert all(torch.equal(bare.state_dict()[k], final[k]) for k in names)


def test_contents_load_with_plain_torch_and_no_prefixes(tmp_path):
    run = tmp_path / "run"
    fit(run, nprocs=1)
    latest = run / "checkpoints" / "latest.pt"
    code = textwrap.dedent(f"""
        import sys, torch
        state = torch.load({str(latest)!r}, weights_only=True)
        assert "dmltrain" not in sys.modules
        print(sorted(state))
        print(sorted(state["model"]))
    """)
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    keys, model_keys = done.stdout.splitlines()
    for key in (
        "model",
        "optimizer",
        "scheduler",
        "scaler",
        "epoch",
        "step_in_epoch",
        "global_step",
        "rng",
        "config",
        "training_log",
        "tracking_run_id",
        "format_version",
        "epoch_metrics",
        "best_value",
    ):
        assert f"'{key}'" in keys
    assert "module." not in model_keys and "0.weight" in model_keys
    state = load_file(latest)
    assert state["epoch"] == 2 and state["global_step"] == 12 and len(state["training_log"]) == 2
    assert state["config"]["train"]["batch_size"] == 16


def test_keep_last_and_best(tmp_path):
    directory = CheckpointDir(tmp_path / "ck", keep_last=2)
    for step in range(1, 6):
        directory.save({"model": {"w": torch.tensor([float(step)])}}, step, step, best=step == 2)
    names = sorted(p.name for p in list_checkpoints(tmp_path / "ck"))
    assert names == [
        "ckpt-000002-00000002.pt",
        "ckpt-000004-00000004.pt",
        "ckpt-000005-00000005.pt",
    ]
    assert (tmp_path / "ck" / "latest.pt").resolve().name == "ckpt-000005-00000005.pt"
    assert load_file(tmp_path / "ck" / "best.pt")["model"]["w"].item() == 2.0
    assert not [p for p in (tmp_path / "ck").iterdir() if p.name.startswith(".")]


def test_corrupt_latest_falls_back_to_the_previous(tmp_path):
    directory = CheckpointDir(tmp_path / "ck", keep_last=0)
    for step in (1, 2):
        directory.save({"model": {"w": torch.tensor([float(step)])}}, step, step, best=False)
    newest = list_checkpoints(tmp_path / "ck")[0]
    newest.write_bytes(newest.read_bytes()[:100])  # truncated
    warnings = []
    path, state = load_latest_valid(tmp_path / "ck", warnings.append)
    assert path.name == "ckpt-000001-00000001.pt" and state["model"]["w"].item() == 1.0
    assert len(warnings) == 1 and "truncated or corrupt" in warnings[0]
    with pytest.raises(UserError, match="truncated or corrupt"):
        load_file(newest)
    with pytest.raises(UserError, match="does not exist"):
        load_file(tmp_path / "nope.pt")


def test_resume_skips_a_corrupt_latest_and_ends_the_same(tmp_path):
    fit(tmp_path / "ref", epochs=3)
    run = tmp_path / "run"
    fit(run, epochs=2, keep_last=0)
    newest = list_checkpoints(run / "checkpoints")[0]
    newest.write_bytes(b"garbage")
    _trainer, rows = fit(run, epochs=3, keep_last=0)  # resumes from the end of epoch 1
    assert [r["epoch"] for r in rows] == [1, 2, 3]
    assert_same_run(tmp_path / "ref", run)


def test_wrong_model_names_keys_and_shapes(tmp_path):
    run = tmp_path / "run"
    fit(run, epochs=1)
    other = TinyTrainer(
        TrainConfig(
            run_dir=str(tmp_path / "other"),
            progress="off",
            load_weights=str(run / "checkpoints" / "latest.pt"),
        ),
        TinyOptions(features=5),
    )
    expected = r"does not fit this model: shape mismatch: 0.weight \(8, 4\) in file vs \(8, 5\)"
    with pytest.raises(UserError, match=expected):
        other.fit()


def test_auto_resume_of_a_different_model_names_the_checkpoint_file(tmp_path):
    run = tmp_path / "run"
    fit(run, epochs=1)
    latest = list_checkpoints(run / "checkpoints")[0]
    config = TrainConfig(run_dir=str(run), epochs=2, batch_size=16, progress="off")
    other = TinyTrainer(config, TinyOptions(features=5))
    with pytest.raises(UserError, match=f"checkpoint {latest} does not fit this model"):
        other.fit()


def test_config_mismatch_on_resume_is_refused_and_nothing_overwritten(tmp_path):
    run = tmp_path / "run"
    done = run_cli(*TINY, "--epochs", "1", "--run-dir", str(run), cwd=tmp_path)
    assert done.returncode == 0
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    again = run_cli(*TINY, "--batch-size", "4", "--run-dir", str(run), cwd=tmp_path)
    assert again.returncode == 2
    (line,) = again.stderr.strip().splitlines()
    assert "cannot resume" in line and "the global batch would be 4 (1 process(es) x " \
        "--batch-size 4 x --grad-accum 1) but was 8 (1 x 8 x 1); keep it with " \
        "--global-batch-size 8 (or --batch-size 8)" in line  # fmt: skip
    seed = run_cli(*TINY, "--seed", "5", "--run-dir", str(run), cwd=tmp_path)
    assert seed.returncode == 2 and "seed is 5 now but was 0" in seed.stderr
    # outcome.json included: the refused jobs leave the finished job's record
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before
    assert json.loads((run / "outcome.json").read_text())["status"] == "done"
    missing = run_cli(
        *TINY, "--resume", str(tmp_path / "no.pt"), "--run-dir", str(tmp_path / "r2"), cwd=tmp_path
    )
    assert missing.returncode == 2 and "does not exist" in missing.stderr


def test_load_weights_for_fine_tuning(tmp_path):
    source, _ = fit(tmp_path / "src", epochs=2)
    latest = str(tmp_path / "src" / "checkpoints" / "latest.pt")
    fresh, rows = fit(tmp_path / "ft", epochs=1, load_weights=latest, lr=1e-9)
    assert [r["epoch"] for r in rows] == [1]  # counters start over
    for a, b in zip(source.model.parameters(), fresh.model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)  # lr 1e-9: unchanged
    continued, rows = fit(
        tmp_path / "ft2",
        epochs=3,
        load_weights=latest,
        load_optimizer=True,
        load_scheduler=True,
        load_epoch=True,
    )
    assert [r["epoch"] for r in rows] == [1, 2, 3] and continued.global_step == 18


SAVER = textwrap.dedent("""
    import sys, torch
    from pathlib import Path
    from dmltrain.checkpoint.storage import CheckpointDir
    directory = CheckpointDir(Path(sys.argv[1]), keep_last=2)
    big = {"w": torch.randn(3_000_000)}
    print("ready", flush=True)
    step = 0
    while True:
        step += 1
        directory.save({"model": big, "step": step}, step, step, best=step % 3 == 0)
""")


def test_kill_9_during_writes_never_breaks_latest(tmp_path):
    """Crash consistency: 20 hard kills at random moments of a save loop."""
    directory = tmp_path / "ck"
    rng = random.Random(0)
    for _ in range(20):
        proc = subprocess.Popen(
            [sys.executable, "-c", SAVER, str(directory)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        time.sleep(rng.uniform(0.0, 0.4))  # somewhere inside a save, most of the time
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        found = load_latest_valid(directory, lambda message: pytest.fail(message))
        if found is None:
            continue  # killed before the first save finished
        _path, state = found
        assert state["model"]["w"].shape == (3_000_000,)
        latest = directory / "latest.pt"
        if latest.exists():
            assert load_file(latest)["step"] <= state["step"]
    assert list_checkpoints(directory), "no save ever completed"
    assert len(list(directory.glob(".*.tmp-*"))) <= 1  # stale partial files are cleaned up


def test_best_tracks_the_metric_and_time_based_saves_happen(tmp_path):
    run = tmp_path / "run"
    # checked at every step (by default about every half second, longer than this run)
    trainer, rows = fit(run, epochs=4, keep_last=0, checkpoint_every_minutes=1e-6,
                        preempt_check_seconds=0)  # fmt: skip
    best_epoch = min(rows, key=lambda r: r["val_loss"])["epoch"]
    best = load_file(run / "checkpoints" / "best.pt")
    assert best["epoch"] == best_epoch and best["best_value"] == min(r["val_loss"] for r in rows)
    # every step was "due" by time: one checkpoint per step plus the epoch-end ones
    assert len(list_checkpoints(run / "checkpoints")) >= trainer.global_step


def test_async_save_writes_a_snapshot_and_reports_failures(tmp_path):
    directory = CheckpointDir(tmp_path / "ck", keep_last=0, asynchronous=True)
    weights = torch.zeros(1_000_000)
    directory.save({"model": {"w": weights}}, 1, 1, best=False)
    weights += 1  # the loop goes on changing the model while the write happens
    directory.wait()
    assert load_file(tmp_path / "ck" / "latest.pt")["model"]["w"].sum().item() == 0.0
    blocked = tmp_path / "not-a-dir"
    blocked.write_text("a file where the checkpoint directory should be")
    failing = CheckpointDir(blocked, keep_last=0, asynchronous=True)
    failing.save({"model": {}}, 1, 1, best=False)
    with pytest.raises(UserError, match=r"writing a checkpoint in .* failed"):
        failing.wait()


def test_async_checkpoints_give_the_same_run(tmp_path):
    fit(tmp_path / "sync", epochs=3, checkpoint_every_steps=2)
    fit(tmp_path / "async", epochs=3, checkpoint_every_steps=2, async_checkpoint=True)
    assert_same_run(tmp_path / "sync", tmp_path / "async")
    a = load_file(tmp_path / "sync" / "checkpoints" / "latest.pt")
    b = load_file(tmp_path / "async" / "checkpoints" / "latest.pt")
    assert a["global_step"] == b["global_step"]
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])


def test_async_sharded_save_returns_before_it_is_written(tmp_path, monkeypatch):
    """One process: the save returns while its shards are still being published (held
    here), and the loop changes the weights meanwhile; ``wait`` ends it."""
    directory = CheckpointDir(tmp_path / "ck", keep_last=1, asynchronous=True)
    holds = [threading.Event(), threading.Event()]  # one a save
    waiting = iter(holds)
    publish = directory._publish_sharded
    monkeypatch.setattr(directory, "_publish_sharded",
                        lambda *args: (next(waiting).wait(30), publish(*args)))  # fmt: skip
    weights = torch.zeros(1_000_000)
    for step, hold in zip((1, 2), holds, strict=True):
        started = time.monotonic()
        directory.save_sharded({"model": {"w": weights}}, {"step": step}, 1, step, False,
                               barrier=lambda: None, asynchronous=True)  # fmt: skip
        assert time.monotonic() - started < 10  # not held
        assert len(list_checkpoints(tmp_path / "ck")) == step - 1  # the previous one only
        weights += 1
        hold.set()
    directory.wait()
    (latest,) = list_checkpoints(tmp_path / "ck")  # published, and the older one pruned
    assert latest.name == "ckpt-000001-00000002.dcp" and (latest / "trainer.pt").is_file()
    shards = {"model": {"w": torch.empty(1_000_000)}}
    load_sharded(latest, shards, load_file(latest)["index"])
    assert shards["model"]["w"].eq(1.0).all()


RANDOM = ["--dropout", "0.2", "--augment"]  # random numbers in the step and in the data
FSDP = [*TINY, "--nprocs", "2", "--strategy", "fsdp", *RANDOM]


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("fsdp") / "run"
    done = run_cli(*FSDP, "--checkpoint-every-steps", "4", "--run-dir", str(run), cwd=run.parent)
    assert done.returncode == 0, done.stderr[-3000:]
    return run


def test_fsdp_writes_sharded_checkpoints_and_resumes_bit_exactly(fsdp_run, tmp_path):
    latest = fsdp_run / "checkpoints" / "latest.dcp"
    assert latest.is_symlink() and latest.resolve().is_dir()
    files = sorted(p.name for p in latest.resolve().iterdir())
    assert files == [".metadata", "__0_0.distcp", "__1_0.distcp", "trainer.pt"]
    assert not list((fsdp_run / "checkpoints").glob("ckpt-*.pt"))
    run = tmp_path / "run"
    # recomputed activations change nothing, stopped or not
    args = [
        *FSDP,
        "--checkpoint-every-steps",
        "4",
        "--run-dir",
        str(run),
        "--activation-checkpointing",
    ]
    stopped = run_cli(*args, "--signal-rank", "1", "--signal-at-step", "8", *AT_ONCE,
                      cwd=tmp_path)  # fmt: skip
    assert stopped.returncode == 3, stopped.stderr[-3000:]
    assert (run / "checkpoints" / "ckpt-000002-00000009.dcp").is_dir()
    reads = tmp_path / "reads"
    reads.mkdir()
    path = os.pathsep.join(str(p) for p in (TESTS / "fixtures" / "reads", TESTS, ROOT))
    resumed = run_cli(*args, cwd=tmp_path, PYTHONPATH=path, READS_DIR=str(reads),
                      READS_SUFFIX=".metadata")  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from" in resumed.stdout and "ckpt-000002-00000009.dcp" in resumed.stdout
    assert_same_run(fsdp_run, run)
    # the checkpoint's index (DCP's .metadata): read by one rank, once, not by every rank
    read = [line for f in reads.iterdir() for line in f.read_text().splitlines()]
    assert len(list(reads.iterdir())) >= 3  # the command and its 2 ranks at least
    assert read == [str(run / "checkpoints" / "ckpt-000002-00000009.dcp" / ".metadata")], read


def test_async_sharded_checkpoints_give_the_same_run(fsdp_run, tmp_path):
    """--async-checkpoint under FSDP: every rank writes its shards in the background; the
    checkpoints hold what the synchronous run's hold, and a stopped run (its last save
    waited for) resumes to the same run."""
    run = tmp_path / "run"
    args = [*FSDP, "--checkpoint-every-steps", "4", "--async-checkpoint", "--keep-last", "0",
            "--run-dir", str(run)]  # fmt: skip
    stopped = run_cli(*args, "--signal-rank", "1", "--signal-at-step", "10", *AT_ONCE,
                      cwd=tmp_path)  # fmt: skip
    assert stopped.returncode == 3, stopped.stderr[-3000:]
    resumed = run_cli(*args, cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_same_run(fsdp_run, run)
    name = "ckpt-000003-00000016.dcp"  # saved in the background, kept by both runs
    one, two = (
        torch.load(consolidate(source / "checkpoints" / name, tmp_path / f"{i}.pt"),
                   weights_only=True)
        for i, source in enumerate((fsdp_run, run))
    )  # fmt: skip
    assert one["global_step"] == two["global_step"] == 16
    assert all(torch.equal(one["model"][k], two["model"][k]) for k in one["model"])
    assert not list((run / "checkpoints").glob(".*tmp*"))


def test_consolidate_makes_one_plain_file(fsdp_run, tmp_path):
    latest = (fsdp_run / "checkpoints" / "latest.dcp").resolve()
    out = tmp_path / "one.pt"
    done = run_cli("consolidate", str(latest), "-o", str(out), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    state = torch.load(out, weights_only=True)
    final = torch.load(fsdp_run / "final_weights.pt", weights_only=True)
    assert sorted(state["model"]) == sorted(final)
    for key in final:
        assert torch.equal(state["model"][key], final[key]), key
    assert sorted(state["optimizer"]["state"]) == sorted(final)
    assert state["global_step"] == 18 and state["epoch"] == 3
    # the file resumes and fine-tunes like any other: here with DDP and 1 process
    for extra in (
        ["--nprocs", "2", "--resume", str(out), "--epochs", "4"],
        ["--load-weights", str(out)],
    ):
        run = tmp_path / f"from-{len(extra)}"
        again = run_cli(*TINY, *RANDOM, *extra, "--run-dir", str(run), cwd=tmp_path)
        assert again.returncode == 0, again.stderr[-3000:]
    # a sharded checkpoint also loads directly into a 1-process run
    direct = run_cli(
        *TINY,
        *RANDOM,
        "--load-weights",
        str(latest),
        "--run-dir",
        str(tmp_path / "d"),
        cwd=tmp_path,
    )
    assert direct.returncode == 0 and "(dmltrain checkpoint): loaded 4" in direct.stdout, (
        direct.stderr
    )
    wrong = run_cli("consolidate", str(out), cwd=tmp_path)
    assert wrong.returncode == 2 and "is not a sharded checkpoint directory" in wrong.stderr


def test_a_torn_sharded_checkpoint_falls_back_to_the_previous(fsdp_run, tmp_path):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(fsdp_run, run, symlinks=True)
    newest = list_checkpoints(run / "checkpoints")[0]
    shard = newest / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])
    done = run_cli(*FSDP, "--epochs", "4", "--run-dir", str(run), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"checkpoint {newest} is incomplete or corrupt (shard __1_0.distcp)" in done.stderr
    assert "falling back to the previous checkpoint" in done.stderr


FULL_DISK = [*TINY, "--epochs", "2", "--features", "2048", "--checkpoint-every-steps", "2"]


def test_a_full_disk_skips_checkpoints_with_one_line_and_training_goes_on(small_disk):
    """The disk fills at step 3 and is freed at step 9: the saves at steps 4, 6 and 8 fail
    with one line each naming the last good checkpoint; the run ends as if nothing
    happened, its checkpoints complete and loadable."""
    run, reference = small_disk / "run", small_disk / "reference"
    done = run_cli(*FULL_DISK, "--fill-disk-at-step", "3", "--free-disk-at-step", "9",
                   "--run-dir", str(run), cwd=small_disk)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    lines = [line for line in done.stderr.splitlines() if "no space left" in line]
    assert len(lines) == 3, done.stderr
    good = run / "checkpoints" / "ckpt-000001-00000002.pt"
    for line in lines:
        assert f"the last good checkpoint is {good}" in line, line
        assert "MB free on its file system" in line and "tries again" in line, line
        assert "(0.0 MB free" not in line, line  # measured without the partial file
    assert load_file(run / "checkpoints" / "latest.pt")["global_step"] == 24
    assert not list((run / "checkpoints").glob(".*tmp*"))  # no partial file left
    ok = run_cli(*FULL_DISK, "--run-dir", str(reference), cwd=small_disk)
    assert ok.returncode == 0, ok.stderr
    assert_same_run(reference, run)


def test_a_checkpoint_that_must_be_written_stops_the_run_with_one_line(small_disk):
    """Preempted while the disk is full: that checkpoint cannot be skipped, so the run
    stops (exit 2, one line) and the last good checkpoint stays intact; once there is
    space again the run resumes from it."""
    run = small_disk / "run"
    args = [*FULL_DISK, "--run-dir", str(run)]
    done = run_cli(*args, "--fill-disk-at-step", "3", "--signal-rank", "0",
                   "--signal-at-step", "4", *AT_ONCE, cwd=small_disk)  # fmt: skip
    assert done.returncode == 2, done.stderr
    (line,) = [line for line in done.stderr.splitlines() if line.startswith("dmltrain: error")]
    assert "no space left for checkpoint" in line and "ckpt-000001-00000002.pt" in line, line
    assert "Traceback" not in done.stderr
    assert load_file(run / "checkpoints" / "latest.pt")["global_step"] == 2
    (run / "filler").unlink()
    resumed = run_cli(*args, cwd=small_disk)
    assert resumed.returncode == 0 and "global step 2)" in resumed.stdout, resumed.stderr

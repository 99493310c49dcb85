"""Resuming at another number of processes (dmltrain/checkpoint/checkpointer.py): the global batch
is what a resume keeps; the position in the epoch is counted in samples.

Real processes (``--nprocs``): a run of 2 processes x batch 8 is preempted mid-epoch
(SIGUSR1 in the 4th of 6 steps an epoch) and resumed on 1 process x 16, on 1 x 8 x
``--grad-accum 2`` and on 4 x 4; a run of 1 x 16 is resumed on 2 x 8. Each ends within
1e-5 (relative) of the uninterrupted run, with the same training-log rows, and every
sample of every epoch trained exactly once (tiny's ``--record-samples``).
"""

import shutil
import subprocess
from collections import Counter
from pathlib import Path

import pytest
from helpers import (
    AT_ONCE,
    TESTS,
    assert_same_run,
    cli_env,
    log_numbers,
    own_port,
    require,
    run_cli,
)

from dmltrain.checkpoint.storage import list_checkpoints, load_file

BASE = ["tiny", "--epochs", "2", "--samples", "96", "--save-weights", "--progress", "off",
        "--record-samples"]  # fmt: skip
STOP_AFTER_STEP_4 = ["--signal-rank", "0", "--signal-at-step", "3", *AT_ONCE]


def shape(nprocs: int, batch: int, *extra: str) -> list[str]:
    return ["--nprocs", str(nprocs), "--batch-size", str(batch), *extra]


def train(run: Path, *args: str, code: int = 0) -> str:
    done = run_cli(*BASE, "--run-dir", str(run), *args, cwd=run.parent)
    assert done.returncode == code, done.stderr
    return done.stdout + done.stderr


def samples_per_epoch(run: Path) -> dict[int, Counter]:
    """Which sample indices were trained in each epoch, over all ranks and jobs."""
    seen: dict[int, Counter] = {}
    for record in run.glob("samples.*.txt"):
        for line in record.read_text().splitlines():
            epoch, _, *indices = (int(v) for v in line.split())
            seen.setdefault(epoch, Counter()).update(indices)
    return seen


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("reference") / "run"
    train(run, *shape(2, 8))
    return run


@pytest.fixture(scope="module")
def preempted(tmp_path_factory) -> dict[int, Path]:
    """Runs of 2 x 8 and 1 x 16, stopped after step 4 of epoch 1, by world size."""
    runs = {}
    for nprocs, batch in ((2, 8), (1, 16)):
        run = tmp_path_factory.mktemp(f"preempted{nprocs}") / "run"
        train(run, *shape(nprocs, batch), *STOP_AFTER_STEP_4, code=3)
        assert load_file(list_checkpoints(run / "checkpoints")[0])["step_in_epoch"] == 4
        runs[nprocs] = run
    return runs


@pytest.mark.parametrize(
    "start, resume",
    [
        (2, shape(1, 16)),
        (2, shape(1, 8, "--grad-accum", "2")),
        (2, shape(4, 4)),  # more processes than cores
        (1, shape(2, 8)),
        (2, shape(1, 1, "--global-batch-size", "16")),  # the flag, not the arithmetic
    ],
    ids=["2x8->1x16", "2x8->1x8x2", "2x8->4x4", "1x16->2x8", "2x8->global-16"],
)
def test_resume_on_another_number_of_processes_keeps_the_global_batch(
    tmp_path, reference, preempted, start, resume
):
    run = tmp_path / "run"
    shutil.copytree(preempted[start], run)
    out = train(run, *resume)
    nprocs = int(resume[1])
    assert f"resuming on {nprocs} process(es) instead of {start}, global batch 16 (kept)" in out
    assert_same_run(reference, run, rel=1e-5)
    assert [row["epoch"] for row in log_numbers(run)] == [1.0, 2.0]
    seen = samples_per_epoch(run)
    assert sorted(seen) == [1, 2]
    for epoch, counts in seen.items():  # none skipped, none repeated
        assert counts == Counter(range(96)), (epoch, counts)
    diagnostics = (run / "diagnostics.json").read_text()
    assert f'"world_size": [\n        {start},\n        {nprocs}\n      ]' in diagnostics
    latest = load_file(list_checkpoints(run / "checkpoints")[0])
    assert latest["world_size_changes"] == [{
        "epoch": 1, "step": 4, "global_step": 4, "world_size": [start, nprocs],
        "global_batch": [16, 16],
    }]  # fmt: skip
    rows = (run / "training_log.csv").read_text().splitlines()
    assert rows[0].split(",")[-2:] == ["world_size", "epoch_time_s"]
    assert [row.split(",")[-2] for row in rows[1:]] == [str(nprocs)] * 2


def test_a_changed_global_batch_is_refused_unless_allowed(tmp_path, preempted):
    run = tmp_path / "run"
    shutil.copytree(preempted[2], run)
    done = run_cli(*BASE, "--run-dir", str(run), *shape(1, 8), cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"dmltrain: error: cannot resume from {list_checkpoints(run / 'checkpoints')[0]}: the "
        "global batch would be 8 (1 process(es) x --batch-size 8 x --grad-accum 1) but was 16 "
        "(2 x 8 x 1); keep it with --global-batch-size 16 (or --batch-size 16), or change it "
        "with --allow-global-batch-change"
    ]
    # Allowed: 64 samples into epoch 1 = 8 batches of 8; the run goes on from there.
    out = train(run, *shape(1, 8), "--allow-global-batch-change")
    assert "the global batch changes from 16 to 8 (--allow-global-batch-change): 64 " \
        "samples into epoch 1, the run goes on from sample 64" in out  # fmt: skip
    for counts in samples_per_epoch(run).values():
        assert counts == Counter(range(96))
    # A new global batch of 48: back to sample 48, the last whole batch, and said so
    odd = tmp_path / "odd"
    shutil.copytree(preempted[2], odd)
    out = train(odd, *shape(1, 48), "--allow-global-batch-change")
    assert "64 samples into epoch 1, the run goes on from sample 48, a whole batch of 48" in out
    seen = samples_per_epoch(odd)[1]
    assert set(seen) == set(range(96)) and sum(seen.values()) == 96 + 16  # 16 of them twice


def test_global_batch_size_divides_among_processes_or_says_so(tmp_path):
    done = run_cli(*BASE, "--run-dir", str(tmp_path / "r"), "--nprocs", "3",
                   "--global-batch-size", "16", cwd=tmp_path)  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.strip() == (
        "dmltrain: error: --global-batch-size 16 does not divide into 3 process(es) x "
        "--grad-accum 1: choose a multiple of 3"
    )
    run = tmp_path / "g"
    train(run, "--nprocs", "2", "--global-batch-size", "16", "--grad-accum", "2", "--epochs", "1")
    assert "batch_size: 4\n" in (run / "config.yaml").read_text()
    first = [line.split() for line in (run / "samples.0.txt").read_text().splitlines()]
    assert {len(line) - 2 for line in first} == {4}  # 4 samples a micro-batch on each rank


def test_fsdp_and_horovod_resume_on_one_process(tmp_path, reference):
    """FSDP checkpoints of 2 ranks, sharded (DCP, resharded on load) and full (one file),
    go on on 1; a Horovod run of 2 goes on under horovodrun -np 1."""
    for kind, suffix in (("sharded", ".dcp"), ("full", ".pt")):
        fsdp = tmp_path / f"fsdp-{kind}"
        flags = ["--strategy", "fsdp", "--checkpoint-format", kind]
        train(fsdp, *shape(2, 8), *flags, *STOP_AFTER_STEP_4, code=3)
        assert (fsdp / "checkpoints" / f"ckpt-000001-00000004{suffix}").exists()
        train(fsdp, *shape(1, 16), *flags)
        assert_same_run(reference, fsdp, rel=1e-5)

    require("horovodrun")
    hvd = tmp_path / "hvd"
    # horovodrun reports a worker's exit 3 as its own 1; the checkpoint tells
    for nprocs, batch, extra, code in ((2, 8, STOP_AFTER_STEP_4, 1), (1, 16, [], 0)):
        done = subprocess.run(
            ["horovodrun", "--gloo", "-np", str(nprocs), "-H", f"localhost:{nprocs}",
             "dmltrain", *BASE, "--run-dir", str(hvd), "--batch-size", str(batch), *extra],
            cwd=tmp_path, env=cli_env(**own_port()), capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert done.returncode == code, done.stdout[-3000:]
        assert (hvd / "checkpoints" / "ckpt-000001-00000004.pt").is_file()
    assert "resuming on 1 process(es) instead of 2, global batch 16 (kept)" in done.stdout
    assert_same_run(reference, hvd, rel=1e-5)
    for counts in samples_per_epoch(hvd).values():
        assert counts == Counter(range(96))


FIXTURE = TESTS / "fixtures" / "main-cd2ef32"


def test_a_checkpoint_of_an_earlier_version_resumes_bitwise(tmp_path):
    """A checkpoint written by the code before the loop was opened (the fixture's README
    says how it was made) resumes with today's code to the same weights and log, bitwise."""
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    shutil.copy(FIXTURE / "ckpt-000002-00000009.pt", run / "checkpoints")
    args = ["tiny", "--epochs", "2", "--batch-size", "8", "--save-weights", "--progress", "off",
            "--dropout", "0.2", "--augment", "--nprocs", "2", "--ema-decay", "0.9",
            "--optimizer", "adamw", "--seed", "7"]  # fmt: skip
    done = run_cli(*args, "--run-dir", str(run), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "resuming from" in done.stdout + done.stderr
    assert_same_run(FIXTURE, run)


def test_settings_changed_at_a_resume_are_said_and_applied_or_refused(tmp_path):
    """On the bundled MNIST (2 steps of 2,000 an epoch): --lr changed at a resume is said
    and applied (the optimizer kept 0.001 while config.yaml said 0.01); --optimizer sgd on
    an Adam run is one line (a KeyError traceback before), and nothing is written."""
    run = tmp_path / "run"
    base = ["mnist", "--no-download", "--batch-size", "2000", "--progress", "off",
            "--run-dir", str(run)]  # fmt: skip
    first = run_cli(*base, "--max-steps", "1", cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    more = run_cli(*base, "--max-steps", "2", "--lr", "0.01", cwd=tmp_path)
    assert more.returncode == 0, more.stderr[-3000:]
    said = "with changed settings, which apply from here on: max_steps: 1 -> 2, lr: 0.001 -> 0.01"
    assert said in more.stderr
    saved = load_file(run / "checkpoints" / "latest.pt")
    assert saved["optimizer"]["param_groups"][0]["lr"] == 0.01
    assert saved["config"]["train"]["lr"] == 0.01
    before = sorted(p.name for p in (run / "checkpoints").iterdir())
    sgd = run_cli(*base, "--max-steps", "3", "--lr", "0.01", "--optimizer", "sgd", cwd=tmp_path)
    assert sgd.returncode == 2, sgd.stderr[-3000:]
    assert "Traceback" not in sgd.stderr
    (line,) = [x for x in sgd.stderr.splitlines() if x.startswith("dmltrain: error:")]
    assert "with --optimizer sgd: its optimizer state is adam's" in line, line
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == before


def test_how_an_update_runs_is_the_resuming_runs_choice(tmp_path):
    """fused, foreach, capturable: a setting of the process, not of the state. A run saved
    with non-fused optimizers goes on fused when resumed so (a CPU run resumed on a GPU, an
    older checkpoint under the fused default)."""
    run = tmp_path / "run"
    args = ["tiny", "--batch-size", "8", "--progress", "off", "--two-optimizers", "auto",
            "--run-dir", str(run)]  # fmt: skip

    def fused() -> list:
        state = load_file(list_checkpoints(run / "checkpoints")[0])
        return [group.get("fused") for group in state["optimizer"]["param_groups"]]

    assert run_cli(*args, "--epochs", "1", cwd=TESTS).returncode == 0
    assert fused() == [None, None]
    done = run_cli(*args, "--epochs", "2", "--fused", cwd=TESTS)
    assert done.returncode == 0, done.stderr[-2000:]
    assert fused() == [True, True]


PER_RANK = """
import torch
from tiny import TinyOptions, TinyTrainer

from dmltrain import register_experiment


class Carried:
    '''A value each rank carries on by its own amount (a hidden state, a position).'''

    def __init__(self, rank, resplit):
        self.value = torch.tensor([float(rank)])
        if resplit:  # the states of N ranks made into those of M: their sum, on rank 0
            self.resplit_state = lambda states, world: [
                {"value": sum(s["value"] for s in states)}] + [
                {"value": torch.zeros(1)}] * (world - 1)

    def state_dict(self):
        return {"value": self.value.clone()}

    def load_state_dict(self, state):
        self.value = state["value"].clone()


class Tiny(TinyTrainer):
    def create_states(self):
        self.carried = Carried(self.dist.rank, self.opts.dropout > 0)
        return {"carried": self.carried}

    def train_step(self, batch):
        if self.model.training:
            self.carried.value += 1 + self.dist.rank
        return super().train_step(batch)

    def on_epoch_end(self, epoch, row):
        with open(self.run_dir / f"carried.{self.dist.rank}.txt", "a") as out:
            out.write(f"{epoch + 1} {self.carried.value.item():g}\\n")


EXPERIMENT = register_experiment("per-rank", Tiny, TinyOptions)
"""


def test_a_state_that_differs_by_rank_comes_back_as_each_ranks_own(tmp_path):
    """create_states' value differs on the 2 ranks: a run stopped mid-epoch 2 (SIGUSR1)
    resumes each rank's own (not rank 0's on both), and ends with the values of a run never
    stopped. At 1 process the resume is refused in one line, unless the state says how
    to split the ranks' values anew (resplit_state)."""
    (tmp_path / "mine.py").write_text(PER_RANK)
    args = ["mine.py", "--epochs", "3", "--batch-size", "8", "--progress", "off",
            "--nprocs", "2"]  # fmt: skip
    whole = run_cli(*args, "--run-dir", "whole", cwd=tmp_path)
    assert whole.returncode == 0, whole.stderr[-3000:]
    ends = [(tmp_path / "whole" / f"carried.{r}.txt").read_text() for r in (0, 1)]
    assert ends == ["1 6\n2 12\n3 18\n", "1 13\n2 25\n3 37\n"]  # 6 steps an epoch
    stop = ["--signal-rank", "0", "--signal-at-step", "8", *AT_ONCE]
    cut = run_cli(*args, "--run-dir", "cut", *stop, cwd=tmp_path)
    assert cut.returncode == 3, cut.stderr[-3000:]
    for rank in (0, 1):  # the epochs done before the stop, then the resumed ones
        (tmp_path / "cut" / f"carried.{rank}.txt").unlink()
    one = [*args[:-2], "--global-batch-size", "16"]  # the same global batch on 1 process
    alone = run_cli(*one, "--run-dir", "cut", cwd=tmp_path)
    assert alone.returncode == 2
    assert "holds 'carried' for each of its 2 processes, and this run has 1" in alone.stderr
    again = run_cli(*args, "--run-dir", "cut", cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    ends = [(tmp_path / "cut" / f"carried.{r}.txt").read_text() for r in (0, 1)]
    assert ends == ["2 12\n3 18\n", "2 25\n3 37\n"]
    cut = run_cli(*args, "--dropout", "0.1", "--run-dir", "split", *stop, cwd=tmp_path)
    assert cut.returncode == 3, cut.stderr[-3000:]
    alone = run_cli(*one, "--dropout", "0.1", "--run-dir", "split", cwd=tmp_path)
    assert alone.returncode == 0, alone.stderr[-3000:]
    # stopped after step 9 (the ranks agree at the next boundary): 9 + 19 on rank 0, then
    # the 3 steps left of epoch 2 and the 6 of epoch 3, 1 a step
    assert "split/checkpoints/ckpt-000002-00000009.pt" in alone.stdout
    assert (tmp_path / "split" / "carried.0.txt").read_text().splitlines()[-2:] == ["2 31", "3 37"]

"""Preemption with real signals and real kills; resumed runs must equal uninterrupted ones."""

import contextlib
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import helpers
import pytest
from helpers import (
    AT_ONCE,
    MPIRUN,
    RANDOM,
    assert_same_run,
    cli_env,
    own_port,
    require,
    run_cli,
    signal_at_line,
)

from dmltrain.checkpoint.storage import list_checkpoints, load_file
from dmltrain.runtime import preemption
from dmltrain.runtime.launch import free_port
from dmltrain.runtime.preemption import AgreementSchedule, PreemptionWatcher

TINY = [*helpers.TINY, *RANDOM]


def test_handler_only_sets_a_flag():
    watcher = PreemptionWatcher(["SIGUSR1"])
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        assert watcher.requested == "SIGUSR1"
        assert watcher.local_request() is True
    finally:
        watcher.restore()
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL


DROPPED_CTRL_C = """
import signal, weakref
from dmltrain.runtime.preemption import PreemptionWatcher, StartupSignals

StartupSignals.install()

class Thing:
    pass

thing = Thing()
ref = weakref.ref(thing, lambda _: signal.raise_signal(signal.SIGINT))
del thing  # Python drops the KeyboardInterrupt raised in the callback: "Exception ignored"
print("went on", flush=True)
try:
    PreemptionWatcher(["SIGINT"])
except KeyboardInterrupt:
    print("stopped when the run took SIGINT over")
"""


def test_a_ctrl_c_that_python_dropped_during_start_up_still_stops_the_run():
    """A KeyboardInterrupt raised in a weakref callback (one of importlib's, during start-up)
    is dropped by Python; the run still stops when its watcher takes SIGINT over."""
    out = subprocess.run([sys.executable, "-c", DROPPED_CTRL_C], capture_output=True,
                         text=True, timeout=60, preexec_fn=helpers.sigint_at_default)  # fmt: skip
    assert "Exception ignored" in out.stderr and "KeyboardInterrupt" in out.stderr, out.stderr
    assert out.stdout.splitlines() == ["went on", "stopped when the run took SIGINT over"]


EARLY_USR1 = """
import os, signal
from dmltrain.runtime.preemption import PreemptionWatcher, StartupSignals

StartupSignals.install()
os.kill(os.getpid(), signal.SIGUSR1)  # before the run catches signals: kept, not fatal
print("went on", flush=True)
watcher = PreemptionWatcher(["SIGTERM", "SIGUSR1"])
print(watcher.local_request(), watcher.why(), flush=True)
watcher.restore()
PreemptionWatcher(["SIGTERM"])  # SIGUSR1 not a preemption signal: its default from here
os.kill(os.getpid(), signal.SIGUSR1)
print("not reached")
"""


def test_a_signal_during_start_up_is_acted_on_when_the_run_takes_it_over():
    out = subprocess.run([sys.executable, "-c", EARLY_USR1], capture_output=True, text=True,
                         timeout=60)  # fmt: skip
    assert out.stdout.splitlines() == ["went on", "True SIGUSR1"], out.stderr
    assert out.returncode == -signal.SIGUSR1


def test_a_short_jobs_early_notice_waits_for_its_own_deadline():
    """In a job shorter than the batch script's notice, the first SIGUSR1 (even one during
    setup) is said and left to the job's own deadline; another signal still stops it."""
    for during_setup in (False, True):
        watcher, said = PreemptionWatcher(["SIGUSR1", "SIGTERM"]), []
        try:
            if during_setup:
                os.kill(os.getpid(), signal.SIGUSR1)
            watcher.stop_at(preemption.Deadline(time.time() + 3600, "SIGUSR1"), said.append)
            if not during_setup:
                os.kill(os.getpid(), signal.SIGUSR1)
            assert not watcher.local_request() and len(said) == 1, said
            assert said[0].startswith("dmltrain: SIGUSR1 now is the batch script's time-limit")
            assert not watcher.local_request() and len(said) == 1  # said once
            os.kill(os.getpid(), signal.SIGTERM)
            assert watcher.local_request() and watcher.why() == "SIGTERM"
        finally:
            watcher.restore()
    watcher = PreemptionWatcher(["SIGUSR1"])
    try:
        watcher.stop_at(preemption.Deadline(time.time() - 1, "SIGUSR1"), print)
        assert watcher.local_request() and watcher.why() == "time limit"
    finally:
        watcher.restore()


def test_deadline_before_the_time_limit():
    watcher = PreemptionWatcher([], deadline=time.time() - 1)
    assert watcher.local_request() and watcher.requested == "time limit"
    assert not PreemptionWatcher([], deadline=time.time() + 3600).local_request()


def test_the_agreement_comes_every_agreed_number_of_boundaries():
    """Steps of at least 10 ms and a 50 ms interval: the first boundary agrees, each
    proposal is 1 to 5 steps, and the next agreement comes exactly that many boundaries on
    (every rank counts the same boundaries, so all agree at the same one)."""
    schedule = AgreementSchedule(seconds=0.05)
    agreed_at, counts = [], []
    for boundary in range(40):
        time.sleep(0.01)
        if schedule.due():
            agreed_at.append(boundary)
            counts.append(schedule.proposal())
            schedule.agreed(counts[-1], 0.0)
    assert agreed_at[0] == 0
    assert all(1 <= n <= 5 for n in counts) and max(counts) > 1, counts
    assert [b - a for a, b in itertools.pairwise(agreed_at)] == counts[:-1]
    every = AgreementSchedule(seconds=0)
    assert all(every.due() and every.proposal() == 1 for _ in range(5))


def test_an_agreement_that_costs_more_is_spaced_out_to_one_percent():
    """The collective takes 4 ms (a ring across many ranks) and a step 1 ms. At a 10 ms
    interval the agreements would take about a quarter of training; the schedule learns
    their cost from the agreements themselves and spaces them to 4 ms / 1% = 0.4 s, and
    a signal is still acted on at the next agreement. The cost is capped at 10 s of
    interval, and --preempt-check-seconds 0 still agrees at every step."""

    def run(share: float, seconds: float) -> tuple[int, float, AgreementSchedule, float]:
        """Steps until a signal, sent ``seconds`` - 0.6 s in, is acted on; returns the
        agreements, their share of the time, the schedule and how late the stop came."""
        schedule = AgreementSchedule(seconds=0.01, share=share)
        watcher = PreemptionWatcher([])
        in_collective = 0.0

        def slow_max(values: list[int]) -> list[int]:
            nonlocal in_collective
            began = time.perf_counter()
            time.sleep(0.004)
            in_collective += time.perf_counter() - began
            return values

        agreements, start, asked = 0, time.perf_counter(), None
        while time.perf_counter() - start < seconds + 30:  # until the stop
            time.sleep(0.001)
            before = in_collective
            stop, _, _ = preemption.agree(schedule, watcher, slow_max, lambda: False)
            agreements += in_collective > before
            now = time.perf_counter()
            if asked is None and now - start > seconds - 0.6:
                watcher.requested, asked = "SIGUSR1", now
            if stop:
                break
        assert asked is not None and stop, "the signal was never acted on"
        return agreements, in_collective / (now - start), schedule, now - asked

    fixed_count, fixed_share, fixed, _ = run(share=1.0, seconds=1.0)
    count, share, spaced, late = run(share=0.01, seconds=1.3)
    assert fixed.interval() == pytest.approx(0.01), fixed.interval()
    assert fixed_share > 0.15, (fixed_count, fixed_share)
    # spaced by the cost it measured: the 4 ms sleep, longer on a loaded machine
    assert spaced.cost >= 0.004, spaced.cost
    assert spaced.interval() == pytest.approx(min(spaced.cost / 0.01, 10.0))
    # two at the start, before the cost is known; the share is judged against the fixed
    # schedule's, measured alike (a loaded machine stretches the sleeps of both)
    assert count <= 6 and share < min(0.05, fixed_share / 5), (count, share, fixed_share)
    assert late <= 1.5 * spaced.interval() + 0.2, (late, spaced.interval())  # the next one

    capped = AgreementSchedule(seconds=0.5)
    capped.agreed(1, 1.0)
    assert capped.interval() == 10.0
    every = AgreementSchedule(seconds=0)
    every.agreed(1, 1.0)
    assert every.interval() == 0.0 and every.due() and every.proposal() == 1


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    runs = {}
    for nprocs in (1, 2):
        run = tmp_path_factory.mktemp(f"full{nprocs}") / "run"
        done = run_cli(*TINY, "--nprocs", str(nprocs), "--run-dir", str(run), cwd=run.parent)
        assert done.returncode == 0, done.stderr
        runs[nprocs] = run
    return runs


def interrupt_then_resume(run, first, nprocs):
    args = [*TINY, "--nprocs", str(nprocs), "--run-dir", str(run)]
    done = run_cli(*args, *first, cwd=run.parent)
    resumed = run_cli(*args, cwd=run.parent)
    assert resumed.returncode == 0, resumed.stderr
    assert "dmltrain: resuming from" in resumed.stdout
    return done, resumed


@pytest.mark.parametrize("nprocs", [1, 2])
@pytest.mark.parametrize("when", ["mid-epoch", "last step of an epoch", "second epoch"])
def test_sigusr1_then_resume_is_bit_exact(uninterrupted, tmp_path, nprocs, when):
    per_epoch = 96 // (8 * nprocs)
    # the signal arrives during the step taken at this global step (0-based)
    step = {"mid-epoch": per_epoch // 2, "last step of an epoch": per_epoch - 1,
            "second epoch": per_epoch + 2}[when]  # fmt: skip
    run = tmp_path / "run"
    rank = str(nprocs - 1)
    done, _ = interrupt_then_resume(
        run, ["--signal-rank", rank, "--signal-at-step", str(step), *AT_ONCE], nprocs
    )
    assert done.returncode == 3, done.stderr
    assert "preempted (SIGUSR1)" in done.stderr or "checkpoint saved" in done.stderr
    assert_same_run(uninterrupted[nprocs], run)
    final = load_file(run / "checkpoints" / "latest.pt")
    assert final["global_step"] == 3 * per_epoch  # no step taken twice or skipped


def test_a_resume_reads_the_checkpoint_in_one_process(uninterrupted, tmp_path):
    """Rank 0 reads and checks the checkpoint and hands its state to the other ranks
    (dmltrain.checkpoint.handout): one process of the resumed run opens the file, and the
    run ends bitwise equal to one never interrupted."""
    run = tmp_path / "run"
    args = [*TINY, "--nprocs", "2", "--run-dir", str(run)]
    done = run_cli(*args, "--signal-rank", "1", "--signal-at-step", "3", *AT_ONCE, cwd=tmp_path)
    assert done.returncode == 3, done.stderr[-3000:]
    reads = tmp_path / "reads"
    reads.mkdir()
    path = os.pathsep.join(str(p) for p in (helpers.TESTS / "fixtures" / "reads",
                                            helpers.TESTS, helpers.ROOT))  # fmt: skip
    resumed = run_cli(*args, cwd=tmp_path, PYTHONPATH=path, READS_DIR=str(reads),
                      READS_SUFFIX=".pt")  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from" in resumed.stdout and "00000004.pt" in resumed.stdout
    assert_same_run(uninterrupted[2], run)
    opened = {f.name: f.read_text().splitlines() for f in reads.iterdir()}
    assert len(opened) >= 3  # the command and its 2 ranks at least
    readers = [pid for pid, files in opened.items() if any("ckpt-" in f for f in files)]
    assert len(readers) == 1, opened


@pytest.mark.parametrize("nprocs", [1, 2])
def test_augmentation_in_loader_workers_resumes_bit_exact(uninterrupted, tmp_path, nprocs):
    """Each sample is augmented in a DataLoader worker with generators seeded from (seed,
    epoch, index): the same draws with 2 workers as in the training process, and after a
    mid-epoch resume, whose new workers start at a later sample."""
    run = tmp_path / "run"
    workers = ["--num-workers", "2"]
    signal_mid_epoch = ["--signal-rank", "0", "--signal-at-step", "7", *AT_ONCE]
    args = [*TINY, *workers, "--nprocs", str(nprocs), "--run-dir", str(run)]
    done = run_cli(*args, *signal_mid_epoch, cwd=tmp_path)
    assert done.returncode == 3, done.stderr
    resumed = run_cli(*args, cwd=tmp_path)
    assert resumed.returncode == 0 and "resuming from" in resumed.stdout, resumed.stderr
    assert_same_run(uninterrupted[nprocs], run)  # uninterrupted without workers


def test_by_default_both_ranks_stop_at_the_same_later_boundary(uninterrupted, tmp_path):
    """The default check interval (0.5 s) with steps of about 50 ms: a signal on rank 1 at
    its third step is acted on some steps later, at the same boundary on both ranks (else
    the next collective would hang), and the resumed run equals one never interrupted."""
    run = tmp_path / "run"
    signal_rank_1 = ["--signal-rank", "1", "--signal-at-step", "2", "--step-sleep", "0.05"]
    done, resumed = interrupt_then_resume(run, signal_rank_1, 2)
    assert done.returncode == 3, done.stderr
    stopped = int(re.search(r"global step (\d+)", resumed.stdout)[1])  # resumed from
    assert 3 < stopped < 18  # 3 with --preempt-check-seconds 0; 18 steps in all
    assert_same_run(uninterrupted[2], run)


@pytest.mark.parametrize("nprocs", [1, 2])
@pytest.mark.parametrize("name", ["SIGTERM", "SIGINT"])
def test_sigterm_and_sigint_from_outside_then_resume_is_bit_exact(
    uninterrupted, tmp_path, name, nprocs
):
    """What a scheduler does (SIGTERM at preemption or the time limit, Ctrl-C by hand):
    checkpoint at the next step, exit 3, resume to the same result. With one process the
    signal goes to it; with --nprocs 2 to every process of the run, as a scheduler signals
    a job step and a terminal a foreground job (the parent, its workers and the fork
    server that starts them; a signal to the parent alone: the test below)."""
    run = tmp_path / "run"
    args = [*TINY, "--nprocs", str(nprocs), "--run-dir", str(run)]
    logged = [*args, "--progress", "log", "--log-every", "1", "--step-sleep", "0.3"]
    code, err = signal_at_line(
        logged, "epoch 1/3 step 3/", name, tmp_path, timeout=120, group=nprocs > 1
    )
    assert code == 3, err
    assert f"preempted ({name})" in err
    assert list_checkpoints(run / "checkpoints")
    resumed = run_cli(*args, cwd=tmp_path)
    assert resumed.returncode == 0 and "resuming from" in resumed.stdout, resumed.stderr
    assert_same_run(uninterrupted[nprocs], run)


def children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def test_a_signal_while_the_workers_start_still_checkpoints_and_resumes(uninterrupted, tmp_path):
    """SIGTERM reaches the --nprocs parent as soon as it has started its workers, while
    they still import torch. It is passed on once they catch it, instead of killing them:
    exit 3 with a checkpoint, and the resumed run equals one never interrupted. The steps
    sleep: the tiny run can end within the parent's first look at what it received."""
    run = tmp_path / "run"
    args = [*TINY, "--nprocs", "2", "--step-sleep", "0.1", "--run-dir", str(run)]
    proc = subprocess.Popen([sys.executable, "-m", "dmltrain", *args], cwd=tmp_path,
                            env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)  # fmt: skip
    waited = time.monotonic()
    while not children(proc.pid):
        assert proc.poll() is None and time.monotonic() - waited < 120, "no workers started"
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 3, err
    assert "preempted (SIGTERM)" in err
    assert list_checkpoints(run / "checkpoints")
    resumed = run_cli(*args, cwd=tmp_path)
    assert resumed.returncode == 0 and "resuming from" in resumed.stdout, resumed.stderr
    assert_same_run(uninterrupted[2], run)


@pytest.mark.parametrize("nprocs", [1, 2])
def test_kill_9_after_a_step_checkpoint_then_resume_is_bit_exact(uninterrupted, tmp_path, nprocs):
    run = tmp_path / "run"
    kill = ["--checkpoint-every-steps", "4", "--die-rank", str(nprocs - 1), "--die-at-step", "9"]
    done, resumed = interrupt_then_resume(run, kill, nprocs)
    assert done.returncode != 0
    assert "global step 8" in resumed.stdout  # the last step checkpoint before the kill
    assert_same_run(uninterrupted[nprocs], run)


def test_without_scontrol_the_save_completes_and_exit_status_is_3(tmp_path):
    run = tmp_path / "run"
    bare_path = str(Path(sys.executable).parent)  # python, but no scontrol
    done = run_cli(*TINY, "--signal-rank", "0", "--signal-at-step", "3", *AT_ONCE,
                   "--run-dir", str(run), cwd=tmp_path, PATH=bare_path,
                   SLURM_JOB_ID="4242")  # fmt: skip
    assert done.returncode == 3
    assert "scontrol is not available here: not requeueing job 4242" in done.stdout
    assert load_file(run / "checkpoints" / "latest.pt")["global_step"] == 4


def test_repeated_preemptions_do_not_fill_the_disk(tmp_path):
    run = tmp_path / "run"
    args = [*TINY, "--epochs", "4", "--keep-last", "2", "--checkpoint-every-steps", "1",
            *AT_ONCE, "--run-dir", str(run)]  # fmt: skip
    for step in (2, 6, 10, 14, 20):
        done = run_cli(*args, "--signal-rank", "0", "--signal-at-step", str(step), cwd=tmp_path)
        assert done.returncode == 3, done.stderr
    done = run_cli(*args, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert len(list_checkpoints(run / "checkpoints")) <= 3  # keep-last 2, plus the best


def test_epochs_per_job_chain(uninterrupted, tmp_path):
    run = tmp_path / "run"
    codes = []
    for _ in range(3):
        done = run_cli(*TINY, "--epochs-per-job", "1", "--run-dir", str(run), cwd=tmp_path)
        codes.append(done.returncode)
    assert codes == [3, 3, 0]
    assert_same_run(uninterrupted[1], run)


HOROVODRUN = ["horovodrun", "--gloo", "-np", "2", "-H", "localhost:2"]


def under(launcher: str) -> list[str]:
    """The command that starts 2 processes of ``python -m dmltrain`` under ``launcher``."""
    dmltrain = [sys.executable, "-m", "dmltrain"]
    if launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                "--master_port", str(free_port()), "-m", "dmltrain"]  # fmt: skip
    require(launcher)
    return [*(MPIRUN if launcher == "mpirun" else HOROVODRUN), *dmltrain]


@pytest.fixture(scope="module")
def horovod_uninterrupted(tmp_path_factory):
    require("horovodrun")
    run = tmp_path_factory.mktemp("horovod") / "run"
    args = [*under("horovodrun"), *TINY, "--strategy", "horovod", "--run-dir", str(run)]
    done = subprocess.run(args, cwd=run.parent, env=cli_env(**own_port()), capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return run


@pytest.mark.parametrize("launcher", ["torchrun", "mpirun", "horovodrun"])
@pytest.mark.parametrize("event", ["SIGUSR1 mid-epoch", "SIGUSR1 at an epoch's last step",
                                   "kill -9 after a step checkpoint"])  # fmt: skip
def test_resume_under_each_launcher_is_bit_exact(uninterrupted, request, tmp_path, launcher,
                                                 event):  # fmt: skip
    """Dropout in the step and augmentation in the data, 2 processes under torchrun, mpirun
    and horovodrun (Horovod strategy): interrupted, then started again with the same
    command, the run ends bitwise equal to one never interrupted under that launcher (srun:
    test_slurm's preempted job; --nprocs: the tests above)."""
    run = tmp_path / "run"
    command = [*under(launcher), *TINY, "--run-dir", str(run)]
    if launcher == "horovodrun":
        command += ["--strategy", "horovod"]
    # 6 steps an epoch; the fault comes during the step taken at this global step (0-based)
    fault = {"SIGUSR1 mid-epoch": ["--signal-rank", "1", "--signal-at-step", "8", *AT_ONCE],
             "SIGUSR1 at an epoch's last step": ["--signal-rank", "0", "--signal-at-step", "11",
                                                 *AT_ONCE],
             "kill -9 after a step checkpoint": ["--checkpoint-every-steps", "4", "--die-rank",
                                                 "1", "--die-at-step", "9"]}[event]  # fmt: skip

    def start(*extra: str) -> subprocess.CompletedProcess:
        return subprocess.run([*command, *extra], cwd=tmp_path, env=cli_env(**own_port()),
                              capture_output=True, text=True, timeout=300)  # fmt: skip

    first = start(*fault)
    assert first.returncode != 0, first.stdout[-2000:]
    if event.startswith("SIGUSR1"):
        assert "checkpoint saved" in first.stdout + first.stderr, first.stderr[-2000:]
    resumed = start()
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    stopped_at = {"SIGUSR1 mid-epoch": 9, "SIGUSR1 at an epoch's last step": 12,
                  "kill -9 after a step checkpoint": 8}[event]  # fmt: skip
    assert f"global step {stopped_at}" in resumed.stdout, resumed.stdout[-2000:]
    if launcher == "horovodrun":  # Horovod sums in its own order: compared with itself
        assert_same_run(request.getfixturevalue("horovod_uninterrupted"), run)
    else:
        assert_same_run(uninterrupted[2], run)


def test_a_ctrl_c_during_the_start_ups_imports_is_raised_after_them():
    """A SIGINT inside ``deferring`` (the command's imports: raised inside torch's import
    it can abort the process) is kept, and raised when the block ends."""
    import signal as signals

    from dmltrain.runtime.preemption import StartupSignals

    previous = signals.getsignal(signals.SIGINT)
    handler = StartupSignals()
    signals.signal(signals.SIGINT, handler)
    reached = False
    try:
        with pytest.raises(KeyboardInterrupt), handler.deferring():
            os.kill(os.getpid(), signals.SIGINT)
            time.sleep(0.05)  # the handler runs here: it must not raise
            reached = True
        assert reached and handler.received == ["SIGINT"]
    finally:
        signals.signal(signals.SIGINT, previous)


def test_a_signal_while_a_finished_run_ends_leaves_its_status_zero(tmp_path):
    """SIGUSR1 to the whole --nprocs 2 run every 10 ms from its last epoch's row until it
    has exited (a scheduler's notice during the final teardown): the run is done and
    exits 0; its parent died of the signal (status 138) while the interpreter ended."""
    run = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "dmltrain", *TINY, "--nprocs", "2", "--epochs", "1",
         "--progress", "log", "--run-dir", str(run)],
        cwd=tmp_path, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, start_new_session=True,
    )  # fmt: skip
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("epoch 1/1 train_loss"):
            break
    sent = 0
    while proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGUSR1)
            sent += 1
        time.sleep(0.01)
    out = proc.stdout.read()
    assert proc.wait() == 0, out[-3000:]
    assert sent and json.loads((run / "outcome.json").read_text())["status"] == "done"

"""The benchmarks run end to end in smoke mode (each at its smallest size: the scripts run
and write their results; the numbers are not asserted, benchmarks/RESULTS.md holds a full
run's)."""

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from helpers import REQUIRE_ALL, ROOT


def run_leaving_nothing(
    module_args: list[str], timeout: int
) -> tuple[subprocess.CompletedProcess, list[str]]:
    """``python -m MODULE ARGS`` with a TMPDIR of its own; returns the run and the names of
    the benchmarks' run folders (``dmltrain-*``) it left there. The TMPDIR is directly under
    the system's temporary folder: the loader workers' AF_UNIX sockets go under it too, and
    inside tmp_path (under xdist) their paths are too long to bind (dmltrain refuses such a
    TMPDIR when its loader has workers)."""
    scratch = Path(tempfile.mkdtemp(prefix="bench-"))
    try:
        done = subprocess.run(
            [sys.executable, "-m", *module_args],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**os.environ, "TMPDIR": str(scratch)},
        )
        return done, sorted(p.name for p in scratch.glob("dmltrain-*"))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


# Every benchmark once at its smallest size, in three groups of about equal time (100-120 s
# each alone on 2 cores, 15-20 minutes as one test under the suite's load): the suite's
# workers run them side by side. Each group: its sections, and the targets it measures.
GROUPS = {
    "loop": (["overhead", "startup", "scaling", "nan_check", "threads", "checkpoint",
              "checkpoint_tiers"], 11),
    "data-and-ranks": (["data_pipeline", "collectives", "ema", "monitor", "streaming",
                        "archive_read", "big_models", "ranks", "step_counts"], 10),
    "user-commands": (["user_runs", "search_pruning"], 4),
}  # fmt: skip


@pytest.mark.timeout(1500)
@pytest.mark.parametrize("group", sorted(GROUPS))
def test_smoke_mode_writes_results_and_plot(tmp_path, group):
    names, measured = GROUPS[group]
    done, left = run_leaving_nothing(
        ["benchmarks.run", "--smoke", "--only", ",".join(names), "--out", str(tmp_path)],
        timeout=1400,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert left == []
    assert (tmp_path / "results.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    results = (tmp_path / "RESULTS.md").read_text()
    if REQUIRE_ALL:  # tests/run.sh installs benchmarks/requirements.txt
        assert "not installed" not in results
    for name in names:
        assert f"## {name}" in results, name
    targets = results.split("## Targets", 1)[1].split("\n## ", 1)[0]
    assert targets.count("| yes |") + targets.count("| NO |") >= measured, targets
    if "collectives" in names:  # computed by AgreementSchedule: the agreement within 1%
        agreement = next(line for line in targets.splitlines() if "agreement at 1,024" in line)
        assert agreement.endswith("| yes |"), agreement
    if "overhead" in names:
        for contender in ("plain", "dmltrain", "lightning", "fabric", "accelerate", "dmlcloud"):
            assert f"| {contender} |" in results, contender


def test_every_benchmark_is_in_one_group():
    from benchmarks.run import BENCHMARKS

    grouped = [name for names, _ in GROUPS.values() for name in names]
    assert sorted(grouped) == sorted(BENCHMARKS)


def test_update_reruns_one_benchmark_and_keeps_the_others(tmp_path):
    import json

    ratio = {"mnist --nprocs 2 epoch: after / before": 0.47}
    earlier = {"threads": {"markdown": "| the earlier table |", "ratios": ratio,
                           "written": "2020-01-02, full mode"}}  # fmt: skip
    (tmp_path / "results.json").write_text(json.dumps(earlier))
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.run", "--quick", "--only", "collectives", "--update",
         "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    results = (tmp_path / "RESULTS.md").read_text()
    assert "re-run: collectives, the other sections kept from earlier runs" in results
    assert "## threads\n\nRun on 2020-01-02, full mode.\n\n| the earlier table |" in results
    assert "## collectives\n\nRun on " in results and ", quick mode." in results
    assert list(json.loads((tmp_path / "results.json").read_text())) == ["threads", "collectives"]


def test_contenders_taking_turns_time_only_their_own_steps():
    """Two loops share the process in turns of 3 steps (benchmarks.common.rotate); each
    clock must time its own steps (2 ms and 20 ms of sleep), never the other's turn."""
    import time

    import torch

    from benchmarks.common import Clocked, pass_turn, rotate

    order = []

    def loop(name, seconds):
        clock = Clocked(torch.nn.Identity(), warmup=2, steps=9, device="cpu", block=3,
                        turn=pass_turn)  # fmt: skip
        for _ in range(2 + 9 + 1):
            clock(torch.zeros(1))
            order.append(name)
            time.sleep(seconds)
        return clock

    clocks = rotate({"fast": lambda: loop("fast", 0.002), "slow": lambda: loop("slow", 0.02)})
    assert 0.0015 < clocks["fast"].step_time < 0.010
    assert max(clocks["fast"].intervals) < 0.030  # slow's turns (60 ms) are not in any
    assert 0.018 < clocks["slow"].step_time < 0.040
    assert len(clocks["fast"].intervals) == 9
    # warm-up and the first 3 timed steps, then turns of 3; the last turn runs to the end
    turns = [n for i, n in enumerate(order) if i == 0 or order[i - 1] != n]
    assert turns == ["fast", "slow"] * 3


def test_overhead_phases_table(tmp_path):
    """Every phase of a step gets a number for each contender; the runs leave nothing."""
    done, left = run_leaving_nothing(
        ["benchmarks.overhead_phases", "--processes", "1", "--steps", "60"], timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert left == []
    rows = {line.split("|")[1].strip(): line.split("|")[2:-1] for line in done.stdout.splitlines()}
    assert all(float(cell) > 0 for cell in rows["plain (us)"][:5]), rows
    for row in ("plain-twin - plain", "dmltrain - plain"):
        assert len([float(cell) for cell in rows[row]]) == 6, rows  # five phases and their sum


def test_the_gpu_proof_without_a_gpu_says_so_in_one_line():
    """It runs where CUDA is (the device machine); here it refuses, one line, exit 2."""
    done = subprocess.run([sys.executable, "benchmarks/gpu_proof.py"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "gpu_proof: no CUDA device here: run it on a GPU machine"
    ]


def test_the_gpu_proofs_profile_of_a_step_runs_on_the_cpu():
    """Its part that needs no GPU to run: the plain loop and dmltrain profiled alike."""
    from benchmarks.gpu_proof import api_calls

    table = api_calls("cpu", steps=20)
    assert table.splitlines()[1] == "| call | plain loop | dmltrain |"
    # the loss dmltrain keeps for the metrics: its detach() is a call the plain loop lacks
    assert "| aten::detach |" in table, table

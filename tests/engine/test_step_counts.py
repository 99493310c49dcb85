"""What a training step asks of the device (benchmarks/step_counts.py), counted on the
CPU: no host read a step beyond the plain loop's in the configurations users run, at most
one a log interval, and a handful of operators more than the plain loop's. On a GPU each
host read stalls the queue of kernels: a change that adds one to the step fails here (the
non-fused optimizer's row shows the count seeing one)."""

import pytest

from benchmarks.step_counts import CONFIGS, DISTRIBUTED, measure

FIRST, LAST = 5, 25  # the steady steps counted
OWN_READS = {"log-every", "nan-log-every", "unfused", "nan-unfused"}  # tested one by one


@pytest.fixture(scope="module")
def counts(tmp_path_factory):
    return measure(FIRST, LAST, tmp_path_factory.mktemp("step-counts"))


def test_the_default_step_is_the_plain_loops_and_a_handful_of_operators(counts):
    plain, ours = counts["plain"], counts["defaults"]
    assert ours["reads"] == plain["reads"] == 0
    assert plain["ops"] < ours["ops"] <= plain["ops"] + 5, (plain, ours)


@pytest.mark.parametrize("config", [c for c in [*CONFIGS, *DISTRIBUTED] if c not in OWN_READS])
def test_no_configuration_reads_the_device_more_than_the_plain_loop(counts, config):
    assert counts[config]["reads"] == counts["plain"]["reads"], (config, counts[config])


@pytest.mark.parametrize("config", ["log-every", "nan-log-every"])
def test_a_log_interval_reads_the_device_once(counts, config):
    """The NaN checks' records ride with the metrics: the same one read."""
    extra = counts[config]["reads"] - counts["plain"]["reads"]
    assert extra * 10 == pytest.approx(1.0), counts[config]  # one interval in 10 steps


def test_an_optimizer_that_cannot_skip_on_the_device_waits_once_a_step(counts):
    """The fallback, and the proof that the count sees a wait added to the step: a
    non-fused Adam reads as a plain loop with it does (its step counter), and the NaN
    check's verdict is read once a step on top."""
    plain = counts["plain-unfused"]["reads"]
    assert plain > 0 and counts["unfused"]["reads"] == plain
    assert counts["nan-unfused"]["reads"] == plain + 1

import gc
import weakref

import pytest
import torch

from dmltrain import UserError
from dmltrain.engine.metrics import MetricAccumulator


def test_sample_weighted_mean_keeps_order():
    acc = MetricAccumulator("cpu")
    acc.update({"loss": torch.tensor(1.0), "acc": 0.5}, 3)
    acc.update({"loss": torch.tensor(4.0), "acc": 1.0}, 1)
    assert acc.count == 4
    result = acc.compute()
    assert list(result) == ["loss", "acc"]
    assert result["loss"] == pytest.approx((3 * 1 + 4) / 4)
    assert result["acc"] == pytest.approx((1.5 + 1.0) / 4)


def test_reduce_sees_sums_and_count_in_one_tensor():
    acc = MetricAccumulator("cpu")
    acc.update({"loss": torch.tensor(2.0)}, 2)
    seen = []

    def reduce(packed):
        seen.append(packed.clone())
        return packed * 2  # as if a second rank held the same totals

    assert acc.compute(reduce) == {"loss": pytest.approx(2.0)}
    assert torch.equal(seen[0], torch.tensor([4.0, 2.0]))


def test_empty():
    assert MetricAccumulator("cpu").compute() == {}


def test_state_dict_is_a_snapshot_and_restores():
    """A checkpoint's copy of the sums must not move on with the in-place accumulation."""
    acc = MetricAccumulator("cpu")
    acc.update({"loss": torch.tensor(1.0), "acc": 0.5}, 2)
    state = acc.state_dict()
    acc.update({"loss": torch.tensor(3.0), "acc": 1.0}, 2)
    restored = MetricAccumulator("cpu")
    restored.load_state_dict(state)
    assert restored.compute() == {"loss": pytest.approx(1.0), "acc": pytest.approx(0.5)}
    restored.update({"loss": torch.tensor(3.0), "acc": 1.0}, 2)
    assert restored.compute() == acc.compute() == {"loss": 2.0, "acc": 0.75}


def test_kept_values_are_summed_exactly_across_flushes():
    """Steps are kept and summed in groups of ``keep``: the means are those of summing every
    step at once, with the last, smaller batch weighted by its size."""
    acc = MetricAccumulator("cpu", keep=3)
    for i in range(10):
        n = 2 if i < 9 else 1
        acc.update({"loss": torch.tensor(float(i)), "acc": 0.5, "half": torch.tensor([1.5])}, n)
    assert acc.count == 19
    assert acc.compute() == {
        "loss": pytest.approx((2 * sum(range(9)) + 9) / 19),
        "acc": pytest.approx(0.5),
        "half": pytest.approx(1.5),
    }


def test_metrics_of_mixed_shapes_and_dtypes_add_up():
    """One stack for the usual steps; a metric that changes shape or dtype between steps
    (a (1,) tensor, half, integer, double) still adds, in fp32."""
    acc = MetricAccumulator("cpu", keep=4)
    values = [
        torch.tensor(1.0),
        torch.tensor([2.0]),
        torch.tensor(3.0, dtype=torch.float16),
        torch.tensor(4),
        torch.tensor(5.0, dtype=torch.float64),
        torch.tensor([[6.0]]),
    ]
    for value in values:
        acc.update({"m": value}, 1)
    assert acc.compute() == {"m": 21 / 6}
    assert acc.state_dict()["sums"]["m"].dtype == torch.float32


def test_kept_tensors_are_released_after_keep_steps():
    acc = MetricAccumulator("cpu", keep=4)
    refs = []
    for i in range(7):  # step 0 is summed at once, steps 1-4 when 4 are kept
        value = torch.tensor(float(i))
        refs.append(weakref.ref(value))
        acc.update({"loss": value}, 1)
        del value
    gc.collect()
    held = [i for i, ref in enumerate(refs) if ref() is not None]
    assert held == [5, 6]
    assert acc.compute()["loss"] == pytest.approx(3.0)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (torch.ones(3), r"'x' is a tensor of shape \(3,\).*single numbers"),
        ("high", r"'x' is a str: .*numbers or one-element tensors"),
    ],
)
def test_a_bad_metric_fails_at_the_first_step(value, message):
    acc = MetricAccumulator("cpu")
    with pytest.raises(UserError, match=message):
        acc.update({"loss": torch.tensor(1.0), "x": value}, 1)


@pytest.mark.parametrize("cut", [1, 2, 8, 9, 63, 150])
def test_a_resumed_accumulator_adds_bit_for_bit_like_one_never_interrupted(cut):
    """The groups that are summed together fall by step count alone, and the steps kept
    unsummed travel in the state: a mid-epoch resume (and reading the metrics for the
    progress line) leaves the epoch's mean bitwise the same."""
    g = torch.Generator().manual_seed(0)
    values = [torch.rand((), generator=g) * 3 for _ in range(200)]

    def run(cut=None, read_every=None):
        acc = MetricAccumulator("cpu", keep=8)
        for i, value in enumerate(values):
            if i == cut:
                state = acc.state_dict()
                acc = MetricAccumulator("cpu", keep=8)
                acc.load_state_dict(state)
            if read_every and i % read_every == 0:
                acc.compute()
            acc.update({"loss": value}, 64 if i < 199 else 5)
        return acc.compute()["loss"]

    assert run(cut=cut) == run(read_every=37) == run()


@pytest.mark.parametrize("cut", [0, 1, 2, 7, 8, 9, 17])
def test_steps_and_samples_count_the_same_after_a_resume(cut):
    """The steps and samples of the kept steps are counted when they are summed; the
    state says the whole counts at any step, and a resumed accumulator goes on from them
    (summing its kept steps at the same steps as one never interrupted)."""
    whole, resumed = MetricAccumulator("cpu", keep=8), MetricAccumulator("cpu", keep=8)
    for i in range(20):
        if i == cut:
            state = resumed.state_dict()
            assert (state["steps"], state["count"]) == (i, 3 * i)
            resumed = MetricAccumulator("cpu", keep=8)
            resumed.load_state_dict(state)
        for acc in (whole, resumed):
            acc.update({"loss": torch.tensor(float(i))}, 3)
        assert whole.count == resumed.count == 3 * (i + 1)
        assert whole.steps == resumed.steps == i + 1
        assert len(whole._kept) == len(resumed._kept) == (i % 8 if i else 0)


def test_a_state_from_before_the_kept_steps_resumes():
    """Checkpoints of older versions summed every step and saved no ``kept`` or ``steps``."""
    acc = MetricAccumulator("cpu", keep=8)
    acc.load_state_dict({"sums": {"loss": torch.tensor(6.0)}, "count": 3})
    acc.update({"loss": torch.tensor(4.0)}, 1)
    assert (acc.count, acc.steps, len(acc._kept)) == (4, 2, 1)
    assert acc.compute() == {"loss": 2.5}


@pytest.mark.parametrize("seed", [2, 4, 9])
def test_the_usual_steps_sum_bit_for_bit_as_the_general_case(seed):
    """Steps with the same metrics in the same order, one batch size and plain tensors
    are grouped and summed by a shortcut. The general path (here: the metrics' order
    changes from step to step, and the values are a tensor subclass) gives the same bits.
    Values of magnitudes far apart; with these seeds, the sums in reverse order differ."""

    class Marked(torch.Tensor):
        pass

    g = torch.Generator().manual_seed(seed)
    steps = [
        (
            torch.rand((), generator=g) * 10 ** torch.randint(-4, 5, (), generator=g),
            torch.rand(1, generator=g),
        )
        for _ in range(300)
    ]

    def run(general):
        acc = MetricAccumulator("cpu", keep=64)
        for i, (loss, other) in enumerate(steps):
            if general and i % 2:
                acc.update({"other": other.as_subclass(Marked), "loss": loss}, 64)
            else:
                acc.update({"loss": loss, "other": other}, 64)
        return acc.compute()

    shortcut, general = run(general=False), run(general=True)
    assert list(shortcut) == list(general) == ["loss", "other"]
    assert shortcut == general


def test_a_dropped_step_counts_for_nothing_and_its_flag_is_not_read():
    """The NaN checks' verdict stays on the device: a dropped step's values come in as 0
    and its samples leave the count, through a checkpoint and a merge of ranks too."""
    from dmltrain.engine.metrics import merge_states

    acc = MetricAccumulator("cpu")
    for value, bad in [(1.0, False), (float("nan"), True), (3.0, False)]:
        flag = torch.tensor(bad)
        acc.drop(flag, 2)
        acc.update({"loss": torch.where(flag, 0.0, torch.tensor(value))}, 2)
    means, rode = acc.compute_with(rider=torch.tensor([5.0, 0.0]))
    assert means == {"loss": pytest.approx(2.0)} and rode == [5.0, 0.0]
    again = MetricAccumulator("cpu")
    again.load_state_dict(acc.state_dict())
    assert again.compute() == {"loss": pytest.approx(2.0)}
    merged = MetricAccumulator("cpu")
    merged.load_state_dict(merge_states([acc.state_dict(), again.state_dict()]))
    assert merged.compute() == {"loss": pytest.approx(2.0)}

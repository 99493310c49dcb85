"""What ``--ema-decay 0.999`` costs per training step, beside what one
``torch._foreach_lerp_`` over the model's weights costs (the update it makes each step).

    python -m benchmarks.ema [--quick]

The runs with and without EMA take turns as in ``nan_check.py`` (its ``--option ema``).
"""

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks import nan_check
from dmltrain_experiments.mnist import Net


def lerp_ms(repeats: int) -> float:
    """The median time of one _foreach_lerp_ over the MNIST CNN's weights (ms)."""
    weights = [p.detach() for p in Net().parameters()]
    average = [w.clone() for w in weights]
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        torch._foreach_lerp_(average, weights, 0.001)
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def main(argv: list[str] | None = None) -> dict:
    argv = list(argv or [])
    report = nan_check.main([*argv, "--option", "ema"])
    lerp = lerp_ms(50 if "--quick" in argv else 500)
    extra = report["ms"]["on"] - report["ms"]["off"]
    line = (f"\nOne `torch._foreach_lerp_` over the CNN's weights alone: {lerp:.3f} ms (median); "
            f"EMA's extra time a step above: {extra:+.3f} ms.")  # fmt: skip
    print(line, flush=True)
    return {**report, "markdown": report["markdown"] + "\n" + line, "lerp_ms": lerp,
            "extra_ms": extra}  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1:])

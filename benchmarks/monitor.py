"""What the monitoring on by default costs per training step: the step clocks around the
loader and ``train_step``, the small collective at each log interval, the hang watchdog's
thread; against the same run with ``--no-monitor --no-hang-watchdog``.

    python -m benchmarks.monitor [--quick]

Two models: the MNIST CNN (the ratio to the step time) and the tiny model (a step that is
almost nothing but the framework's own work, so the extra time shows in microseconds).
The runs take turns as in ``nan_check.py`` (its ``--option monitor``).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks import nan_check


def main(argv: list[str] | None = None) -> dict:
    argv = list(argv or [])
    cnn = nan_check.main([*argv, "--option", "monitor", "--model", "cnn"])
    tiny = nan_check.main([*argv, "--option", "monitor", "--model", "tiny"])
    extra_us = 1000 * (tiny["ms"]["on"] - tiny["ms"]["off"])
    low, high = tiny["twin_range"]
    line = (f"\nTiny model: monitoring adds {extra_us:+.1f} us a step (identical runs land "
            f"{low:.3f}-{high:.3f}x apart).")  # fmt: skip
    print(line, flush=True)
    return {
        "markdown": cnn["markdown"] + "\n\n" + tiny["markdown"] + "\n" + line,
        "ratios": {"monitor: cnn on / off": cnn["ratios"]["monitor: on / off"],
                   "monitor: tiny on / off": tiny["ratios"]["monitor: on / off"]},
        "twin_range": cnn["twin_range"],
        "tiny_twin_range": tiny["twin_range"],
        "extra_us": extra_us,
        "ms": cnn["ms"],
    }  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1:])

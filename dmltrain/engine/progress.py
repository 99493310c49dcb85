"""What a person watching the run sees: a tqdm bar on a terminal, tqdm's widget in a
notebook (where ipywidgets is installed), log lines in batch jobs and elsewhere.

Only the main rank prints. Step metrics are read (one device sync) every ``log_every``
steps, never in between.
"""

import importlib
import importlib.util
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TextIO

from tqdm import tqdm


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def in_notebook() -> bool:
    """Whether this process runs in a Jupyter kernel (IPython's kernel shell). Forks of
    the kernel (``--nprocs`` workers started there) inherit its shell, so the kernel
    decides for them (``for_workers``)."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    return type(shell).__name__ == "ZMQInteractiveShell"


def for_workers(mode: str) -> str:
    """The display mode for ``--nprocs`` workers started from this process: in a notebook,
    log lines (a widget needs the kernel itself; a worker's lines reach the cell)."""
    return "log" if mode == "auto" and in_notebook() else mode


NOT_SHOWN = ("epoch", "step", "world_size")  # in training_log.csv, not in the epoch's line
WIDTH = 100  # an epoch's line longer than this is one line a group of columns
GROUPS = ("val_ema_", "val_", "test_")  # each its own line then; the rest with the epoch


def _group(column: str) -> str:
    return next((prefix for prefix in GROUPS if column.startswith(prefix)), "")


def epoch_lines(head: str, columns: list[tuple[str, str]]) -> list[str]:
    """``head`` and the ``(name, "name value")`` columns as one line, or where that is
    longer than ``WIDTH``, as the training columns on the head's line and each group's
    (``GROUPS``) on an indented line of its own, wrapped between columns."""
    one = " ".join([head, *(text for _, text in columns)])
    if len(one) <= WIDTH:
        return [one]
    groups: dict[str, list[str]] = {"": []}
    for name, text in columns:
        groups.setdefault(_group(name), []).append(text)
    lines = []
    for prefix, texts in groups.items():
        line = head if not prefix else " "
        for text in texts:
            if len(line) + 1 + len(text) > WIDTH and line.strip() and line != head:
                lines.append(line)
                line = " "
            line += " " + text
        lines.append(line)
    return lines


class Progress:
    def __init__(
        self,
        mode: str,
        enabled: bool,
        log_every: int,
        stream: TextIO | None = None,
        world_size: int = 1,
    ):
        self.stream = stream or sys.stdout
        self.world_size = world_size  # samples/s are counted on this rank, times this
        if mode == "auto" and in_notebook():
            mode = "notebook" if importlib.util.find_spec("ipywidgets") else "log"
        elif mode == "auto":
            mode = "bar" if sys.stderr.isatty() else "log"
        self.mode = mode if enabled else "off"
        self.enabled = enabled
        self.log_every = log_every
        self._bar: Any = None
        self._last_time = 0.0
        self._last_samples = 0

    def info(self, message: str) -> None:
        if self.enabled:
            print(message, file=self.stream, flush=True)

    def epoch(
        self, batches: Iterable[Any], epoch: int, epochs: int, total: int | None, done: int = 0
    ) -> Iterator[Any]:
        """``batches`` shown as epoch ``epoch`` of ``total`` steps; ``done``: this rank's
        samples of it before a resume (the throughput counts from there)."""
        self._epoch, self._epochs, self._total = epoch, epochs, total
        self._last_time, self._last_samples = time.perf_counter(), done
        if self.mode not in ("bar", "notebook"):
            return iter(batches)  # no generator in between: it would run at every step
        return self._bar_over(batches)

    def _bar_over(self, batches: Iterable[Any]) -> Iterator[Any]:
        bar: Any = tqdm
        if self.mode == "notebook":
            bar = importlib.import_module("tqdm.notebook").tqdm
        self._bar = bar(
            batches, total=self._total, desc=f"epoch {self._epoch}/{self._epochs}", leave=False
        )
        yield from self._bar
        self._bar.close()
        self._bar = None

    def due(self, step: int) -> bool:
        """Whether ``step`` ends a log interval: every ``log_every`` steps and the epoch's
        last (the same on every rank; the monitor's collective runs then)."""
        return step % self.log_every == 0 or step == self._total

    def step(
        self,
        step: int,
        samples: int,
        read_metrics: Callable[[], dict[str, float]],
        track: bool = False,
        extra: dict[str, float] | None = None,
    ) -> dict[str, float] | None:
        """Called after every step; at the log interval (and the epoch's last step) reads
        the metrics (one device sync), shows them with ``extra`` (the monitor's) and
        returns them with ``samples_per_s`` (all ranks together). Nothing is read when
        nobody looks (progress off, no ``track``)."""
        if (self.mode == "off" and not track) or not self.due(step):
            return None
        now = time.perf_counter()
        rate = self.world_size * (samples - self._last_samples) / max(now - self._last_time, 1e-9)
        self._last_time, self._last_samples = now, samples
        metrics = {**read_metrics(), **(extra or {})}
        if self._bar is not None:
            self._bar.set_postfix({k: _fmt(v) for k, v in metrics.items()}, refresh=False)
        elif self.mode == "log":
            shown = " ".join(f"{k} {_fmt(v)}" for k, v in metrics.items())
            of = f"/{self._total}" if self._total else ""  # a stream's length may be unknown
            self.info(
                f"epoch {self._epoch}/{self._epochs} step {step}{of} {shown} {rate:.0f} samples/s"
            )
        return {**metrics, "samples_per_s": rate}

    def epoch_summary(self, row: dict[str, Any], partial: bool = False) -> None:
        """A training-log row as a line; one from inside the epoch names its global step."""
        columns = [(k, f"{k} {_fmt(v)}") for k, v in row.items() if k not in NOT_SHOWN]
        inside = f" (step {row['step']})" if partial else ""
        self.info("\n".join(epoch_lines(f"epoch {row['epoch']}/{self._epochs}{inside}", columns)))

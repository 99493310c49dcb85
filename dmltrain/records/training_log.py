"""``training_log.csv``: one row per validation (at each epoch's end), rewritten atomically
after each; ``steps.csv``: the step scalars every ``--log-every`` steps, appended."""

import csv
import io
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dmltrain.records.files import append_own, replace_link, why_not_written, write_atomic


def write_training_log(path: Path, rows: list[dict[str, Any]]) -> None:
    """All ``rows`` (columns in order of first appearance; a missing value is empty),
    written whole or not at all (``dmltrain.records.files``)."""
    columns: list[str] = []
    for row in rows:
        columns += [key for key in row if key not in columns]
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=columns, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    write_atomic(path, buffer.getvalue())


def read_training_log(path: Path | str) -> list[dict[str, float]]:
    """The rows of a training log as floats (empty cells become NaN)."""
    with open(path, newline="") as handle:
        return [
            {key: float(value) if value != "" else float("nan") for key, value in row.items()}
            for row in csv.DictReader(handle)
        ]


class StepsLog:
    """``RUN_DIR/steps.csv`` (rank 0): a row of step scalars (loss and the step's metrics,
    lr, samples/s, the gradient norm when clipping) every ``--log-every`` steps, so a run
    without wandb can be plotted by step; and the scalars ``log_metrics`` gives, in the
    row of their step. A resumed run first drops the rows after its checkpoint's step (a
    run killed after its last checkpoint logged steps it retrains)."""

    def __init__(self, path: Path, resumed_at: int, warn: Callable[[str], None] = print) -> None:
        self.path, self.warn, self.warned = path, warn, False
        self.columns: list[str] | None = None
        self._pending: dict[int, dict[str, Any]] = {}  # log_metrics' rows, by step
        replace_link(path, warn)
        if path.is_file():
            with open(path, newline="") as handle:
                reader = csv.DictReader(handle)
                rows = list(reader)
                self.columns = list(reader.fieldnames or []) or None
            kept = [row for row in rows if float(row["step"]) <= resumed_at]
            if len(kept) != len(rows) and self.columns:
                self._write(kept, "w")

    def _write(self, rows: list[dict[str, Any]], mode: str) -> None:
        """Rows appended whole or not at all: a failed append (a full disk) is cut off
        again and said once; training goes on."""
        assert self.columns is not None
        buffer = io.StringIO()
        writer = csv.DictWriter(
            buffer, fieldnames=self.columns, extrasaction="ignore", lineterminator="\n"
        )
        if mode == "w":
            writer.writeheader()
        writer.writerows(rows)
        try:
            append_own(self.path, buffer.getvalue().encode(), rewrite=mode == "w")
        except OSError as exc:
            self._not_written(exc)

    def _not_written(self, exc: OSError) -> None:
        if not self.warned:
            self.warned = True
            self.warn(
                f"{why_not_written(self.path, exc)}; its rows are left out until there is "
                "room again, training goes on"
            )

    def add(self, step: int, epoch: int, values: dict[str, float]) -> None:
        """Scalars logged at ``step`` (``log_metrics``): written with the next row, in it
        when it is of the same step, else as a row of their own before it."""
        self._pending.setdefault(step, {"step": step, "epoch": epoch}).update(values)

    def write(self, row: dict[str, Any] | None = None) -> None:
        """``row`` (a log interval's; None: only what ``add`` holds), after the logged rows
        of earlier steps. A new column rewrites the file with it: no value is left out."""
        rows = [self._pending.pop(step) for step in sorted(self._pending)]
        if row is not None:
            if rows and rows[-1]["step"] == row["step"]:
                row = {**rows.pop(), **row}
            rows.append(row)
        if not rows:
            return
        new = [key for r in rows for key in r if key not in (self.columns or [])]
        if self.columns is None:
            self.columns = list(dict.fromkeys(new))
            self._write(rows, "w")
        elif new:
            self.columns += list(dict.fromkeys(new))
            self._write(self._read() + rows, "w")
        else:
            self._write(rows, "a")

    def _read(self) -> list[dict[str, Any]]:
        """The rows written so far (to write them again under more columns)."""
        if not self.path.is_file():
            return []
        with open(self.path, newline="") as handle:
            return list(csv.DictReader(handle))

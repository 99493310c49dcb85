"""``training_log.csv``: one row per epoch, rewritten atomically after each epoch."""

import csv
import io
import os
from pathlib import Path
from typing import Any


class TrainingLog:
    def __init__(self, path: Path, rows: list[dict[str, Any]] | None = None) -> None:
        self.path = path
        self.rows: list[dict[str, Any]] = list(rows or [])

    def append(self, row: dict[str, Any]) -> None:
        self.rows.append(row)
        self.write()

    def write(self) -> None:
        columns: list[str] = []
        for row in self.rows:
            columns += [key for key in row if key not in columns]
        buffer = io.StringIO()
        writer = csv.DictWriter(buffer, fieldnames=columns, lineterminator="\n")
        writer.writeheader()
        writer.writerows(self.rows)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(buffer.getvalue())
        os.replace(tmp, self.path)


def read_training_log(path: Path | str) -> list[dict[str, float]]:
    """The rows of a training log as floats (empty cells become NaN)."""
    with open(path, newline="") as handle:
        return [
            {key: float(value) if value != "" else float("nan") for key, value in row.items()}
            for row in csv.DictReader(handle)
        ]

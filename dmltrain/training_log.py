"""``training_log.csv``: one row per epoch, rewritten atomically after each epoch."""

import csv
import io
import os
from pathlib import Path
from typing import Any


def write_training_log(path: Path, rows: list[dict[str, Any]]) -> None:
    """All ``rows`` (columns in order of first appearance; a missing value is empty),
    written to a temporary file and renamed over ``path``."""
    columns: list[str] = []
    for row in rows:
        columns += [key for key in row if key not in columns]
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=columns, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(buffer.getvalue())
    os.replace(tmp, path)


def read_training_log(path: Path | str) -> list[dict[str, float]]:
    """The rows of a training log as floats (empty cells become NaN)."""
    with open(path, newline="") as handle:
        return [
            {key: float(value) if value != "" else float("nan") for key, value in row.items()}
            for row in csv.DictReader(handle)
        ]

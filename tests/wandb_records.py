"""Read what a real offline wandb run logged, from its ``run-<id>.wandb`` file.

wandb 0.31 has no Python reader for these files. The format is a LevelDB-log-style
stream: a 7-byte header (``:W&B``, a 2-byte magic, a 1-byte version), then 32 KiB blocks
of records, each with a 7-byte header (4-byte checksum, 2-byte little-endian length,
1-byte type: 1 full, 2 first, 3 middle, 4 last) and a payload that is (a piece of) a
``wandb_internal_pb2.Record``.
"""

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path

from wandb.proto import wandb_internal_pb2 as pb

BLOCK = 32 * 1024
HEADER = 7


def records(path: Path) -> list[pb.Record]:
    data = path.read_bytes()
    out, pending, pos = [], b"", HEADER
    while pos + HEADER <= len(data):
        left_in_block = BLOCK - pos % BLOCK
        if left_in_block < HEADER:  # trailer padding
            pos += left_in_block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + HEADER])
        payload = data[pos + HEADER : pos + HEADER + length]
        pos += HEADER + length
        if kind == 0 and length == 0:
            continue
        pending = payload if kind in (1, 2) else pending + payload
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending)
            out.append(record)
            pending = b""
    return out


@dataclass
class OfflineRun:
    run_id: str = ""
    config: dict = field(default_factory=dict)
    history: list[dict] = field(default_factory=list)
    summary: dict = field(default_factory=dict)
    preempting: bool = False


def _key(item) -> str:
    return "/".join(item.nested_key) if item.nested_key else item.key


def read_run(path: Path) -> OfflineRun:
    run = OfflineRun()
    for record in records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run.run_id = record.run.run_id
            for item in record.run.config.update:
                run.config[_key(item)] = json.loads(item.value_json)
        elif kind == "config":
            for item in record.config.update:
                run.config[_key(item)] = json.loads(item.value_json)
        elif kind == "history":
            row = {_key(item): json.loads(item.value_json) for item in record.history.item}
            run.history.append(row)
        elif kind == "summary":
            for item in record.summary.update:
                run.summary[_key(item)] = json.loads(item.value_json)
        elif kind == "preempting":
            run.preempting = True
    return run


def runs_in(run_dir: Path) -> list[Path]:
    """The .wandb files under a dmltrain run directory, oldest first."""
    return sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))

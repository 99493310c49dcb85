"""How long a checkpoint save blocks the training loop.

    python benchmarks/checkpoint.py            # ~100M parameters + Adam state (~1.2 GB)
    python benchmarks/checkpoint.py --quick    # ~10M parameters, for a smoke test

The asynchronous save copies the state into the buffers of the previous asynchronous save
(the first one allocates them): repetitions after the first measure the steady state.

Contenders, interleaved (A B C D, A B C D, ...) and reported as the median of the
repetitions: the disk's raw write speed (``dd`` with fsync: the physical limit),
``torch.save`` of the same state (no fsync, no rename), dmltrain's synchronous save
(fsync + rename + links), and dmltrain's asynchronous save (the loop waits only for the
copy of the state; the write finishes in a background thread).
"""

import argparse
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from dmltrain.checkpoint.storage import CheckpointDir


def make_state(hidden: int, layers: int) -> tuple[dict, int]:
    model = nn.Sequential(*[nn.Linear(hidden, hidden) for _ in range(layers)])
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(2, hidden)).sum().backward()
    optimizer.step()  # Adam state: two more tensors per parameter
    params = sum(p.numel() for p in model.parameters())
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict()}, params


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a ~10M-parameter model")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    args = parser.parse_args(argv)
    hidden, layers = (1024, 10) if args.quick else (4096, 6)
    state, params = make_state(hidden, layers)
    root = Path(args.dir or tempfile.mkdtemp(prefix="dmltrain-bench-"))
    plain = root / "plain.pt"
    torch.save(state, plain)
    size_mb = plain.stat().st_size / 2**20
    sync_dir = CheckpointDir(root / "sync", keep_last=1)
    async_dir = CheckpointDir(root / "async", keep_last=1, asynchronous=True)
    results: dict[str, list[float]] = {k: [] for k in ("dd", "torch.save", "sync", "async")}
    async_total = []
    for rep in range(args.repeats):
        results["dd"].append(
            timed(
                lambda: subprocess.run(
                    [
                        "dd",
                        "if=/dev/zero",
                        f"of={root / 'dd.bin'}",
                        "bs=1M",
                        f"count={int(size_mb)}",
                        "conv=fsync",
                    ],
                    check=True,
                    capture_output=True,
                )
            )
        )
        results["torch.save"].append(timed(lambda: torch.save(state, plain)))
        results["sync"].append(timed(lambda r=rep: sync_dir.save(state, r, r, best=False)))
        started = time.perf_counter()
        results["async"].append(timed(lambda r=rep: async_dir.save(state, r, r, best=False)))
        async_dir.wait()
        async_total.append(time.perf_counter() - started)
    sync = statistics.median(results["sync"])
    lines = [
        f"checkpoint: {params / 1e6:.0f}M parameters + Adam state, {size_mb:.0f} MiB, "
        f"median of {args.repeats}, interleaved",
        "| what | blocking time (s) | vs dmltrain sync |",
        "|---|---|---|",
    ]
    labels = {
        "dd": "dd (raw disk write, fsync)",
        "torch.save": "torch.save (no fsync)",
        "sync": "dmltrain sync save",
        "async": "dmltrain async save",
    }
    for name, label in labels.items():
        median = statistics.median(results[name])
        lines.append(f"| {label} | {median:.3f} | {median / sync:.2f}x |")
    total = statistics.median(async_total)
    lines.append(f"| dmltrain async, until on disk | {total:.3f} | {total / sync:.2f}x |")
    shutil.rmtree(root, ignore_errors=True)
    text = "\n".join(lines)
    print(text, flush=True)
    ratio = statistics.median(results["async"]) / sync
    return {"markdown": text, "ratios": {"checkpoint: async / sync blocking": ratio}}


if __name__ == "__main__":
    main()

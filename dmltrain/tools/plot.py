"""``dmltrain plot RUN_DIR``: the loss and metric curves of ``training_log.csv`` as a PNG,
and beside them, where the run wrote them: the step scalars of ``steps.csv`` by step, the
throughput and the share of time spent waiting for data, and each rank's own time a step
(``ranks.csv``). Of a sweep's directory (``dmltrain sweep``): every trial's validation
curves in one figure, a panel a metric; of a search's, Optuna's plots too (``search.plot``)."""

import csv
from pathlib import Path
from typing import Any

from dmltrain.errors import UserError
from dmltrain.records.training_log import read_training_log
from dmltrain.tools import search
from dmltrain.tools.sweep import Sweep

SIZE = (12.0, 4.5)  # inches; at DPI this is the PNG's size in pixels
DPI = 100
NOT_CURVES = {"epoch", "step", "lr", "epoch_time_s", "skipped_steps", "world_size"}
BY_STEP = ("loss", "grad_norm")  # of steps.csv, when there


def plot_run(run_dir: Path, output: Path | None = None) -> list[Path]:
    """Write ``training_curves.png`` (or ``output``), or a sweep's figures; the files
    written, or a UserError if there is nothing to plot."""
    if (run_dir / "sweep.json").is_file():
        sweep = Sweep(run_dir)
        curves = plot_sweep(sweep, output)
        return [curves, *search.plot(sweep)] if sweep.searching() else [curves]
    log = run_dir / "training_log.csv"
    if not log.is_file():
        raise UserError(f"{log} does not exist: pass a run directory (--run-dir of a run)")
    try:
        rows = read_training_log(log)
    except ValueError as exc:
        raise UserError(f"{log} holds a value that is not a number ({exc})") from None
    if not rows:
        raise UserError(f"{log} has no epochs yet: nothing to plot")
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    epochs = [row["epoch"] for row in rows]
    columns = [c for c in rows[0] if c not in NOT_CURVES]
    losses = [c for c in columns if c.endswith("loss")]
    others = [c for c in columns if c not in losses] or ["lr"]
    steps = _rows(run_dir / "steps.csv")
    ranks = _rows(run_dir / "ranks.csv")
    throughput = bool(steps) and "samples_per_s" in steps[0]
    panels = 2 + bool(steps) + throughput + bool(ranks)
    figure, axes = plt.subplots(1, panels, figsize=(SIZE[0] / 2 * panels, SIZE[1]), dpi=DPI)
    extra = iter(axes[2:])
    if steps:
        by_step = next(extra)
        for name in (n for n in BY_STEP if n in steps[0]):
            by_step.plot([r["step"] for r in steps], [r[name] for r in steps], label=name)
        _finish(by_step, "steps.csv")
    if throughput:  # samples/s, and the share of time spent waiting for data
        axis = next(extra)
        x = [r["step"] for r in steps]
        axis.plot(x, [r["samples_per_s"] for r in steps], label="samples/s")
        if "data_wait" in steps[0]:
            wait = axis.twinx()
            wait.plot(x, [r["data_wait"] for r in steps], color="tab:red", label="data wait")
            wait.set_ylim(0, 1)
            wait.set_ylabel("data wait (share)", color="tab:red")
        _finish(axis, "throughput")
    if ranks:  # each rank's own time a step (data wait + train_step)
        axis = next(extra)
        for rank in sorted({int(r["rank"]) for r in ranks}):
            mine = [r for r in ranks if int(r["rank"]) == rank]
            axis.plot(
                [r["step"] for r in mine],
                [1e3 * (r["data_wait_s"] + r["compute_s"]) for r in mine],
                label=f"rank {rank}",
            )
        axis.set_ylabel("ms a step (data wait + train_step)")
        _finish(axis, "ranks.csv", legend=len(axis.lines) <= 16)
    left, right = axes[0], axes[1]
    for axis, names, title in ((left, losses, "loss"), (right, others, "metrics")):
        for name in names:
            axis.plot(epochs, [row.get(name) for row in rows], marker="o", label=name)
        axis.set_xlabel("epoch")
        axis.xaxis.set_major_locator(MaxNLocator(integer=True))
        axis.set_title(title)
        axis.grid(alpha=0.3)
        if names:
            axis.legend()
    return [_save(figure, run_dir.name, output or run_dir / "training_curves.png")]


def plot_sweep(sweep: Sweep, output: Path | None = None) -> Path:
    """``sweep_curves.png`` (or ``output``): each validation metric by epoch, a line per
    trial that has validated, labelled with its options."""
    sweep_dir, logs = sweep.directory, {}
    for i in range(sweep.count()):
        options = sweep.options(i)
        log = sweep_dir / f"trial-{i}" / "training_log.csv"
        rows = read_training_log(log) if log.is_file() else []
        if rows:
            label = f"{i}: " + ", ".join(f"{k}={v}" for k, v in options.items())
            logs[label] = rows
    if not logs:
        raise UserError(f"no trial of {sweep_dir} has validated yet: nothing to plot")
    metrics = sorted({c for rows in logs.values() for c in rows[0] if c.startswith("val_")})
    if not metrics:
        raise UserError(f"the trials of {sweep_dir} log no val_ metric: nothing to plot")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = len(metrics)
    figure, axes = plt.subplots(
        1, panels, figsize=(SIZE[0] / 2 * panels, SIZE[1]), dpi=DPI, squeeze=False
    )
    for axis, metric in zip(axes[0], metrics, strict=True):
        for label, rows in logs.items():
            axis.plot(
                [r["epoch"] for r in rows], [r.get(metric) for r in rows], marker="o", label=label
            )
        axis.set_xlabel("epoch")
        axis.set_title(metric)
        axis.grid(alpha=0.3)
        axis.legend(fontsize="small")
    return _save(figure, sweep_dir.name, output or sweep_dir / "sweep_curves.png")


def _save(figure: Any, title: str, output: Path) -> Path:
    """The figure, titled, written to ``output`` and closed."""
    import matplotlib.pyplot as plt

    figure.suptitle(title)
    figure.tight_layout()
    try:
        figure.savefig(output, dpi=DPI)
    except OSError as exc:
        raise UserError(f"cannot write {output}: {exc.strerror or exc}") from None
    finally:
        plt.close(figure)
    return output


def _finish(axis: Any, title: str, legend: bool = True) -> None:
    axis.set_xlabel("step")
    axis.set_title(title)
    axis.grid(alpha=0.3)
    if legend:
        axis.legend()


def _rows(path: Path) -> list[dict[str, float]]:
    """A CSV's numeric columns (``host`` and other text left out); a row cut short (a run
    that stopped while writing it) is left out."""
    if not path.is_file():
        return []
    with open(path, newline="") as handle:
        reader = csv.DictReader(handle)
        rows = [row for row in reader if None not in row.values()]
    try:
        return [{k: float(v) for k, v in row.items() if v and k != "host"} for row in rows]
    except ValueError as exc:
        raise UserError(f"{path} holds a value that is not a number ({exc})") from None

"""``dmltrain plot RUN_DIR``: the loss and metric curves of ``training_log.csv`` as a PNG,
and the step scalars of ``steps.csv`` by step beside them where the run wrote it."""

import csv
from pathlib import Path

from dmltrain.errors import UserError
from dmltrain.training_log import read_training_log

SIZE = (12.0, 4.5)  # inches; at DPI this is the PNG's size in pixels
DPI = 100
NOT_CURVES = {"epoch", "step", "lr", "epoch_time_s", "skipped_steps", "world_size"}
BY_STEP = ("loss", "grad_norm")  # of steps.csv, when there


def plot_run(run_dir: Path, output: Path | None = None) -> Path:
    """Write ``training_curves.png`` (or ``output``); a UserError if there is nothing to plot."""
    log = run_dir / "training_log.csv"
    if not log.is_file():
        raise UserError(f"{log} does not exist: pass a run directory (--run-dir of a run)")
    rows = read_training_log(log)
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
    steps = _steps(run_dir / "steps.csv")
    panels = 3 if steps else 2
    figure, axes = plt.subplots(1, panels, figsize=(SIZE[0] / 2 * panels, SIZE[1]), dpi=DPI)
    if steps:
        by_step = axes[2]
        for name in (n for n in BY_STEP if n in steps[0]):
            by_step.plot([r["step"] for r in steps], [r[name] for r in steps], label=name)
        by_step.set_xlabel("step")
        by_step.set_title("steps.csv")
        by_step.grid(alpha=0.3)
        by_step.legend()
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
    figure.suptitle(run_dir.name)
    figure.tight_layout()
    output = output or run_dir / "training_curves.png"
    figure.savefig(output, dpi=DPI)
    plt.close(figure)
    return output


def _steps(path: Path) -> list[dict[str, float]]:
    if not path.is_file():
        return []
    with open(path, newline="") as handle:
        return [{k: float(v) for k, v in row.items() if v} for row in csv.DictReader(handle)]

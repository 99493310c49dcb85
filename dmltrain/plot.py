"""``dmltrain plot RUN_DIR``: the loss and metric curves of ``training_log.csv`` as a PNG."""

from pathlib import Path

from dmltrain.errors import UserError
from dmltrain.training_log import read_training_log

SIZE = (12.0, 4.5)  # inches; at DPI this is the PNG's size in pixels
DPI = 100
NOT_CURVES = {"epoch", "lr", "epoch_time_s", "skipped_steps"}


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
    figure, (left, right) = plt.subplots(1, 2, figsize=SIZE, dpi=DPI)
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

"""Configuration: one frozen dataclass per concern, composed into ``TrainConfig``.

Every field carries its ``help`` text (used for the CLI flag) and is validated in
``__post_init__``. ``TrainConfig`` inherits the concern dataclasses, so its fields are
flat: ``TrainConfig(epochs=3, data_dir="data")``, ``--epochs 3``, and ``epochs: 3`` in a
config file all name the same setting.

Config files (YAML or JSON) hold a flat mapping of field names (``batch_size`` or
``batch-size``) to values; experiment options live in the same mapping.
"""

import dataclasses
import json
import signal
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from dmltrain.errors import ConfigError, first_line


def check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


@dataclass(frozen=True)
class LoopConfig:
    """The training loop: length, batch, optimiser defaults, seed, logging."""

    epochs: int = field(default=10, metadata={"help": "number of training epochs"})
    batch_size: int = field(
        default=64,
        metadata={"help": "batch size per process (global batch = batch size x world size)"},
    )
    lr: float = field(default=1e-3, metadata={"help": "learning rate of the default optimizer"})
    optimizer: Literal["adam", "adamw", "sgd"] = field(
        default="adam",
        metadata={"help": "default optimizer, used unless create_optimizer is overridden"},
    )
    weight_decay: float = field(
        default=0.0, metadata={"help": "weight decay of the default optimizer"}
    )
    seed: int = field(default=0, metadata={"help": "random seed (model init, data order, dropout)"})
    run_dir: str | None = field(
        default=None,
        metadata={
            "help": "directory for everything the run writes "
            "(default: runs/<experiment>-<job id or time>)"
        },
    )
    log_every: int = field(default=50, metadata={"help": "report training metrics every N steps"})
    progress: Literal["auto", "bar", "log", "off"] = field(
        default="auto",
        metadata={"help": "progress display: a bar on a terminal, log lines otherwise (auto)"},
    )

    def __post_init__(self) -> None:
        check(self.epochs >= 1, f"--epochs must be at least 1 (got {self.epochs})")
        check(self.batch_size >= 1, f"--batch-size must be at least 1 (got {self.batch_size})")
        check(self.lr > 0, f"--lr must be positive (got {self.lr})")
        check(self.weight_decay >= 0, f"--weight-decay must be >= 0 (got {self.weight_decay})")
        check(self.log_every >= 1, f"--log-every must be at least 1 (got {self.log_every})")
        check(self.run_dir != "", "--run-dir must not be empty")


@dataclass(frozen=True)
class DataConfig:
    """Where data lives and how it is loaded."""

    data_dir: str = field(default="data", metadata={"help": "directory holding the dataset"})
    num_workers: int = field(
        default=0,
        metadata={"help": "DataLoader worker processes (0 loads in the training process)"},
    )

    def __post_init__(self) -> None:
        check(self.num_workers >= 0, f"--num-workers must be >= 0 (got {self.num_workers})")


@dataclass(frozen=True)
class DistConfig:
    """How processes are started and talk to each other."""

    launcher: Literal["auto", "single", "spawn", "torchrun", "slurm", "mpi", "horovod"] = field(
        default="auto", metadata={"help": "how this process was started (auto: detect)"}
    )
    nprocs: int = field(
        default=1, metadata={"help": "start N local worker processes (no external launcher)"}
    )
    threads: int = field(
        default=0,
        metadata={
            "help": "CPU threads per process (0: OMP_NUM_THREADS if you set it, else this "
            "process's share of the cores it may run on, less one per loader worker)"
        },
    )
    strategy: Literal["auto", "single", "ddp", "fsdp", "horovod"] = field(
        default="auto", metadata={"help": "auto: horovod under horovodrun, ddp for >1 process"}
    )
    backend: Literal["auto", "nccl", "gloo", "mpi"] = field(
        default="auto", metadata={"help": "collective backend (auto: nccl with CUDA, else gloo)"}
    )
    dist_timeout: float = field(
        default=60.0,
        metadata={"help": "seconds a rank waits for the others before giving up"},
    )
    status_file: str | None = field(
        default=None,
        metadata={
            "help": "rank 0 writes its exit status to this file (torchrun reports every "
            "worker failure as 1; the batch scripts read the status from here)"
        },
    )

    def __post_init__(self) -> None:
        check(self.nprocs >= 1, f"--nprocs must be at least 1 (got {self.nprocs})")
        check(self.threads >= 0, f"--threads must be >= 0 (got {self.threads})")
        check(self.dist_timeout > 0, f"--dist-timeout must be positive (got {self.dist_timeout})")


@dataclass(frozen=True)
class CheckpointConfig:
    """When checkpoints are written, what a run resumes from, how it survives preemption."""

    resume: str = field(
        default="auto",
        metadata={
            "help": "auto: continue the run directory's latest checkpoint if any; "
            "never; or a checkpoint PATH"
        },
    )
    checkpoint_every_steps: int = field(
        default=0, metadata={"help": "also save every N optimizer steps (0: off)"}
    )
    checkpoint_every_minutes: float = field(
        default=0.0, metadata={"help": "also save every M minutes (0: off)"}
    )
    keep_last: int = field(
        default=3, metadata={"help": "keep the newest K checkpoints (and the best); 0 keeps all"}
    )
    async_checkpoint: bool = field(
        default=False,
        metadata={
            "help": "write checkpoints in a background thread (the loop only waits "
            "for a copy of the state)"
        },
    )
    checkpoint_format: Literal["auto", "full", "sharded"] = field(
        default="auto",
        metadata={
            "help": "full: one file written by rank 0; sharded: every rank writes its shards "
            "(torch.distributed.checkpoint; 'dmltrain consolidate' makes one file); "
            "auto: sharded with --strategy fsdp, else full"
        },
    )
    best_metric: str = field(
        default="val_loss", metadata={"help": "metric of the training log that picks best.pt"}
    )
    best_mode: Literal["min", "max"] = field(
        default="min", metadata={"help": "whether a smaller or larger best metric is better"}
    )
    load_weights: str | None = field(
        default=None,
        metadata={"help": "start from this checkpoint's model weights (fine-tuning)"},
    )
    load_optimizer: bool = field(
        default=False, metadata={"help": "with --load-weights: also load the optimizer state"}
    )
    load_scheduler: bool = field(
        default=False, metadata={"help": "with --load-weights: also load the LR scheduler state"}
    )
    load_scaler: bool = field(
        default=False, metadata={"help": "with --load-weights: also load the grad scaler state"}
    )
    load_epoch: bool = field(
        default=False,
        metadata={"help": "with --load-weights: also continue its epoch and step counters"},
    )
    epochs_per_job: int = field(
        default=0,
        metadata={
            "help": "train at most N epochs in this job, then exit with status 3 "
            "(requeue) until --epochs are done (0: no limit)"
        },
    )
    preempt_signals: str = field(
        default="SIGTERM,SIGUSR1,SIGINT",
        metadata={"help": "signals that mean: checkpoint at a step boundary soon after and exit"},
    )
    preempt_check_seconds: float = field(
        default=0.5,
        metadata={
            "help": "how often the ranks agree on a signal or a --checkpoint-every-minutes "
            "save, in seconds of training (a small collective at a step boundary; 0: at "
            "every step)"
        },
    )
    requeue: bool = field(
        default=True,
        metadata={"help": "do not run 'scontrol requeue' after a preemption checkpoint"},
    )
    stop_before_end_minutes: float = field(
        default=5.0,
        metadata={"help": "under Slurm, checkpoint and exit this long before the time limit"},
    )

    def __post_init__(self) -> None:
        check(self.checkpoint_every_steps >= 0, "--checkpoint-every-steps must be >= 0")
        check(self.checkpoint_every_minutes >= 0, "--checkpoint-every-minutes must be >= 0")
        check(self.keep_last >= 0, f"--keep-last must be >= 0 (got {self.keep_last})")
        check(self.epochs_per_job >= 0, "--epochs-per-job must be >= 0")
        check(self.resume != "", "--resume must be auto, never or a checkpoint path")
        check(self.preempt_check_seconds >= 0, "--preempt-check-seconds must be >= 0")
        names = [n.strip() for n in self.preempt_signals.split(",") if n.strip()]
        for name in names:
            check(
                name in signal.Signals.__members__,
                f"--preempt-signals: {name} is not a signal name (e.g. SIGUSR1)",
            )


@dataclass(frozen=True)
class PrecisionConfig:
    """Numeric precision, gradient handling and NaN checks."""

    precision: Literal["fp32", "fp16", "bf16"] = field(
        default="fp32",
        metadata={"help": "fp16 (autocast with a grad scaler), bf16 (autocast) or fp32"},
    )
    grad_clip: float = field(
        default=0.0, metadata={"help": "clip the gradient norm to this value (0: off)"}
    )
    grad_accum: int = field(
        default=1, metadata={"help": "accumulate gradients of N batches per optimizer step"}
    )
    compile: bool = field(default=False, metadata={"help": "compile the model (torch.compile)"})
    check_nans: bool = field(
        default=False,
        metadata={"help": "check loss, gradients and parameters for NaN/Inf every step"},
    )
    on_nan: Literal["raise", "skip", "rollback"] = field(
        default="raise",
        metadata={
            "help": "with --check-nans: stop (raise), drop the step on every rank (skip), or "
            "reload the last good checkpoint and go on past the bad batch (rollback)"
        },
    )
    detect_anomaly: bool = field(
        default=False, metadata={"help": "autograd anomaly mode (slow; for debugging)"}
    )

    def __post_init__(self) -> None:
        check(self.grad_clip >= 0, f"--grad-clip must be >= 0 (got {self.grad_clip})")
        check(self.grad_accum >= 1, f"--grad-accum must be at least 1 (got {self.grad_accum})")


@dataclass(frozen=True)
class TrackingConfig:
    """Experiment tracking with Weights & Biases (rank 0 only)."""

    wandb_mode: Literal["auto", "disabled", "offline", "online"] = field(
        default="auto",
        metadata={"help": "auto: follow WANDB_MODE if it is set, else disabled"},
    )
    wandb_project: str | None = field(
        default=None, metadata={"help": "wandb project (default: the experiment's name)"}
    )
    wandb_entity: str | None = field(default=None, metadata={"help": "wandb team or user"})
    wandb_name: str | None = field(
        default=None, metadata={"help": "run name (default: the run directory's name)"}
    )
    wandb_group: str | None = field(default=None, metadata={"help": "group runs together"})
    wandb_tags: str = field(default="", metadata={"help": "comma-separated tags"})
    wandb_init_timeout: float = field(
        default=60.0, metadata={"help": "seconds to wait for wandb to start before giving up"}
    )

    def __post_init__(self) -> None:
        check(self.wandb_init_timeout > 0, "--wandb-init-timeout must be positive")


# The concern dataclasses, in the order their flag groups appear in --help.
CONCERNS: tuple[tuple[str, type], ...] = (
    ("training", LoopConfig),
    ("data", DataConfig),
    ("precision", PrecisionConfig),
    ("distributed", DistConfig),
    ("checkpointing", CheckpointConfig),
    ("tracking", TrackingConfig),
)


@dataclass(frozen=True)
class TrainConfig(
    LoopConfig, DataConfig, PrecisionConfig, DistConfig, CheckpointConfig, TrackingConfig
):
    """Everything ``BaseTrainer`` needs: the union of the concern dataclasses."""

    def __post_init__(self) -> None:
        for _, concern in CONCERNS:
            concern.__post_init__(self)  # type: ignore[attr-defined]


def field_names(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def coerce(value: Any, annotation: Any, key: str, source: str) -> Any:
    """Convert a value read from a config file to a field's type, or explain why not."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(annotation) if a is not type(None)]
        if value is None:
            return None
        return coerce(value, options[0], key, source)
    if origin is Literal:
        choices = typing.get_args(annotation)
        if value not in choices:
            raise ConfigError(f"{source}: '{key}' must be one of {list(choices)} (got {value!r})")
        return value
    ok = {
        bool: isinstance(value, bool),
        int: isinstance(value, int) and not isinstance(value, bool),
        float: isinstance(value, (int, float)) and not isinstance(value, bool),
        str: isinstance(value, str),
    }.get(annotation, True)
    if not ok:
        name = getattr(annotation, "__name__", str(annotation))
        raise ConfigError(f"{source}: '{key}' must be of type {name} (got {value!r})")
    return float(value) if annotation is float else value


def load_config_file(path: str, classes: list[type]) -> dict[str, Any]:
    """Read a flat YAML/JSON mapping and check every key against the given dataclasses."""
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        text = file.read_text()
        data = json.loads(text) if file.suffix == ".json" else yaml.safe_load(text)
    except (OSError, ValueError, yaml.YAMLError) as exc:
        raise ConfigError(f"config file {path} cannot be parsed: {first_line(exc, None)}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of option names to values")
    hints = {}
    for cls in classes:
        hints.update(typing.get_type_hints(cls))
    values = {}
    for raw_key, value in data.items():
        key = str(raw_key).replace("-", "_")
        if key not in hints or key == "config":
            known = ", ".join(sorted(hints))
            raise ConfigError(f"config file {path}: unknown key '{raw_key}' (known keys: {known})")
        values[key] = coerce(value, hints[key], str(raw_key), f"config file {path}")
    return values


def to_yaml(groups: list[tuple[str, Any]]) -> str:
    """The resolved config as flat YAML, one commented section per concern; loadable by --config."""
    parts = []
    for title, instance in groups:
        names = (
            [f.name for f in dataclasses.fields(instance)]
            if dataclasses.is_dataclass(instance)
            else []
        )
        section = {name: getattr(instance, name) for name in names}
        if section:
            parts.append(f"# {title}\n" + yaml.safe_dump(section, sort_keys=False))
    return "\n".join(parts)


def section(instance: Any, cls: type) -> Any:
    """The part of ``instance`` (a TrainConfig) that belongs to concern ``cls``, as ``cls``."""
    return cls(**{name: getattr(instance, name) for name in field_names(cls)})


def as_plain(config: Any, options: Any) -> dict[str, Any]:
    """The resolved config as plain values: training settings and experiment options (what
    checkpoints, diagnostics and the tracker record)."""
    plain = {}
    if dataclasses.is_dataclass(options) and not isinstance(options, type):
        plain = dataclasses.asdict(options)
    return {"train": dataclasses.asdict(config), "options": plain}

"""Configuration: one frozen dataclass per section, and ``TrainConfig`` made of them.

Every field carries its ``help`` text (used for the CLI flag) and is validated in
``__post_init__``. Each component receives its own section (``config.checkpoint`` for the
checkpointer). Names stay flat for people: ``TrainConfig(epochs=3, data_dir="data")``,
``config.epochs``, ``--epochs 3`` and ``epochs: 3`` in a config file name the same
setting, because no two sections share a field name.

Config files (YAML or JSON) hold a flat mapping of field names (``batch_size`` or
``batch-size``) to values; experiment options live in the same mapping (``files``).
"""

import argparse
import dataclasses
import math
import re
import signal
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

from dmltrain import plugins
from dmltrain.errors import ConfigError

# --num-workers auto: at most this many loader workers a process (runtime.threads)
MAX_AUTO_WORKERS = 8
# The agreements on stopping take at most this share of training time, at intervals of at
# most this many seconds (runtime.preemption.AgreementSchedule).
AGREEMENT_SHARE = 0.01
AGREEMENT_MOST_SECONDS = 10.0


def check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


@dataclass(frozen=True)
class LoopConfig:
    """The training loop: length, batch, the step, optimizer defaults, seed, logging."""

    epochs: int = field(
        default=0,
        metadata={
            "help": "number of training epochs (0: 10, or as many as --max-steps takes when "
            "it is given)"
        },
    )
    max_steps: int = field(
        default=0,
        metadata={"help": "end training after N optimizer steps, whatever the epoch (0: off)"},
    )
    max_time: str = field(
        default="",
        metadata={
            "help": "end training after this much time over all the jobs of the run: "
            "D-HH:MM:SS, HH:MM:SS or minutes ('': off)"
        },
    )
    steps_per_epoch: int = field(
        default=0,
        metadata={
            "help": "an epoch of an iterable (streaming) training dataset is N optimizer "
            "steps, the stream read on across epochs and started again when it ends (0: an "
            "epoch is one pass of the stream)"
        },
    )
    val_every_steps: int = field(
        default=0,
        metadata={
            "help": "also validate every N optimizer steps inside an epoch (a training-log "
            "row each, in the epoch in progress; 0: at epochs' ends only)"
        },
    )
    early_stop_patience: int = field(
        default=0,
        metadata={
            "help": "end training after K validations in a row without --best-metric "
            "improving by more than --early-stop-min-delta (0: off)"
        },
    )
    early_stop_min_delta: float = field(
        default=0.0, metadata={"help": "the least change of --best-metric that counts"}
    )
    search_trial: str | None = field(
        default=None,
        metadata={
            "help": "a search's trial (its trial.json, written by dmltrain sweep --search): "
            "each validation's --best-metric is reported to it, and its pruner may end the run"
        },
    )
    batch_size: int = field(
        default=64,
        metadata={"help": "batch size per process (global batch = batch size x world size)"},
    )
    global_batch_size: int | None = field(
        default=None,
        metadata={
            "help": "samples per optimizer step over all processes; sets --batch-size to "
            "G / (processes x --grad-accum), so one command line works at any scale"
        },
    )
    drop_last: bool = field(
        default=False,
        metadata={
            "help": "leave out each epoch's last training batch when it is short (validation "
            "counts every sample)"
        },
    )
    shuffle: bool = field(
        default=True,
        metadata={
            "help": "a new order of the training samples each epoch (--no-shuffle: in order, "
            "for sequences whose batches follow on; rank r of w takes every w-th)"
        },
    )
    grad_accum: int = field(
        default=1, metadata={"help": "accumulate gradients of N batches per optimizer step"}
    )
    grad_clip: float = field(
        default=0.0, metadata={"help": "clip the gradient norm to this value (0: off)"}
    )
    compile: bool = field(default=False, metadata={"help": "compile the model (torch.compile)"})
    lr: float = field(default=1e-3, metadata={"help": "learning rate of the default optimizer"})
    optimizer: Literal["adam", "adamw", "sgd"] = field(
        default="adam",
        metadata={"help": "default optimizer, used unless create_optimizer is overridden"},
    )
    weight_decay: float = field(
        default=0.0, metadata={"help": "weight decay of the default optimizer"}
    )
    seed: int = field(default=0, metadata={"help": "random seed (model init, data order, dropout)"})
    seed_once: bool = field(
        default=False,
        metadata={
            "help": "seed torch, numpy and Python once from --seed before create_model, as "
            "a script does (default: torch before it, all three from seed + rank after)"
        },
    )
    run_dir: str | None = field(
        default=None,
        metadata={
            "help": "directory for everything the run writes (default: "
            "runs/<experiment>-<job id or time>), or an object store's URI (s3://bucket/run)"
        },
    )
    callbacks: str = field(
        default="",
        metadata={
            "help": f"comma-separated installed callbacks (entry-point group {plugins.CALLBACKS}) "
            "added after the experiment's create_callbacks()"
        },
    )
    log_every: int = field(default=50, metadata={"help": "report training metrics every N steps"})
    progress: Literal["auto", "bar", "log", "off"] = field(
        default="auto",
        metadata={
            "help": "progress display: a bar on a terminal, a widget in a notebook, log "
            "lines otherwise (auto)"
        },
    )

    def __post_init__(self) -> None:
        check(self.epochs >= 0, f"--epochs must be at least 1, or 0 for 10 (got {self.epochs})")
        check(self.max_steps >= 0, f"--max-steps must be >= 0 (got {self.max_steps})")
        check(
            self.steps_per_epoch >= 0,
            f"--steps-per-epoch must be >= 0 (got {self.steps_per_epoch})",
        )
        check(
            self.val_every_steps >= 0,
            f"--val-every-steps must be >= 0 (got {self.val_every_steps})",
        )
        check(
            self.early_stop_patience >= 0,
            f"--early-stop-patience must be >= 0 (got {self.early_stop_patience})",
        )
        check(self.early_stop_min_delta >= 0, "--early-stop-min-delta must be >= 0")
        if self.max_time:
            try:
                seconds = time_limit_seconds(self.max_time)
            except ValueError:
                seconds = 0
            check(
                seconds > 0,
                f"--max-time {self.max_time!r}: give a duration like 2-00:00:00, 12:00:00 or "
                "90 (minutes)",
            )
        check(self.batch_size >= 1, f"--batch-size must be at least 1 (got {self.batch_size})")
        check(self.grad_accum >= 1, f"--grad-accum must be at least 1 (got {self.grad_accum})")
        check(
            self.global_batch_size is None or self.global_batch_size >= 1,
            f"--global-batch-size must be at least 1 (got {self.global_batch_size})",
        )
        check(self.grad_clip >= 0, f"--grad-clip must be >= 0 (got {self.grad_clip})")
        check(0 < self.lr < math.inf, f"--lr must be a positive number (got {self.lr})")
        check(
            0 <= self.weight_decay < math.inf,
            f"--weight-decay must be a number >= 0 (got {self.weight_decay})",
        )
        check(self.log_every >= 1, f"--log-every must be at least 1 (got {self.log_every})")
        check(self.run_dir != "", "--run-dir must not be empty")

    def callback_names(self) -> list[str]:
        """The installed callbacks asked for (``--callbacks``), in order, without repeats."""
        return list(dict.fromkeys(n.strip() for n in self.callbacks.split(",") if n.strip()))


_DURATION = re.compile(r"(\d+-)?\d+(:\d+){0,2}")


def time_limit_seconds(text: str) -> int:
    """Slurm's time formats (``MM``, ``MM:SS``, ``HH:MM:SS``, ``D-HH[:MM[:SS]]``) in seconds;
    ValueError for anything else (a negative number among them)."""
    if not _DURATION.fullmatch(text.strip()):
        raise ValueError(f"not a duration: {text!r}")
    days, _, rest = text.strip().rpartition("-")
    parts = [int(p) for p in rest.split(":")]
    if days:
        h, m, s = [*parts, 0, 0][:3]  # D-HH, D-HH:MM, D-HH:MM:SS
    elif len(parts) == 1:
        h, m, s = 0, parts[0], 0  # MM
    elif len(parts) == 2:
        h, m, s = 0, *parts  # MM:SS
    else:
        h, m, s = parts
    return (int(days or 0) * 24 + h) * 3600 + m * 60 + s


def per_process_batch(loop: LoopConfig, world_size: int) -> int:
    """``--batch-size``, or ``--global-batch-size`` shared among the processes and the
    accumulated micro-batches (then it overrides ``--batch-size``)."""
    total = loop.global_batch_size
    if total is None:
        return loop.batch_size
    share = world_size * loop.grad_accum
    check(
        total % share == 0,
        f"--global-batch-size {total} does not divide into {world_size} process(es) x "
        f"--grad-accum {loop.grad_accum}: choose a multiple of {share}",
    )
    return total // share


def _workers_flag(text: str) -> int | str:
    """``--num-workers``'s value: "auto" or a number."""
    if text == "auto" or text.isdigit():
        return text if text == "auto" else int(text)
    raise argparse.ArgumentTypeError(f"give auto or a number >= 0 (got {text!r})")


@dataclass(frozen=True)
class DataConfig:
    """Where data lives and how it is loaded."""

    data_dir: str = field(default="data", metadata={"help": "directory holding the dataset"})
    num_workers: int | Literal["auto"] = field(
        default="auto",
        metadata={
            "type": _workers_flag,
            "metavar": "N|auto",
            "help": "DataLoader worker processes per training process (0 loads in the process); "
            "auto: from the CPUs it has of its own: on a GPU all but one, on CPU a quarter "
            f"(0 below 4), at most {MAX_AUTO_WORKERS}",
        },
    )

    def __post_init__(self) -> None:
        n = self.num_workers
        check(
            n == "auto" or (isinstance(n, int) and not isinstance(n, bool) and n >= 0),
            f"--num-workers must be auto or a number >= 0 (got {n!r})",
        )


@dataclass(frozen=True)
class DistConfig:
    """How processes are started and talk to each other."""

    launcher: Literal["auto", "single", "spawn", "torchrun", "slurm", "mpi", "horovod"] = field(
        default="auto", metadata={"help": "how this process was started (auto: detect)"}
    )
    nprocs: int = field(
        default=1, metadata={"help": "start N local worker processes (no external launcher)"}
    )
    start_method: Literal["auto", "forkserver", "spawn"] = field(
        default="auto",
        metadata={
            "help": "how --nprocs starts its workers: forkserver (one server process "
            "imports torch once, then forks each worker), spawn (each worker a fresh "
            "interpreter that imports torch itself); auto: forkserver on Linux where "
            "TMPDIR is short enough a path for its socket, else spawn"
        },
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
        default=300.0,
        metadata={
            "help": "seconds a rank waits for the others before giving up (raise it when "
            "rank 0 does long work alone: checkpoints of a very large model)"
        },
    )
    init_timeout: float = field(
        default=600.0,
        metadata={
            "help": "seconds the ranks wait for each other while the job starts (the "
            "rendezvous, the process group, setup and resume up to the first step), apart "
            "from --dist-timeout: large jobs start slowly (a shared file system read by "
            "every rank)"
        },
    )
    status_file: str | None = field(
        default=None,
        metadata={
            "help": "rank 0 writes its exit status to this file, and any rank a lost peer's "
            "(torchrun reports every worker failure as 1; the batch scripts read it here); "
            "ranks of a launcher then exit 0 for status 3, which srun and torchrun would "
            "report as a failure"
        },
    )

    def __post_init__(self) -> None:
        check(self.nprocs >= 1, f"--nprocs must be at least 1 (got {self.nprocs})")
        check(self.threads >= 0, f"--threads must be >= 0 (got {self.threads})")
        check(
            0 < self.dist_timeout <= 86400,
            f"--dist-timeout must be positive seconds, at most a day (got {self.dist_timeout})",
        )
        check(
            0 < self.init_timeout <= 86400,
            f"--init-timeout must be positive seconds, at most a day (got {self.init_timeout})",
        )


@dataclass(frozen=True)
class CheckpointConfig:
    """When checkpoints are written and what a run resumes or starts from."""

    resume: str = field(
        default="auto",
        metadata={
            "help": "auto: continue the run directory's latest checkpoint if any; "
            "never; or a checkpoint PATH or URI"
        },
    )
    allow_global_batch_change: bool = field(
        default=False,
        metadata={
            "help": "resume with another global batch (processes x batch size x grad "
            "accumulation) than the checkpoint's; the data position is kept in samples"
        },
    )
    restart_streams: bool = field(
        default=False,
        metadata={
            "help": "resume a training stream on another number of processes than the "
            "checkpoint's, each rank's stream begun afresh (the samples of the pass in "
            "progress may be trained again or missed)"
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
    local_checkpoint_dir: str | None = field(
        default=None,
        metadata={
            "help": "write each checkpoint to this node-local folder first ($TMPDIR, local "
            "NVMe); a background copy drains it to the run directory, where it becomes the "
            "latest"
        },
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
        metadata={
            "help": "start from these weights: a dmltrain checkpoint (a path or a URI), a "
            "state_dict .pt, .safetensors (or a folder of shards), a Lightning .ckpt"
        },
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
    evaluate: str | None = field(
        default=None,
        metadata={
            "help": "validate (and test) this checkpoint's weights, no training; writes "
            "RUN_DIR/eval_metrics.json"
        },
    )
    predict: str | None = field(
        default=None,
        metadata={
            "help": "predict_step over the test (else validation) data with this checkpoint's "
            "weights; writes RUN_DIR/predictions/"
        },
    )
    ema: bool = field(
        default=False,
        metadata={
            "help": "with --load-weights, --evaluate or --predict: the checkpoint's averaged "
            "(EMA) weights"
        },
    )
    load_epoch: bool = field(
        default=False,
        metadata={"help": "with --load-weights: also continue its epoch and step counters"},
    )

    def __post_init__(self) -> None:
        check(self.checkpoint_every_steps >= 0, "--checkpoint-every-steps must be >= 0")
        check(self.checkpoint_every_minutes >= 0, "--checkpoint-every-minutes must be >= 0")
        check(self.keep_last >= 0, f"--keep-last must be >= 0 (got {self.keep_last})")
        check(self.resume != "", "--resume must be auto, never or a checkpoint path")
        check(
            not (self.evaluate and self.predict),
            "--evaluate and --predict are separate runs: give one of them",
        )
        check(
            not (self.load_weights and (self.evaluate or self.predict)),
            "--evaluate and --predict load the checkpoint they name: drop --load-weights",
        )
        check(
            not (self.load_weights and self.resume not in ("auto", "never")),
            "--resume PATH goes on with that run, --load-weights starts a new one from its "
            "weights: give one of them",
        )

    @property
    def evaluating(self) -> str | None:
        """The checkpoint of an --evaluate or --predict run (no training), or None."""
        return self.evaluate or self.predict


@dataclass(frozen=True)
class FinetuneConfig:
    """How --load-weights maps onto the model, and what of the model trains
    (``dmltrain.checkpoint.pretrained``, ``dmltrain.runtime.finetune``)."""

    load_map: tuple[str, ...] = field(
        default=(),
        metadata={
            "help": "OLD=NEW: rename the key prefix OLD of --load-weights to NEW "
            "(several allowed; 'model.=' strips one)"
        },
    )
    load_skip: tuple[str, ...] = field(
        default=(),
        metadata={"help": "leave out the keys of --load-weights that match these patterns"},
    )
    load_partial: bool = field(
        default=False,
        metadata={
            "help": "with --load-weights: skip keys whose shapes differ or that one side "
            "lacks (a new head), instead of failing"
        },
    )
    freeze: tuple[str, ...] = field(
        default=(),
        metadata={"help": "parameters matching these patterns do not train ('conv*', 'encoder.*')"},
    )
    lr_scale: tuple[str, ...] = field(
        default=(),
        metadata={
            "help": "PATTERN=FACTOR: those parameters learn at --lr times FACTOR (the default "
            "optimizers; the first pattern that matches counts)"
        },
    )
    lora_targets: tuple[str, ...] = field(
        default=(),
        metadata={"help": "modules (names or patterns) that get LoRA adapters; only they train"},
    )
    lora_rank: int = field(default=8, metadata={"help": "the rank of each LoRA adapter"})
    lora_alpha: float = field(
        default=16.0, metadata={"help": "LoRA's scale: the update is alpha / rank times B @ A"}
    )
    lora_dropout: float = field(
        default=0.0, metadata={"help": "dropout on the input of each LoRA adapter"}
    )

    def __post_init__(self) -> None:
        for name in ("load_map", "load_skip", "freeze", "lr_scale", "lora_targets"):
            value = getattr(self, name)  # a config file's list, or one pattern
            object.__setattr__(self, name, (value,) if isinstance(value, str) else tuple(value))
        for rename in self.load_map:
            check("=" in rename, f"--load-map takes OLD=NEW (got {rename!r})")
        for scale in self.lr_scale:
            pattern, _, factor = scale.rpartition("=")
            check(
                bool(pattern) and _is_number(factor) and 0 <= float(factor) < math.inf,
                f"--lr-scale takes PATTERN=FACTOR, a factor >= 0 (got {scale!r})",
            )
        check(self.lora_rank >= 1, f"--lora-rank must be at least 1 (got {self.lora_rank})")
        check(self.lora_alpha > 0, f"--lora-alpha must be positive (got {self.lora_alpha})")
        check(0 <= self.lora_dropout < 1, "--lora-dropout must be in [0, 1)")


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


@dataclass(frozen=True)
class PreemptionConfig:
    """How a run stops to go on in a later job: signals, time limits, epochs per job."""

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
            f"every step); longer, up to {AGREEMENT_MOST_SECONDS:g} s, where the collective "
            f"would take over {AGREEMENT_SHARE * 100:g}%% of training (many ranks)"
        },
    )
    requeue: bool = field(
        default=True,
        metadata={"help": "under Slurm, run 'scontrol requeue' after a preemption checkpoint"},
    )
    stop_before_end_minutes: float = field(
        default=5.0,
        metadata={
            "help": "under Slurm or PBS, checkpoint and exit this long before the time limit"
        },
    )

    def __post_init__(self) -> None:
        check(self.epochs_per_job >= 0, "--epochs-per-job must be >= 0")
        check(
            0 <= self.preempt_check_seconds < math.inf,
            "--preempt-check-seconds must be a number >= 0",
        )
        for name in self.signal_names():
            check(
                name in signal.Signals.__members__,
                f"--preempt-signals: {name} is not a signal name (e.g. SIGUSR1)",
            )
            check(
                name not in ("SIGKILL", "SIGSTOP"),
                f"--preempt-signals: {name} cannot be caught; use SIGTERM, SIGUSR1 or SIGINT",
            )

    def signal_names(self) -> list[str]:
        return [n.strip() for n in self.preempt_signals.split(",") if n.strip()]


@dataclass(frozen=True)
class PrecisionConfig:
    """Numeric precision and the checks for non-finite numbers."""

    precision: Literal["fp32", "fp16", "bf16"] = field(
        default="fp32",
        metadata={"help": "fp16 (autocast with a grad scaler), bf16 (autocast) or fp32"},
    )
    matmul_precision: Literal["highest", "high", "medium"] = field(
        default="high",
        metadata={
            "help": "fp32 matrix products on a GPU: high lets them use TF32 (about 8x the "
            "speed on A100 and newer), highest keeps full fp32; the CPU keeps fp32"
        },
    )
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


@dataclass(frozen=True)
class TrackingConfig:
    """Experiment tracking with Weights & Biases, TensorBoard, MLflow (rank 0 only)."""

    tracker: str = field(
        default="wandb",
        metadata={
            "help": "comma-separated trackers: wandb (as --wandb-mode says), tensorboard "
            "(RUN_DIR/tensorboard), mlflow (the store MLFLOW_TRACKING_URI names), or another "
            f"installed (entry-point group {plugins.TRACKERS}); '' for none"
        },
    )
    tensorboard: bool = field(
        default=False, metadata={"help": "also write TensorBoard events (adds it to --tracker)"}
    )
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
    group: str | None = field(
        default=None,
        metadata={
            "help": "runs that belong together (a sweep's trials): wandb's group, MLflow's tag "
            "'group'"
        },
    )
    wandb_group: str | None = field(
        default=None, metadata={"help": "wandb group (default: --group)"}
    )
    wandb_tags: str = field(default="", metadata={"help": "comma-separated tags"})
    wandb_init_timeout: float = field(
        default=60.0, metadata={"help": "seconds to wait for wandb to start before giving up"}
    )
    mlflow_experiment: str | None = field(
        default=None, metadata={"help": "MLflow experiment (default: the experiment's name)"}
    )
    mlflow_run_name: str | None = field(
        default=None, metadata={"help": "MLflow run name (default: the run directory's name)"}
    )
    mlflow_log_checkpoint: bool = field(
        default=False,
        metadata={"help": "with --tracker mlflow: the best checkpoint as an artifact too"},
    )

    def __post_init__(self) -> None:
        check(self.wandb_init_timeout > 0, "--wandb-init-timeout must be positive")
        unknown = set(self.trackers()) - {"wandb", "tensorboard"}
        if unknown:  # installed ones are looked up
            have = set(plugins.installed(plugins.TRACKERS))
            unknown -= have
            choose = ", ".join(["wandb", "tensorboard", *sorted(have)])
            check(
                not unknown,
                f"--tracker: unknown {', '.join(sorted(unknown))}; choose from {choose} (or "
                f"install one under the entry-point group {plugins.TRACKERS})",
            )

    def trackers(self) -> list[str]:
        """The trackers asked for, in order, without repeats."""
        names = [name.strip() for name in self.tracker.split(",") if name.strip()]
        if self.tensorboard:
            names.append("tensorboard")
        return list(dict.fromkeys(names))


@dataclass(frozen=True)
class ProfilingConfig:
    """Profiles on request (``dmltrain.features.profiling``); nothing is recorded unless
    asked for."""

    profile_steps: str = field(
        default="",
        metadata={
            "help": "A:B: torch.profiler from global step A to B; trace and top operators in "
            "RUN_DIR/profile/ (e.g. 20:25)"
        },
    )
    profile_ranks: str = field(
        default="0", metadata={"help": "ranks profiled: 0, a list (0,3) or all"}
    )
    memory_snapshot: bool = field(
        default=False,
        metadata={
            "help": "record the CUDA allocator's history; RUN_DIR/profile/memory-rank-N.pickle "
            "(for pytorch.org/memory_viz) at the end of --profile-steps, else of the run"
        },
    )

    def __post_init__(self) -> None:
        self.window(), self.ranks()  # each raises ConfigError on a bad value

    def window(self) -> tuple[int, int] | None:
        """``--profile-steps A:B`` as ``(A, B)``, 0 <= A < B; None when not asked for."""
        text = self.profile_steps
        if not text:
            return None
        start, sep, stop = text.partition(":")
        check(
            bool(sep) and start.strip().isdigit() and stop.strip().isdigit(),
            f"--profile-steps {text!r}: give two global steps, A:B (e.g. 20:25)",
        )
        check(int(start) < int(stop), f"--profile-steps {text!r}: A must be below B")
        return int(start), int(stop)

    def ranks(self) -> frozenset[int] | None:
        """``--profile-ranks``: the ranks profiled; None for all."""
        text = self.profile_ranks.strip()
        if text == "all":
            return None
        parts = [part.strip() for part in text.split(",")]
        check(
            all(part.isdigit() for part in parts),
            f"--profile-ranks {text!r}: give all, a rank (0) or ranks (0,3)",
        )
        return frozenset(int(part) for part in parts)


@dataclass(frozen=True)
class EmaConfig:
    """An exponential moving average of the weights (``dmltrain.features.ema``)."""

    ema_decay: float = field(
        default=0.0,
        metadata={
            "help": "keep an exponential moving average of the weights with this decay, "
            "e.g. 0.999 (0: off)"
        },
    )
    ema_warmup_steps: int = field(
        default=0, metadata={"help": "the average copies the weights for the first N steps"}
    )
    ema_every_steps: int = field(default=1, metadata={"help": "update the average every N steps"})
    ema_eval: bool = field(
        default=True,
        metadata={"help": "with --ema-decay: validate the average too (val_ema_* columns)"},
    )

    def __post_init__(self) -> None:
        check(0 <= self.ema_decay < 1, f"--ema-decay must be in [0, 1) (got {self.ema_decay})")
        check(self.ema_warmup_steps >= 0, "--ema-warmup-steps must be >= 0")
        check(self.ema_every_steps >= 1, "--ema-every-steps must be at least 1")


@dataclass(frozen=True)
class MemoryConfig:
    """Models that do not fit: activation checkpointing, FSDP's sharded initialisation,
    hybrid sharding and CPU offload (``dmltrain.runtime.sharding``)."""

    activation_checkpointing: bool = field(
        default=False,
        metadata={
            "help": "recompute the activations of the modules checkpointed_modules names (the "
            "FSDP units by default) in the backward instead of keeping them: less memory "
            "for about one more forward"
        },
    )
    sharded_init: bool = field(
        default=True,
        metadata={
            "help": "under FSDP, rank 0 alone builds the whole model (on the CPU) and each "
            "rank receives its shard; the others build it on the meta device"
        },
    )
    fsdp_shard_size: int = field(
        default=0,
        metadata={
            "help": "under FSDP, shard over groups of K ranks and replicate across the groups "
            "(HSDP; K divides the number of processes, usually the GPUs of a node; 0: "
            "shard over all)"
        },
    )
    cpu_offload: bool = field(
        default=False,
        metadata={
            "help": "under FSDP on GPUs, keep the sharded parameters, gradients and optimizer "
            "state in CPU memory"
        },
    )

    def __post_init__(self) -> None:
        check(
            self.fsdp_shard_size >= 0,
            f"--fsdp-shard-size must be >= 0 (got {self.fsdp_shard_size})",
        )


@dataclass(frozen=True)
class MonitorConfig:
    """What each step's clocks show at a log interval (``dmltrain.features.monitor``)."""

    monitor: bool = field(
        default=True,
        metadata={
            "help": "time the loader and train_step each step; at each log interval: steps/s, "
            "data wait, stragglers (RUN_DIR/ranks.csv)"
        },
    )
    straggler_factor: float = field(
        default=1.2,
        metadata={
            "help": "warn about a rank slower than the median of the others by this factor for two "
            "log intervals (every rank's numbers of such intervals: RUN_DIR/ranks.csv)"
        },
    )

    gradient_noise_scale: int = field(
        default=0,
        metadata={
            "help": "estimate the gradient noise scale (the batch size past which a larger one "
            "gains little) from the gradients of every N steps: gradient_noise_scale in "
            "steps.csv; 0: off"
        },
    )

    def __post_init__(self) -> None:
        check(self.straggler_factor > 1, "--straggler-factor must be above 1")
        check(
            self.gradient_noise_scale == 0 or self.gradient_noise_scale >= 2,
            f"--gradient-noise-scale must be 0 (off) or at least 2 steps "
            f"(got {self.gradient_noise_scale})",
        )


# The hang watchdog's automatic timeout (dmltrain.features.watchdog).
HANG_MULTIPLE = 20  # of the slowest step so far
HANG_AUTO_FLOOR = 180.0  # seconds, --hang-timeout 0: a few minutes
HANG_AUTO_SHARE = 0.8  # of --dist-timeout: the stacks are written before a collective gives up


@dataclass(frozen=True)
class HangConfig:
    """The hang watchdog (``dmltrain.features.watchdog``)."""

    hang_timeout: float = field(
        default=0.0,
        metadata={
            "help": "seconds with no step ended before every rank writes its stacks to "
            f"RUN_DIR/hang/ and the run stops (exit 5); at least {HANG_MULTIPLE}x the slowest "
            f"step so far. 0: auto (that, at least {HANG_AUTO_FLOOR:g} s, at most "
            f"{HANG_AUTO_SHARE}x --dist-timeout)"
        },
    )
    hang_watchdog: bool = field(default=True, metadata={"help": "watch for hangs (--hang-timeout)"})

    def __post_init__(self) -> None:
        check(
            0 <= self.hang_timeout < math.inf,
            f"--hang-timeout must be a number >= 0 (got {self.hang_timeout})",
        )


@dataclass(frozen=True, init=False)
class TrainConfig:
    """Everything ``BaseTrainer`` needs, one section per concern.

    Built from flat settings, ``TrainConfig(epochs=3, lr=0.1)``, from sections,
    ``TrainConfig(loop=LoopConfig(epochs=3))``, or both (the flat ones then override the
    section's). Reading is flat too: ``config.epochs`` is ``config.loop.epochs``.
    """

    # One field a section, in --help's order, with the title of its flags there.
    loop: LoopConfig = field(metadata={"title": "training"})
    data: DataConfig = field(metadata={"title": "data"})
    # not "precision": that is a setting of it
    numerics: PrecisionConfig = field(metadata={"title": "precision"})
    distributed: DistConfig = field(metadata={"title": "distributed"})
    checkpoint: CheckpointConfig = field(metadata={"title": "checkpointing"})
    finetune: FinetuneConfig = field(metadata={"title": "fine-tuning"})
    preemption: PreemptionConfig = field(metadata={"title": "preemption"})
    tracking: TrackingConfig = field(metadata={"title": "tracking"})
    monitoring: MonitorConfig = field(metadata={"title": "monitoring"})
    # not "ema": that is a setting (--ema, of --evaluate)
    averaging: EmaConfig = field(metadata={"title": "weight averaging (EMA)"})
    hang: HangConfig = field(metadata={"title": "hang watchdog"})
    profiling: ProfilingConfig = field(metadata={"title": "profiling"})
    memory: MemoryConfig = field(metadata={"title": "memory (models that do not fit)"})

    def __init__(self, **settings: Any) -> None:
        unknown = sorted(set(settings) - set(_SECTION_OF) - {attr for attr, _, _ in SECTIONS})
        if unknown:
            raise TypeError(f"TrainConfig got unknown settings: {', '.join(unknown)}")
        for attr, _, cls in SECTIONS:
            given = settings.get(attr)
            flat = {n: v for n, v in settings.items() if _SECTION_OF.get(n) == attr}
            if given is None:
                value = cls(**flat)
            elif type(given) is cls:
                value = dataclasses.replace(given, **flat)  # type: ignore[type-var]
            else:
                raise TypeError(f"TrainConfig({attr}=...) must be a {cls.__name__}")
            object.__setattr__(self, attr, value)

    def __getattr__(self, name: str) -> Any:
        """Flat reads: ``config.batch_size`` is ``config.loop.batch_size``."""
        attr = _SECTION_OF.get(name)
        if attr is None:
            raise AttributeError(f"TrainConfig has no setting {name!r}")
        return getattr(getattr(self, attr), name)

    def replace(self, **settings: Any) -> "TrainConfig":
        """A copy with some settings changed: ``config.replace(run_dir="r")``."""
        return dataclasses.replace(self, **settings)


# The sections, from TrainConfig's fields: its attribute, the title of its flags in
# --help, its dataclass.
SECTIONS: tuple[tuple[str, str, type], ...] = tuple(
    (f.name, f.metadata["title"], typing.cast(type, f.type))
    for f in dataclasses.fields(TrainConfig)
)
# Which section holds each setting (no two sections share a name, and no setting is
# named like a section: config.NAME reads either).
_SECTION_OF = {f.name: attr for attr, _, cls in SECTIONS for f in dataclasses.fields(cls)}
assert len(_SECTION_OF) == sum(len(dataclasses.fields(c)) for _, _, c in SECTIONS)
assert not {attr for attr, _, _ in SECTIONS} & set(_SECTION_OF)


def field_names(cls: type) -> list[str]:
    """The settings of a dataclass; of ``TrainConfig``, every section's (flat)."""
    if cls is TrainConfig:
        return list(_SECTION_OF)
    return [f.name for f in dataclasses.fields(cls)]

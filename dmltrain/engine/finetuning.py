"""A fine-tune's model as it is made: the pretrained weights of ``--load-weights`` mapped
into it, LoRA adapters added, parts frozen. ``sharding.place`` calls ``Adapt`` on each
rank's new model before the strategy wraps it.

Rank 0 alone reads the file and loads it. The strategy's wrapping hands rank 0's weights
to the others (DDP and Horovod broadcast them, FSDP's sharded initialisation sends each
rank its shards), so no rank holds more than rank 0 does at any start. Only FSDP without
its sharded initialisation sends nothing: there every rank reads the file. A failure is
rank 0's verdict on every rank.

A resumed run never reads the pretrained file again: its checkpoint holds the weights.
Under LoRA a checkpoint holds only what trains (and the buffers); the frozen rest is
written once, at the start, as ``RUN_DIR/base.safetensors``, and read back on a resume.
"""

import json
from pathlib import Path
from typing import Any

from torch import nn

from dmltrain.checkpoint import pretrained
from dmltrain.config import FinetuneConfig
from dmltrain.errors import SharedError, UserError
from dmltrain.runtime import finetune

BASE = "base.safetensors"
REPORT = "load_report.json"


class Adapt:
    """What ``--load-weights`` (when it is not a resume), ``--lora-targets`` and
    ``--freeze`` do to a new model."""

    def __init__(
        self,
        config: FinetuneConfig,
        source: str | None,
        ema: bool,
        resuming: bool,
        run_dir: Path,
        strategy: Any,
        every_rank_reads: bool,
        say: Any,
    ) -> None:
        self.config, self.source, self.ema, self.resuming = config, source, ema, resuming
        self.run_dir, self.strategy, self.say = run_dir, strategy, say
        self.main = strategy.info.is_main
        self.reads = self.main or every_rank_reads
        self.base: frozenset[str] = frozenset()  # what checkpoints leave out (LoRA)

    def __call__(self, model: nn.Module, real: bool) -> nn.Module:
        """``model`` (every rank's: ``real`` where its tensors have values) adapted."""
        cfg = self.config
        if self.source is not None:
            self._agreed(lambda: self._load_pretrained(model), real)
        if cfg.lora_targets:
            model = finetune.add_lora(model, cfg)
        if cfg.freeze:
            finetune.freeze(model, cfg.freeze)
        if cfg.lora_targets:
            self.base = frozenset(n for n, p in model.named_parameters() if not p.requires_grad)
            if self.resuming:  # the frozen weights, as the run's start wrote them
                self._agreed(lambda: self._load_base(model), real)
            elif self.main:
                frozen = {n: p for n, p in model.named_parameters() if n in self.base}
                pretrained.save_safetensors(frozen, self.run_dir / BASE)
        return model

    def _agreed(self, work: Any, real: bool) -> None:
        """``work`` where the weights are read (rank 0, else every rank with values); rank
        0's UserError every rank's."""
        failed = None
        if self.reads and real:
            try:
                work()
            except UserError as exc:
                if not self.main:
                    raise
                failed = str(exc)
        failed = self.strategy.broadcast_object(failed)
        if failed is not None:
            raise SharedError(failed)

    def _load_pretrained(self, model: nn.Module) -> None:
        assert self.source is not None
        weights, kind = pretrained.read(self.source, self.run_dir, self.ema)
        own = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        report = pretrained.Report(self.source, kind)
        chosen = pretrained.fit(pretrained.shapes(weights), own, self.config, report)
        pretrained.load(model, weights, chosen)
        if self.main:
            (self.run_dir / REPORT).write_text(json.dumps(report.as_dict(), indent=1) + "\n")
            self.say(f"dmltrain: {report.line()}; the whole report: {self.run_dir / REPORT}")

    def _load_base(self, model: nn.Module) -> None:
        path = self.run_dir / BASE
        if not path.exists():
            raise UserError(
                f"cannot resume this LoRA run: {path}, its frozen weights, is missing; "
                "start a new run directory from --load-weights"
            )
        weights = pretrained.load_safetensors(path)
        if set(weights) != self.base:
            raise UserError(
                f"cannot resume this LoRA run: {path} does not hold the frozen weights of "
                "this model (were --lora-targets or --freeze changed?)"
            )
        model.load_state_dict(weights, strict=False)

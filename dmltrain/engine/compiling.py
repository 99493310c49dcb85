"""``--compile``: the repeated blocks compiled one by one, and the compiled code kept in the
run directory for the run's next job.

Regional compilation (as Accelerate's ``compile_regions`` and torchtitan do): a model
whose blocks repeat (a transformer's layers) compiles one block and reuses its code for
the others, so compiling takes the time of one block, not of the model. Each block is
compiled in place (``nn.Module.compile``): parameter names do not change. A model without
repeated blocks of its own is compiled whole, as before.

The code torch compiled is saved once a job, at its first checkpoint after compiling
(``torch.compiler.save_cache_artifacts``), into ``RUN_DIR/compile_cache.bin``; the next
job of the run (a requeue, a resume) loads it before its first step, so it does not
compile from scratch.
"""

from pathlib import Path
from typing import Any

import torch
from torch import nn

from dmltrain.callback import Callback
from dmltrain.records.files import NotWritten, write_atomic

CACHE = "compile_cache.bin"


def regions(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks of ``model``: in its first container (depth first, a
    ``ModuleList`` or ``Sequential``) holding two or more modules of one class of the
    experiment's own (not torch's), those modules. [] when there is none."""
    for module in model.modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)):
            continue
        children = list(module.children())
        for kind in dict.fromkeys(type(child) for child in children):
            same = [child for child in children if type(child) is kind]
            if len(same) > 1 and not kind.__module__.startswith("torch."):
                return same
    return []


def compile_model(model: nn.Module, plain: nn.Module, run_dir: Path, say: Any) -> nn.Module:
    """``model`` (``plain`` unwrapped) compiled: its repeated blocks in place, else whole
    (``torch.compile``'s wrapper); the run's compile cache loaded first, if there is one."""
    cache = run_dir / CACHE
    if cache.is_file():
        try:
            torch.compiler.load_cache_artifacts(cache.read_bytes())
            say(f"dmltrain: --compile: loaded the compiled code of an earlier job ({cache})")
        except Exception as exc:  # a cache of another torch or device: compile anew
            say(f"dmltrain: --compile: {cache} not used ({type(exc).__name__}); compiling anew")
    blocks = regions(plain)
    if not blocks:
        return torch.compile(model)  # type: ignore[return-value]
    for block in blocks:
        block.compile()
    say(f"dmltrain: --compile: {len(blocks)} {type(blocks[0]).__name__} blocks, one by one")
    return model


class CompileCache(Callback):
    """Rank 0 saves the compiled code once a job, at the first checkpoint after the first
    step (compiling happens at the first call)."""

    def __init__(self, run_dir: Path, warn: Any) -> None:
        self.path, self.warn, self.saved = run_dir / CACHE, warn, False

    def on_save_checkpoint(self, trainer: Any) -> None:
        if self.saved or trainer.global_step == 0:
            return
        self.saved = True
        found = torch.compiler.save_cache_artifacts()
        if found is None:  # nothing compiled (or all of it loaded from the cache)
            return
        try:
            write_atomic(self.path, found[0])
        except NotWritten as exc:
            self.warn(f"{exc}; the next job compiles anew")

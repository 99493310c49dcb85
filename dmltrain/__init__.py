"""dmltrain: write one BaseTrainer subclass, get a cluster-ready training loop.

The names below are imported when first used, so that the ``dmltrain`` command
(``dmltrain.command``) starts before torch is imported and can answer Ctrl-C during
start-up with one line."""

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
_WHERE = {
    "BaseTrainer": "dmltrain.trainer",
    "Callback": "dmltrain.callback",
    "ConfigError": "dmltrain.errors",
    "DataConfig": "dmltrain.config",
    "DistInfo": "dmltrain.runtime.launch",
    "Experiment": "dmltrain.experiment",
    "LoopConfig": "dmltrain.config",
    "Stateful": "dmltrain.callback",
    "TrainConfig": "dmltrain.config",
    "Tracker": "dmltrain.features.tracking",
    "UserError": "dmltrain.errors",
    "register_experiment": "dmltrain.experiment",
}
__all__ = [
    "BaseTrainer",
    "Callback",
    "ConfigError",
    "DataConfig",
    "DistInfo",
    "Experiment",
    "LoopConfig",
    "Stateful",
    "Tracker",
    "TrainConfig",
    "UserError",
    "register_experiment",
]

if TYPE_CHECKING:
    from dmltrain.callback import Callback, Stateful
    from dmltrain.config import DataConfig, LoopConfig, TrainConfig
    from dmltrain.errors import ConfigError, UserError
    from dmltrain.experiment import Experiment, register_experiment
    from dmltrain.features.tracking import Tracker
    from dmltrain.runtime.launch import DistInfo
    from dmltrain.trainer import BaseTrainer


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'dmltrain' has no attribute {name!r}")

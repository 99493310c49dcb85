"""dmltrain: write one BaseTrainer subclass, get a cluster-ready training loop."""

from dmltrain.cli import Experiment, register_experiment
from dmltrain.config import DataConfig, LoopConfig, TrainConfig
from dmltrain.errors import ConfigError, UserError
from dmltrain.launch import DistInfo
from dmltrain.trainer import BaseTrainer

__version__ = "0.1.0"
__all__ = [
    "BaseTrainer",
    "ConfigError",
    "DataConfig",
    "DistInfo",
    "Experiment",
    "LoopConfig",
    "TrainConfig",
    "UserError",
    "register_experiment",
]

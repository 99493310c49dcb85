"""The random number generators of a process: seeding them, saving and restoring them.

States are saved as tensors and plain Python values, so a checkpoint holding them loads
with ``torch.load(..., weights_only=True)``.
"""

import random
from typing import Any

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    """Python's, numpy's and torch's (every device's) generators from ``seed``."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rng_state() -> dict[str, Any]:
    np_state: tuple[Any, ...] = np.random.get_state()  # type: ignore[assignment]
    return {
        "python": random.getstate(),
        "numpy": (np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(_tuples(state["python"]))
    kind, keys, *rest = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), *rest))
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _tuples(value: Any) -> Any:
    """random.setstate needs tuples where a round trip may have produced lists."""
    if isinstance(value, (list, tuple)):
        return tuple(_tuples(v) for v in value)
    return value

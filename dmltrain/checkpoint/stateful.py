"""What a checkpoint can hold: objects that give their state and take it back."""

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class Stateful(Protocol):
    """An object a checkpoint keeps (``state_dict``) and restores (``load_state_dict``)."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> None: ...


class ModelShaped(Protocol):
    """State shaped like the model's weights (an average of them, ``--ema-decay``): whole in
    a full checkpoint, each rank's own shards in a sharded one, under its key."""

    def state_dict(self, keep: bool = True) -> dict[str, Any]:
        """Whole (a collective under FSDP); ``keep=False``: a rank that only helps gather."""
        ...

    def shards(self, counters: bool = True) -> dict[str, Any]:
        """Each rank's own part as it lives, to save or to load into in place."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def restart(self) -> None:
        """Start again from the weights as they are (a checkpoint without this state)."""
        ...


class Positioned(Protocol):
    """Each rank's own place (a training stream's): gathered to rank 0 as a list, one item
    a rank, and handed back to each rank on resume."""

    def position(self) -> Any:
        """This rank's place, or None when there is none to keep."""
        ...

    def takes_position(self, mid_epoch: bool) -> bool:
        """Whether a resume goes on from a saved place."""
        ...

    def restore(self, position: Any, say: Callable[[str], None]) -> None: ...

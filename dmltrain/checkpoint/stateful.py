"""What a checkpoint can hold: an object with ``state_dict`` and ``load_state_dict``."""

from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class Stateful(Protocol):
    """An object a checkpoint keeps (``state_dict``) and restores (``load_state_dict``)."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> None: ...

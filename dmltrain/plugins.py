"""What installed packages add to dmltrain, through entry points: experiments (``dmltrain
EXPERIMENT``), trackers (``--tracker NAME``) and callbacks (``--callbacks NAME``). The one
place that reads the entry-point groups."""

from importlib import metadata

EXPERIMENTS = "dmltrain.experiments"
TRACKERS = "dmltrain.trackers"
CALLBACKS = "dmltrain.callbacks"


def installed(group: str) -> dict[str, metadata.EntryPoint]:
    """The entry points of ``group``, by name (not loaded: a broken one fails only when
    it is used)."""
    return {entry.name: entry for entry in metadata.entry_points(group=group)}

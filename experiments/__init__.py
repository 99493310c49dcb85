"""Experiments bundled with dmltrain, each exposed via the dmltrain.experiments entry point."""

"""Checkpoints: when a run saves, what a checkpoint holds, the files, and how a run comes back."""

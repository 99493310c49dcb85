"""What a run leaves on disk besides checkpoints: its directory, the training log,
records written whole."""

"""The data pipeline's order and randomness: which sample of which epoch, and the
generators of a process."""

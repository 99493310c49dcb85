"""Tools around runs: submit, sweep, doctor, plot."""

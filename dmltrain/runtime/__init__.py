"""The distributed runtime: who a process is in its job, process groups and strategies,
workers, preemption, start-up checks."""

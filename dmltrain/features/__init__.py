"""Optional features, each a callback of the loop: EMA, monitor, hang watchdog,
profiler, trackers."""

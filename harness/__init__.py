"""Real processes for tests and benchmarks: the service and the warmup sidecar, each its own
process with its output in a log file (see harness.procs)."""

"""Metrics sinks: where a process writes its per-step records."""

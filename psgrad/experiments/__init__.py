"""Experiments over whole jobs: `psgrad compare`, its analysis and report, and the all-reduce baseline."""

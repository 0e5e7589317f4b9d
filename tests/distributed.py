"""Run a test body in several processes joined by a gloo process group, on the CPU: the
benchmarks' ``harness.ranks`` (benchmarks/harness/ranks.py), which shows how."""

from harness.ranks import free_port, run_distributed

__all__ = ["free_port", "run_distributed"]

"""bapo-cli: off-policy RL for LLMs with BAPO (Balanced Policy Optimization, Adaptive Clipping)."""

from bapo_cli import threads as _threads

__version__ = "0.1.0"

_threads.quiet_waits()  # before anything imports torch: OpenMP reads its wait policy once

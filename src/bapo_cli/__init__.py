"""bapo-cli: off-policy RL for LLMs with BAPO (Balanced Policy Optimization, Adaptive Clipping)."""

__version__ = "0.1.0"

"""A process that ends does not free its objects one by one.

Python's teardown walks every object the process still holds and frees it: with torch,
transformers and MLflow imported that is ~1.4 s of CPU for a `bapo train` (0.6 s for the torchrun
agent, torch alone), measured on this 2-core machine, in every process a run starts (ranks,
launchers, sweeps) and 3-4 s of wall time on a loaded one; the OS takes the memory back at once.
`skip_last_collection` collects the garbage made so far (its finalizers run) and freezes the rest
out of the last collection (`gc.freeze`). The atexit handlers still run after it: logs flushed
and closed, grading workers stopped, MLflow's queue drained.
"""

from __future__ import annotations

import gc

__all__ = ["skip_last_collection"]


def skip_last_collection() -> None:
    """Call as the process's main function returns (or raises): nothing after it in this process
    needs the objects it holds freed."""
    gc.collect()
    gc.freeze()

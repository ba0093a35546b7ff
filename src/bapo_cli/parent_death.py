"""A child process told when its parent dies: Linux's PR_SET_PDEATHSIG.

A child whose parent is killed outright (kill -9, the OOM killer, srun forcing a step's end) is
re-parented and runs on unseen. Asked in time, the kernel sends it a signal instead: the async
generation worker asks for SIGKILL (it holds nothing to save), a torchrun rank for SIGTERM (it
saves its step). The signal comes when the *thread* that started the child exits, which is the
parent's main thread for every launcher here. Off Linux nothing is asked.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys

__all__ = ["signal_on_parent_death"]

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def signal_on_parent_death(signum: int, parent: int) -> bool:
    """Ask for `signum` when `parent` (this process's parent) dies. False: it died already,
    before the request took effect, so no signal will come and the caller acts now."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signum)
    return os.getppid() == parent

"""CPU threads: chosen once from the cores actually free, and no spinning at barriers.

Why: on a busy machine a training step slowed 15-60x where a fair share of the cores predicts
~4x. Left alone, torch runs one intra-op thread per core of the machine, whoever else uses them,
and OpenMP makes every parallel region wait at a barrier for all of its threads: the tiny model's
steps are thousands of small ops, so each one waits for the thread the scheduler took away, and
a waiting thread spins (GNU OpenMP's default; Intel's KMP_BLOCKTIME 200 ms) on a core another
process could use. Measured by `benchmarks/bench_load.py` (docs/benchmarks.md#under-load).

So, once per process:

- `quiet_waits()` (at package import, before torch loads OpenMP, which reads these once):
  ``OMP_WAIT_POLICY=PASSIVE`` and ``KMP_BLOCKTIME=0``, so a waiting thread sleeps. Inherited by
  every process this one starts (grading workers, the async worker, torchrun ranks).
- `configure()` (when training starts): torch's intra-op threads = the cores free for this
  process: `usable_cores()` (its CPU affinity and cgroup quota) less everyone else's load
  (`other_load()`: the 1-minute load average, or the tasks runnable now if more), at least 1,
  never more than already set (a sweep's joblib jobs split the cores first); one inter-op
  thread. The async worker takes its share of that count.

An explicit ``OMP_NUM_THREADS`` (also torchrun's default of 1) or ``OMP_WAIT_POLICY`` wins.
``BAPO_THREADS=<n>`` sets the count; ``BAPO_THREADS=legacy`` restores the old behaviour (torch's
defaults: a thread per core, spin-waiting), which the benchmark compares against.
"""

from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass

THREADS_ENV = "BAPO_THREADS"
LEGACY = "legacy"


def legacy() -> bool:
    return os.environ.get(THREADS_ENV, "").strip().lower() == LEGACY


def quiet_waits() -> None:
    """Sleeping, not spinning, OpenMP waits for this process and its children (unless the user
    chose otherwise, or BAPO_THREADS=legacy). Call before torch is imported."""
    if legacy():
        return
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    os.environ.setdefault("KMP_BLOCKTIME", "0")


def usable_cores() -> int:
    """Cores this process may run on: its CPU affinity, capped by a cgroup v2 CPU quota."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    try:
        quota, period = open("/sys/fs/cgroup/cpu.max").read().split()  # noqa: SIM115
        if quota != "max":
            cores = min(cores, max(1, math.floor(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return max(1, cores)


def other_load() -> float:
    """Runnable tasks of everyone else: the 1-minute load average, or the tasks runnable right
    now less this one when more (a load that just began, e.g. a benchmark's busy loops, shows
    there a minute before the average catches up)."""
    try:
        with open("/proc/loadavg") as f:
            fields = f.read().split()
        return max(float(fields[0]), int(fields[3].split("/")[0]) - 1.0)
    except (OSError, ValueError, IndexError):
        try:
            return os.getloadavg()[0]
        except OSError:
            return 0.0


def free_cores(cores: int, load: float) -> int:
    """Cores left when `load` runnable tasks (the 1-minute load average) share `cores`: at
    least 1, rounded to the nearest core (2 cores at load 0.4 -> 2, at 1.3 -> 1)."""
    return max(1, min(cores, math.floor(cores - load + 0.5)))


@dataclass(frozen=True)
class ThreadChoice:
    threads: int
    why: str


def choose(current: int) -> ThreadChoice:
    """The intra-op thread count for this process (see the module docstring for the rules)."""
    asked = os.environ.get(THREADS_ENV, "").strip()
    if asked.isdigit() and int(asked) > 0:
        return ThreadChoice(int(asked), f"{THREADS_ENV}={asked}")
    if os.environ.get("OMP_NUM_THREADS"):
        return ThreadChoice(current, f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}")
    cores = usable_cores()
    load = other_load()
    free = free_cores(cores, load)
    return ThreadChoice(min(current, free), f"{cores} cores, load {load:.1f}: {free} free")


def configure() -> ThreadChoice | None:
    """Set torch's thread counts for this process once (None: BAPO_THREADS=legacy, untouched)."""
    if legacy():
        return None
    import torch

    choice = choose(torch.get_num_threads())
    torch.set_num_threads(choice.threads)
    with contextlib.suppress(RuntimeError):  # only possible before the first inter-op work
        torch.set_num_interop_threads(1)
    return choice

"""`bapo train --nproc N` runs torchrun as its child: stop signals sent to `bapo` reach the ranks.

torchrun's agent starts every rank in a session of its own and handles SIGTERM, SIGINT, SIGHUP
and SIGQUIT by sending the same signal to each rank, waiting `--shutdown-timeout` (30 s by
default) and then sending SIGKILL. This launcher:
- starts the agent in a session of its own too, so that a Ctrl-C at the terminal reaches it
  once, through this process (twice, the ranks would take the second for "stop now");
- passes SIGINT, SIGTERM, SIGUSR1 and SIGHUP on to the agent, once each, and a second Ctrl-C
  straight to the ranks (which then stop at once, as a single process does);
- has the agent handle SIGUSR1 as well (`PET_SIGNALS_TO_HANDLE`; SIGUSR1's default action would
  end the agent and orphan the ranks) and wait for the ranks longer than their stop grace plus a
  save (`PET_SHUTDOWN_TIMEOUT`), unless the environment sets either already;
- runs torchrun's agent through `exit_quietly_on_signal` below (`agent_main` for torchrun's own
  `main`, across nodes; bapo_cli.launch.loopback on one node), where the SignalException
  torchrun raises once it has passed a signal on ends in exit 128 + N instead of a traceback;
- exits 128 + the first signal it received once torchrun has ended, else torchrun's own code.
The ranks handle the signals themselves (bapo_cli.trainer.interrupt) and agree on the step to
stop at (bapo_cli.trainer.stopping).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP)
AGENT_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"
SAVE_ALLOWANCE_S = 300  # what the agent waits for the ranks beyond their grace (a save)
UNBOUNDED_WAIT_S = 7 * 24 * 3600  # trainer.stop_grace_s=0: the step may take as long as it does


def agent_env(grace_s: float, env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for torchrun: SIGUSR1 handled, and a shutdown wait that covers the
    ranks' stop grace and their save (the user's own settings win)."""
    env = dict(os.environ if env is None else env)
    env.setdefault("PET_SIGNALS_TO_HANDLE", AGENT_SIGNALS)
    wait = UNBOUNDED_WAIT_S if grace_s <= 0 else int(grace_s) + SAVE_ALLOWANCE_S
    env.setdefault("PET_SHUTDOWN_TIMEOUT", str(wait))
    return env


TORCHRUN = ["-m", "torch.distributed.run"]


def agent_command(command: list[str]) -> list[str]:
    """torchrun's command (`python -m torch.distributed.run ...`) run through `agent_main`."""
    if command[1:3] == TORCHRUN:
        return [command[0], "-m", "bapo_cli.launch.forward", *command[3:]]
    return command


def exit_quietly_on_signal(agent: Callable[[], object]) -> None:
    """Run torchrun's agent; the SignalException it raises once it has passed a stop signal on
    to the ranks ends this process with 128 + N, not a traceback (both torchrun entry points
    use it: `agent_main` below and bapo_cli.launch.loopback, one node's)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    _first_stop_signal_only()
    try:
        agent()
    except SignalException as exc:
        sys.exit(128 + int(exc.sigval))


def _first_stop_signal_only() -> None:
    """torchrun's agent raises SignalException at every stop signal, and a repeat inside its
    wait for the ranks' save ends that wait (SLURM signals every process of a job, the batch
    script passes the signal on, a user repeats it; three were enough): it left the ranks
    saving, orphaned. The agent now acts on the first and ignores the rest (the ranks get
    theirs directly or from the first)."""
    from torch.distributed.elastic.multiprocessing import api

    act = api._terminate_process_handler
    seen: list[int] = []

    def first_only(signum: int, frame: object) -> None:
        if not seen:
            seen.append(signum)
            act(signum, frame)

    api._terminate_process_handler = first_only


def agent_main(argv: list[str]) -> None:
    """torchrun's `main`; a stop signal it passed on to the ranks ends it with 128 + N."""
    from torch.distributed.run import main

    exit_quietly_on_signal(lambda: main(argv))


def run(command: list[str], env: dict[str, str]) -> int:
    """`command` (torchrun) to its end, stop signals passed on; its exit code, or 128 + the
    first stop signal this process received."""
    received: list[int] = []

    def note(signum: int, _frame: object) -> None:
        received.append(signum)

    previous = {s: signal.signal(s, note) for s in FORWARDED}  # before the start: no gap
    try:
        proc = subprocess.Popen(command, env=env, start_new_session=True)
    except BaseException:
        _restore(previous)
        raise
    passed = 0
    try:
        while True:
            with contextlib.suppress(subprocess.TimeoutExpired):
                code = proc.wait(timeout=0.2)
                break
            while passed < len(received):
                _pass_on(proc.pid, received[passed], received[:passed])
                passed += 1
    finally:
        if proc.poll() is None:  # this process is failing: leave nothing behind
            _pass_on(proc.pid, signal.SIGTERM, [])
            proc.wait()
        _restore(previous)
    if received:
        return 128 + received[0]
    return code if code >= 0 else 128 - code


def _pass_on(agent: int, signum: int, before: list[int]) -> None:
    """The first of each signal to the agent; a second Ctrl-C to the ranks themselves."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if signum == signal.SIGINT and signal.SIGINT in before:
            for rank in _children(agent):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(rank, signal.SIGINT)
        elif signum not in before:
            os.kill(agent, signum)


def _children(pid: int) -> list[int]:
    """The direct children of `pid` (Linux /proc; none elsewhere)."""
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError, ValueError):
            out += [int(c) for c in (task / "children").read_text().split()]
    return out


def _restore(previous: dict[int, object]) -> None:
    for signum, handler in previous.items():
        signal.signal(signum, handler)


if __name__ == "__main__":
    agent_main(sys.argv[1:])

"""The process between `bapo serve` and its vLLM server: when `bapo serve` is gone, however it
ended (SIGKILL included), the server's whole process tree is stopped.

    python -m bapo_cli.rollout.serve_watch PARENT_PID GRACE_S -- python -m vllm... ARGS

Why a process of its own: the API server ignores a SIGTERM that comes during its start-up, and
its EngineCore does not notice its parent's death (docs/faults.md), so neither a signal to the
API server alone nor PR_SET_PDEATHSIG on it takes the whole server down. This
process leads the session and process group the server runs in (`bapo serve` starts it with
`start_new_session`), starts the server as its child and watches two things: its parent (a
changed parent pid: `bapo serve` is gone) and the stop signals. Either one: SIGTERM to the group,
and SIGKILL to the group (this process included) once the API server has exited or `GRACE_S`
has passed. When the server exits by itself, this process exits with its code and `bapo serve`
stops what is left of the group. Standard library only: it starts in milliseconds.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

POLL_S = 0.2  # how often the parent and the server are looked at
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def main(argv: list[str]) -> int:
    parent, grace_s, cmd = int(argv[0]), float(argv[1]), argv[3:]
    if os.getpgrp() != os.getpid():  # the group it stops must be the server's alone
        sys.stderr.write("serve_watch: start it as a process group leader (start_new_session)\n")
        return 2
    received: list[int] = []
    for sig in STOP_SIGNALS:  # noted; the loop below acts on them
        signal.signal(sig, lambda signum, _frame: received.append(signum))
    if os.getppid() != parent:  # `bapo serve` died before this process could start the server
        return 128 + signal.SIGTERM
    server = subprocess.Popen(cmd, stdin=subprocess.DEVNULL)  # in this process's group
    while server.poll() is None:
        if received or os.getppid() != parent:
            stop_group(server, grace_s)
        with contextlib.suppress(subprocess.TimeoutExpired):
            server.wait(timeout=POLL_S)
    code = server.returncode
    return code if code >= 0 else 128 - code


def stop_group(server: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM to this process's group, SIGKILL to all of it (this process too) once `server`
    has exited or `grace_s` has passed."""
    os.killpg(0, signal.SIGTERM)  # noted by this process's own handler
    deadline = time.monotonic() + grace_s
    while server.poll() is None and time.monotonic() < deadline:
        time.sleep(POLL_S)
    os.killpg(0, signal.SIGKILL)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

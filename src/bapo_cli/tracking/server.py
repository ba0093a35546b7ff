"""Talking to a tracking store that may be down or may hold credentials in its URI: MLflow's
HTTP retries shortened so an outage does not stall training for minutes, run links that would
print the URI's credentials suppressed, and a store error cut to one masked line."""

from __future__ import annotations

import logging
import os

from bapo_cli import redact

# Every tracking module logs here: users filter or silence one logger for all tracking warnings.
logger = logging.getLogger("bapo_cli.tracking")

# MLflow's REST client retries a refused connection 7 times with exponential backoff and waits
# 120 s for an answer: minutes of stalled training per flush while a server is down. These apply
# to http(s) URIs unless the user set the variable (read by mlflow.utils.rest_utils on each call).
FAIL_FAST_HTTP = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "0",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "10",
}


def fail_fast_http(uri: str) -> None:
    """Short HTTP retries and timeouts for a tracking server (the user's own settings win)."""
    if uri.startswith(("http://", "https://")):
        for name, value in FAIL_FAST_HTTP.items():
            os.environ.setdefault(name, value)
    hide_run_links(uri)


QUIET_LINKS = "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"


def hide_run_links(uri: str) -> None:
    """MLflow prints "View run ... at: <uri>/#/..." when a run on a server ends, credentials
    and all: not for a URI that holds any (the summary table names the run, masked)."""
    if redact.text(uri) != uri:
        os.environ[QUIET_LINKS] = "true"


def describe_failure(exc: BaseException) -> str:
    """One short line for a store error (MLflow's connection errors run to 400 characters, and
    name the URL, credentials included: masked here)."""
    text = redact.text(str(exc))
    for needle, short in (
        ("Connection refused", "connection refused"),
        ("timed out", "timed out"),
        ("Name or service not known", "unknown host"),
    ):
        if needle in text:
            return short
    first = text.strip().splitlines()[0] if text.strip() else ""
    return f"{type(exc).__name__}: {first[:160]}" if first else type(exc).__name__


# After SIGTERM/SIGINT is passed on, the UI's process group gets this long to exit before
# SIGKILL (uvicorn closes its socket in well under a second when idle).
UI_STOP_TIMEOUT_S = 10.0


def run_ui(uri: str, port: int, host: str = "127.0.0.1") -> int:
    """`mlflow ui` on `uri` until it exits or this process is told to stop; its exit code.

    The UI runs in a process group of its own (it forks uvicorn workers) so that SIGTERM,
    SIGINT and SIGHUP sent to `bapo ui` are passed on to all of it, and whatever way this
    function ends, the group is stopped (SIGTERM, then SIGKILL): nothing is left listening.
    The URI goes in the environment (`MLFLOW_BACKEND_STORE_URI`), not the command line that
    other users can list, and the UI's output is relayed line by line, masked: MLflow's own
    error lines print the URI, credentials included."""
    import signal
    import subprocess
    import sys

    command = [sys.executable, "-m", "mlflow", "ui", "--host", host, "--port", str(port)]
    env = {**os.environ, "MLFLOW_BACKEND_STORE_URI": uri}
    received: list[int] = []
    started: list[subprocess.Popen] = []

    def forward(signum: int, _frame: object) -> None:
        received.append(signum)
        for proc in started:  # none yet: stopped as soon as it exists (below)
            _signal_group(proc.pid, signum)

    stops = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
    previous = {s: signal.signal(s, forward) for s in stops}  # before the start: no gap
    try:
        proc = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
            text=True,
            errors="replace",
        )
    except BaseException:
        for s, handler in previous.items():
            signal.signal(s, handler)
        raise
    started.append(proc)
    try:
        if received:  # a signal came while it started
            _signal_group(proc.pid, received[0])
        for line in proc.stdout:  # EOF once the UI (and every worker holding the pipe) exits
            sys.stderr.write(redact.text(line))
            sys.stderr.flush()
        code = proc.wait()
    finally:
        stop_group(proc)
        for s, handler in previous.items():
            signal.signal(s, handler)
    if received:
        return 128 + received[0]  # the shell's convention for "ended by signal N"
    return code if code >= 0 else 128 - code


def _signal_group(pgid: int, signum: int) -> None:
    import contextlib
    import signal

    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.Signals(signum))


def stop_group(proc: object) -> None:
    """SIGTERM to a child's whole process group, SIGKILL after `UI_STOP_TIMEOUT_S`; reaped."""
    import contextlib
    import signal
    import subprocess

    _signal_group(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=UI_STOP_TIMEOUT_S)
    _signal_group(proc.pid, signal.SIGKILL)  # workers of a leader that already exited
    proc.wait()

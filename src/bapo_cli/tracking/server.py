"""Talking to a tracking store that may be down or may hold credentials in its URI: MLflow's
HTTP retries shortened so an outage does not stall training for minutes, run links that would
print the URI's credentials suppressed, and a store error cut to one masked line."""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any

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


# After a stop signal, the UI's process group gets this long to exit before SIGKILL (uvicorn
# closes its socket in well under a second when idle).
UI_STOP_TIMEOUT_S = 10.0
# How often the waiting loop looks at the server and at the stop signals received.
UI_POLL_S = 0.2


def run_ui(uri: str, port: int, host: str = "127.0.0.1") -> int:
    """`mlflow ui` on `uri` until it exits or this process is told to stop; its exit code.

    The UI runs in a process group of its own (`mlflow ui` and the uvicorn it starts, one web
    worker, no job runner: `ui_env`). SIGTERM, SIGINT and SIGHUP sent to `bapo ui` all stop it
    the same way: SIGTERM to the whole group, SIGKILL to what is left after `UI_STOP_TIMEOUT_S`,
    and `bapo ui` exits 128 + the signal it got. Not passed on as they came, because a
    multi-worker uvicorn reads SIGHUP as "restart the workers" (with MLflow's 4 workers a closed
    terminal or ssh session left the server running, this process waiting on it), and a SIGINT
    that reaches uvicorn prints a KeyboardInterrupt traceback. The output is relayed by a
    thread, so no child holding the pipe can keep this process from stopping the group.

    The URI goes in the environment (`MLFLOW_BACKEND_STORE_URI`), not the command line that
    other users can list, and the UI's output is relayed line by line, masked: MLflow's own
    error lines print the URI, credentials included."""
    import signal
    import subprocess
    import sys
    import threading

    command = [sys.executable, "-m", "mlflow", "ui", "--host", host, "--port", str(port)]
    command += ["--workers", "1"]  # one person's browser: MLflow's 4 web workers by default
    command += ["--uvicorn-opts", "--log-level warning"]  # its warnings and errors, no INFO
    env = {**os.environ, "MLFLOW_BACKEND_STORE_URI": uri, **ui_env()}
    received: list[int] = []  # the handler only appends: the main loop below acts on it

    def note(signum: int, _frame: object) -> None:
        received.append(signum)

    stops = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
    previous = {s: signal.signal(s, note) for s in stops}  # before the start: no gap
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
    relay = threading.Thread(target=_relay, args=(proc.stdout,), daemon=True)
    relay.start()
    try:
        while not received and proc.poll() is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=UI_POLL_S)
    finally:
        stop_group(proc)
        relay.join(timeout=UI_STOP_TIMEOUT_S)  # EOF once nothing in the group holds the pipe
        for s, handler in previous.items():
            signal.signal(s, handler)
    if received:
        return 128 + received[0]  # the shell's convention for "ended by signal N"
    code = proc.returncode
    return code if code >= 0 else 128 - code


# MLflow 3.17 imports starlette.middleware.wsgi, which Starlette 1.x warns about in every worker
STARLETTE_WSGI_WARNING = "ignore:starlette.middleware.wsgi is deprecated"


# MLflow 3's server also starts a job runner and 7 Huey consumers (GenAI jobs: scorers, prompt
# optimisation), each a Python process importing MLflow; the UI of training runs uses none
JOB_EXECUTION = "MLFLOW_SERVER_ENABLE_JOB_EXECUTION"


def ui_env() -> dict[str, str]:
    """The UI's environment additions: MLflow's own logs from WARNING up, no Starlette
    deprecation warning (the user's PYTHONWARNINGS kept) and no job runner (unless the user
    set MLFLOW_SERVER_ENABLE_JOB_EXECUTION)."""
    warnings = [w for w in (os.environ.get("PYTHONWARNINGS"), STARLETTE_WSGI_WARNING) if w]
    env = {"MLFLOW_LOGGING_LEVEL": "WARNING", "PYTHONWARNINGS": ",".join(warnings)}
    env[JOB_EXECUTION] = os.environ.get(JOB_EXECUTION, "false")
    return env


def _relay(stream: Any) -> None:
    """The UI's output to stderr, masked, until EOF; a closed stderr (the terminal went away)
    does not stop the reading, or a full pipe would block the server."""
    import sys

    for line in stream:
        with contextlib.suppress(OSError, ValueError):
            sys.stderr.write(redact.text(line))
            sys.stderr.flush()


def _signal_group(pgid: int, signum: int) -> None:
    import signal

    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.Signals(signum))


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stop_group(proc: Any) -> None:
    """SIGTERM to a child's whole process group, SIGKILL to whatever of the group is left after
    `UI_STOP_TIMEOUT_S` (workers outlive a leader that exits at once); the leader reaped."""
    import signal
    import time

    _signal_group(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + UI_STOP_TIMEOUT_S
    while time.monotonic() < deadline:
        proc.poll()  # reap the leader: a zombie would keep the group "alive"
        if not _group_alive(proc.pid):
            break
        time.sleep(UI_POLL_S)
    _signal_group(proc.pid, signal.SIGKILL)
    proc.wait()

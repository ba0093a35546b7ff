"""Talking to a tracking store that may be down or may hold credentials in its URI: MLflow's
HTTP retries shortened so an outage does not stall training for minutes, run links that would
print the URI's credentials suppressed, and a store error cut to one masked line."""

from __future__ import annotations

import logging
import os

from bapo_cli.tracking import redact

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

"""Fail fast, and quietly, when the Hugging Face hub cannot be reached.

Loading a model or dataset by hub id with no network made huggingface_hub retry every request with
back-off: 22–44 retry warnings over 25–70 s before the one-line error. So before the first hub
access a run checks once whether the hub can be used at all: `HF_HUB_OFFLINE=1` (or
`TRANSFORMERS_OFFLINE=1`) says no, and so does an endpoint (`HF_ENDPOINT`, default
https://huggingface.co) that does not accept a TCP connection within `PROBE_TIMEOUT_S`. Then the
HF libraries are switched to offline mode for this process and its children: a copy in the local
HF cache still loads, anything else fails at once, and the caller's error says how to pass a
local path instead.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
from urllib.parse import urlsplit

PROBE_TIMEOUT_S = 3.0
"""How long the one connection attempt to the hub endpoint may take (DNS included)."""
DEFAULT_ENDPOINT = "https://huggingface.co"

_TRUE = {"1", "on", "yes", "true"}
_checked: dict[str, str | None] = {}


def endpoint() -> str:
    return os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT


def offline_reason() -> str | None:
    """Why the hub cannot be used now ("HF_HUB_OFFLINE=1", "cannot connect to <endpoint>: ..."),
    or None when it answers. Probed once per process and endpoint."""
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
        if os.environ.get(name, "").strip().lower() in _TRUE:
            return f"{name}={os.environ[name]}"
    url = endpoint()
    if url not in _checked:
        _checked[url] = _probe(url)
    return _checked[url]


def _probe(url: str) -> str | None:
    """One TCP connection to the endpoint's host and port, in a thread so that a hanging DNS
    lookup also ends after PROBE_TIMEOUT_S."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    port = parts.port or (443 if parts.scheme == "https" else 80)
    outcome: list[str | None] = []

    def connect() -> None:
        try:
            with socket.create_connection((host, port), timeout=PROBE_TIMEOUT_S):
                outcome.append(None)
        except OSError as err:
            outcome.append(err.strerror or type(err).__name__)

    thread = threading.Thread(target=connect, daemon=True)
    thread.start()
    thread.join(PROBE_TIMEOUT_S + 0.5)
    if not outcome:
        return f"cannot connect to {url}: no answer within {PROBE_TIMEOUT_S:.0f} s"
    return None if outcome[0] is None else f"cannot connect to {url}: {outcome[0]}"


def go_offline_if_unreachable() -> str | None:
    """Put huggingface_hub, transformers and datasets into offline mode when the hub cannot be
    used (returns why), so a load by hub id reads the local cache or fails at once, no retries."""
    reason = offline_reason()
    if reason is None:
        return None
    os.environ["HF_HUB_OFFLINE"] = "1"  # children (engines, workers) and modules not yet imported
    try:
        from huggingface_hub import constants

        constants.HF_HUB_OFFLINE = True
    except ImportError:  # pragma: no cover - a dependency of transformers
        pass
    datasets_config = sys.modules.get("datasets.config")
    if datasets_config is not None:  # it copied the flag when imported
        datasets_config.HF_HUB_OFFLINE = True
        datasets_config.HF_DATASETS_OFFLINE = True
    return reason

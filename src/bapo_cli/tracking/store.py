"""Where runs live: the store behind a tracking URI, created safely when several processes
open it at once, and the experiment (with its artifact location) every writer needs first."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def sqlite_path(uri: str) -> Path | None:
    """The file behind a `sqlite:///...` URI, else None."""
    prefix = "sqlite:///"
    return Path(uri[len(prefix) :]) if uri.startswith(prefix) else None


def store_exists(uri: str) -> bool:
    """False for a local store that was never written (reading it would create it)."""
    path = sqlite_path(uri)
    if path is not None:
        return path.is_file()
    if uri.startswith("file:") or "://" not in uri:
        return Path(uri.removeprefix("file://").removeprefix("file:")).is_dir()
    return True


ARTIFACTS_DIR = "mlartifacts"  # next to a SQLite store: outputs/mlflow.db -> outputs/mlartifacts


def artifact_location(uri: str) -> str | None:
    """Where a new experiment keeps its artifacts: beside a SQLite store, never in the cwd of
    whichever run created the experiment (MLflow's default, ./mlruns). None (the store decides)
    for a file store, which keeps them inside itself, and for a server, which has its own root."""
    path = sqlite_path(uri)
    return None if path is None else str(path.resolve().parent / ARTIFACTS_DIR)


@contextlib.contextmanager
def store_lock(uri: str) -> Iterator[None]:
    """Held while a process opens a SQLite store: the first to open a fresh store creates its
    tables (MLflow's schema migration), and two doing it at once fail ("table ... already
    exists"). The lock file sits beside the store; other URIs need no lock."""
    path = sqlite_path(uri)
    if path is None:
        yield
        return
    from filelock import FileLock

    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(f"{path}.lock"):
        yield


def ensure_experiment(client: Any, name: str, artifact_location: str | None = None) -> str:
    """The experiment's id, created if missing (tolerating a concurrent creator)."""
    found = client.get_experiment_by_name(name)
    if found is not None:
        return found.experiment_id
    try:
        return client.create_experiment(name, artifact_location=artifact_location)
    except Exception:
        found = client.get_experiment_by_name(name)
        if found is None:
            raise
        return found.experiment_id


def open_experiment(uri: str, experiment: str) -> tuple[Any, str]:
    """(client, experiment id) with the store and the experiment created if missing, under the
    store's lock: what every writer (a single run, a sweep's launcher) does first."""
    from mlflow.tracking import MlflowClient

    with store_lock(uri):
        client = MlflowClient(tracking_uri=uri)
        return client, ensure_experiment(client, experiment, artifact_location(uri))

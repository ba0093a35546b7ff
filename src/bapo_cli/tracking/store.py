"""Where runs live: the store behind a tracking URI, created safely (and private) when several
processes open it at once, the client every command talks to it through (fail-fast HTTP), and
the experiment (with its artifact location) every writer needs first."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bapo_cli import redact
from bapo_cli.tracking.server import fail_fast_http


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


def client(uri: str) -> Any:
    """An `MlflowClient` for `uri`, with MLflow's HTTP retries cut short first: every command
    that talks to a store (`bapo train`, `eval`, `runs`, `report`, a sweep's parent run) fails
    in seconds on a server that is down, not after minutes of silent retries."""
    from mlflow.tracking import MlflowClient

    fail_fast_http(uri)
    return MlflowClient(tracking_uri=uri)


def experiment_name(name: str) -> str:
    """The experiment name as stored: masked like everything else that leaves the process
    (`tracking.experiment` is free text). Idempotent, so readers look names up the same way."""
    return redact.text(name)


PRIVATE_FILE = 0o600  # a SQLite store holds the params and tags of every run


def create_private(path: Path) -> None:
    """Create an empty SQLite store file readable by its owner only, if none exists (SQLite
    takes an empty file as a new database; its journal files copy the file's mode)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, PRIVATE_FILE))


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
        create_private(path)
        yield


def ensure_experiment(client: Any, name: str, artifact_location: str | None = None) -> str:
    """The experiment's id, created if missing (tolerating a concurrent creator); `name` is
    stored masked (`experiment_name`)."""
    name = experiment_name(name)
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
    with store_lock(uri):
        mlflow = client(uri)
        return mlflow, ensure_experiment(mlflow, experiment, artifact_location(uri))


def ui_address(uri: str, experiment: str, host: str, port: int) -> str:
    """Where `bapo ui` should be opened: the runs of `experiment` (MLflow 3 opens an experiment
    on its GenAI traces page, empty for training runs), else the UI's front page. Only a local
    store is looked into: a server's UI is not what `bapo ui` starts."""
    base = f"http://{host}:{port}/"
    local = sqlite_path(uri) is not None or uri.startswith("file:") or "://" not in uri
    if not (local and store_exists(uri)):
        return base
    try:
        found = client(uri).get_experiment_by_name(experiment_name(experiment))
    except Exception:  # noqa: BLE001  (an unreadable store: the UI itself will say why)
        return base
    return base if found is None else f"{base}#/experiments/{found.experiment_id}/runs"

"""What a run's tracking settings can be known to fail at, checked before the model loads.

The trackers start after the model is loaded (seconds here, minutes for a real model), and a URI
MLflow has no store for (`ftp://...`), a store or log dir that cannot be created, or a
TensorBoard dir that already holds another run's event files (that run's steps count as logged,
so this one would log nothing) would only show then. `settings_error` finds them from the config
alone, without importing MLflow or TensorBoard and without creating anything; config/preflight.py
calls it. Reachability of a server is left to the start (it fails fast: tracking.server).

A TensorBoard log dir names its run in `RUN_MARKER` (written by tensorboard_tracker), so that a
resume of that run is told from a second run pointed at the same directory.
"""

from __future__ import annotations

import os
import re
import tempfile
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from bapo_cli.tracking.store import sqlite_path

DATABASES = ("postgresql", "mysql", "mssql")  # sqlite is a file here: checked as one
NAMED_STORES = ("databricks", "databricks-uc", "uc")  # bare names, or databricks://PROFILE
WEB = ("http", "https")
STORE_ENTRY_POINTS = "mlflow.tracking_store"  # MLflow's plugin stores register their scheme here
URI_FORMS = (
    "sqlite:///PATH, a directory (PATH or file:PATH), http(s)://HOST[:PORT], databricks, or a "
    "database (postgresql://, mysql://, mssql://)"
)
RUN_MARKER = ".bapo-run"
"""In a TensorBoard log dir: the run dir of the run whose event files it holds."""
EVENTS_GLOB = "events.out.tfevents.*"


def plugin_schemes() -> set[str]:
    """URI schemes of MLflow tracking-store plugins installed (their entry points)."""
    return {ep.name for ep in entry_points(group=STORE_ENTRY_POINTS)}


def uri_error(uri: str) -> str | None:
    """One line when MLflow could not use `uri` as a tracking store, else None: a scheme it
    has no store for, a server URL without a host, a local store that cannot be created or
    written."""
    shown = f"tracking.uri={uri}"
    scheme = urlparse(uri).scheme.lower()
    scheme = "" if len(scheme) == 1 else scheme  # a drive letter: MLflow takes a path
    if uri in NAMED_STORES or scheme in NAMED_STORES or scheme in plugin_schemes():
        return None
    if scheme.split("+")[0] in DATABASES:  # postgresql+psycopg2://...
        return None
    if scheme in WEB:
        if not urlparse(uri).hostname:
            return f"{shown}: no host in the server URL; give {scheme}://HOST[:PORT]"
        return None
    if scheme == "sqlite":
        path = sqlite_path(uri)
        if path is None or not str(path) or str(path) == ":memory:":
            return (
                f"{shown}: a SQLite store is a file: sqlite:///relative/path.db or "
                "sqlite:////absolute/path.db"
            )
        line = path_error(path, directory=False)
        return None if line is None else f"{shown}: {line}"
    if scheme in ("", "file"):
        path = Path(re.sub(r"^file:(//)?", "", uri)) if scheme else Path(uri)
        line = path_error(path, directory=True)
        if line is None and file_store_refused():
            line = (
                "this MLflow refuses directory stores (its file backend is in maintenance "
                "mode) unless MLFLOW_ALLOW_FILE_STORE=true is set; use sqlite:///PATH.db"
            )
        return None if line is None else f"{shown}: {line}"
    return f"{shown}: MLflow has no store for {scheme}:// URIs; give {URI_FORMS}"


def path_error(path: Path, *, directory: bool) -> str | None:
    """One line when `path` (a directory, or a file when not `directory`) cannot be created or
    written, else None. Tried, not inferred from permission bits (root passes those, and /proc
    or a read-only mount refuse root): a nameless temporary file in the directory that would
    hold it (the nearest existing ancestor), gone when closed; an existing file is opened for
    appending and closed unchanged."""
    kind = "directory" if directory else "file"
    path = Path(os.path.abspath(path))
    if path.exists():
        if path.is_dir() != directory:
            return f"{path} exists and is not a {kind}"
        why = _write_error(path) if directory else _append_error(path)
        return None if why is None else f"cannot write to the {kind} {path} ({why})"
    parent = path.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        return f"cannot create the {kind} {path}: {parent} is a file, not a directory"
    why = _write_error(parent)
    return None if why is None else f"cannot create the {kind} {path} in {parent} ({why})"


def _write_error(directory: Path) -> str | None:
    try:
        with tempfile.TemporaryFile(dir=directory):
            return None
    except OSError as exc:
        return exc.strerror or type(exc).__name__


def _append_error(file: Path) -> str | None:
    try:
        with open(file, "ab"):
            return None
    except OSError as exc:
        return exc.strerror or type(exc).__name__


def file_store_refused() -> bool:
    """True when the installed MLflow refuses directory (file) stores: MLflow 3 keeps its
    file backend in maintenance mode and raises unless MLFLOW_ALLOW_FILE_STORE=true. Imports
    MLflow, only for such a URI (an older MLflow without the switch accepts them)."""
    try:
        from mlflow.environment_variables import MLFLOW_ALLOW_FILE_STORE
    except ImportError:
        return False
    try:
        return not MLFLOW_ALLOW_FILE_STORE.get()
    except Exception:  # a value MLflow cannot read as a boolean: it would refuse it as well
        return True


def run_of(log_dir: Path) -> str | None:
    """The run dir named in `log_dir`'s RUN_MARKER, None if it has none."""
    try:
        return (log_dir / RUN_MARKER).read_text().strip() or None
    except OSError:
        return None


def holds_events(log_dir: Path) -> bool:
    """True when `log_dir` (not its subdirectories) holds TensorBoard event files."""
    return log_dir.is_dir() and any(log_dir.glob(EVENTS_GLOB))


def same_dir(a: str | Path, b: str | Path) -> bool:
    return os.path.realpath(a) == os.path.realpath(b)


def foreign_events_error(log_dir: Path, run_dir: str | Path | None, *, resume: bool) -> str | None:
    """One line when `log_dir` holds event files this run may not append to, else None.

    They are this run's when its RUN_MARKER names `run_dir`. Without a marker (event files
    written otherwise, or before markers were) or without `run_dir` (not known yet), only a
    resume may append; any other run would take their steps as logged and log nothing."""
    if not holds_events(log_dir):
        return None
    owner = run_of(log_dir)
    if owner is None or run_dir is None:
        if resume:
            return None
    elif same_dir(owner, run_dir):
        return None
    whose = f"the run in {owner}" if owner is not None else "another run"
    again = f"; or resume that run (trainer.resume=true hydra.run.dir={owner})" if owner else ""
    return (
        f"tracking.tensorboard.log_dir={log_dir}: already holds the event files of {whose}, and "
        "this run would log nothing there (their steps count as logged); give each run a "
        f"directory of its own (e.g. tracking.tensorboard.log_dir={log_dir}/NAME, all of them "
        f"shown together by tensorboard --logdir {log_dir}){again}"
    )


def settings_error(
    settings: Any, *, resume: bool = False, run_dir: str | Path | None = None
) -> str | None:
    """The first thing wrong with a run's `tracking` settings that shows without starting a
    tracker (see the module's docstring), or None. `run_dir`: the run's dir when the command
    line names it (a resume), for the TensorBoard check."""
    backends = list(settings.backends)
    if "mlflow" in backends:
        line = uri_error(settings.uri)
        if line is not None:
            return line
    log_dir = settings.tensorboard.log_dir
    if "tensorboard" in backends and log_dir is not None:
        line = path_error(Path(log_dir), directory=True)
        if line is not None:
            return f"tracking.tensorboard.log_dir={log_dir}: {line}"
        return foreign_events_error(Path(log_dir), run_dir, resume=resume)
    return None

"""Reading runs back for `bapo runs`: newest first, one row each, without creating a store
that was never written."""

from __future__ import annotations

from dataclasses import dataclass

from bapo_cli.tracking.store import client as store_client
from bapo_cli.tracking.store import experiment_name, store_exists


@dataclass(frozen=True)
class RunRow:
    run_id: str
    experiment: str
    name: str
    status: str
    start: str
    metrics: dict[str, float]


def list_runs(uri: str, experiment: str | None = None, limit: int = 50) -> list[RunRow]:
    """Newest runs first, across experiments unless one is named."""
    from datetime import datetime

    if not store_exists(uri):
        return []
    client = store_client(uri)  # fail-fast HTTP: a server that is down fails in seconds
    experiments = client.search_experiments()
    if experiment is not None:
        experiments = [e for e in experiments if e.name == experiment_name(experiment)]
    names = {e.experiment_id: e.name for e in experiments}
    if not names:
        return []
    runs = client.search_runs(
        list(names), order_by=["attributes.start_time DESC"], max_results=limit
    )
    return [
        RunRow(
            run_id=r.info.run_id,
            experiment=names[r.info.experiment_id],
            name=r.info.run_name or "",
            status=r.info.status,
            start=datetime.fromtimestamp(r.info.start_time / 1000).strftime("%Y-%m-%d %H:%M:%S"),
            metrics=dict(r.data.metrics),
        )
        for r in runs
    ]

"""failures.md (`bapo report --failures`): where held-out accuracy goes in the pair-search runs.
Each run's final checkpoint and its starting weights are sampled again on the held-out split and
every wrong sample is classed (`evaluation.failures`); this module turns those classes into one
row per group.

The one part of the report that needs the evaluation stack (models, the transformers engine,
torch): `write_report` imports this module only when `--failures` is given, so a plain report
starts without loading torch. The report package sits above `evaluation` in the layers for it.
"""

from __future__ import annotations

from pathlib import Path

from rich.progress import track

from bapo_cli.evaluation import failures
from bapo_cli.report.runs import RunData
from bapo_cli.report.tables import fmt


def failure_table(
    runs: list[RunData], cache_path: Path
) -> tuple[list[str], list[list[str]]] | None:
    """Where held-out accuracy goes, per group (None when no run has a checkpoint of the pair
    search): the share of held-out samples in each class of `evaluation.failures.CLASSES`, at the
    run's starting weights and at its final checkpoint (each sampled again with the run's seed,
    8 samples per problem), seed means. A run without a final checkpoint or start weights on this
    machine is left out and counted in "runs sampled"."""
    cache = failures.FailureCache(cache_path)
    groups: dict[str, list[tuple[dict[str, float], dict[str, float]]]] = {}
    sizes: dict[str, int] = {}
    for run in track(runs, description="held-out failures", transient=True):
        sizes[run.group] = sizes.get(run.group, 0) + 1
        if run.params.get("data.kind") != "pairs" or run.run_dir is None:
            continue
        final = failures.final_checkpoint(Path(run.run_dir))
        start = failures.start_weights(run.params)
        if final is None or start is None:
            continue
        seed = int(run.params.get("trainer.seed", 0))
        length = int(run.params.get("model.max_model_len", 96))
        n = int(run.params.get("trainer.val_n", 8))
        pair = [
            failures.shares(cache.counts(d, seed=seed, n=n, max_model_len=length))
            for d in (start, final)
        ]
        groups.setdefault(run.group, []).append((pair[0], pair[1]))
    if not groups:
        return None
    header = ["group", "runs sampled"]
    header += [f"{c} {when}" for c in failures.CLASSES for when in ("start", "final")]
    rows = []
    for group, pairs in groups.items():
        cells = [group, f"{len(pairs)}/{sizes[group]}"]
        for c in failures.CLASSES:
            for i in (0, 1):
                cells.append(fmt(sum(p[i][c] for p in pairs) / len(pairs)))
        rows.append(cells)
    return header, rows

"""`bapo report`: compare tracked runs in a table and in plots, offline, from the MLflow store.

    bapo report --sweep outputs/sweeps/2026-01-01/12-00-00     # the jobs of one `bapo train -m`
    bapo report --experiment staleness_study                   # every run of an experiment
    bapo report 4ae6d249... 9939f111...                        # these runs

Each run is labelled by its config facets (`facets`): the config it recorded (MLflow params,
`trainer.lr=0.0003`), its group choices (`algo=grpo` from `algo.name`), and for a sweep job the
overrides it was typed with (`experiment=study_v2_reuse8`, the `bapo.overrides` tag). The label
keeps the keys whose values differ between the runs compared and drops those the kept ones already
determine, so runs started one by one and the jobs of one or many sweeps are labelled, grouped and
compared alike. Runs whose labels differ only in `trainer.seed` form a group: the report then adds
a table of seed means ± standard deviations, and the plots draw one line per group (seed mean,
band from min to max).

Written into the report dir (default `<sweep dir>/report`, else `<output root>/reports/<time>`):
`runs.md` / `runs.csv` (one row per run), `groups.md` / `groups.csv` (with seeds), and one PNG
per metric family. The dir is also logged to the sweep's parent run (artifact path `report`).

"Final" values are means over the last 10% of logged steps (what `train_job` returns, and so
what an Optuna sweep maximizes); "best reward" is the highest per-step `reward/mean`; bounds,
rho, clip fractions and step time are means over all steps; "start rho" is the mean of
`actor/rho` (the mass-weighted positive share every loss reports) over the first 10% of steps.
"held-out start/final" are the first and last logged value of the run's validation metric
(`val/<set>/avg_at_<n>`, the first such key when there are several: `trainer.val_every`).

`--baseline algo=grpo` adds `comparisons.md`: every other group against the baseline group of
its cell (the group holding that facet whose other label keys -- all but the baseline's own key
and its sub-keys, `algo.*` -- have the same values), per outcome the mean difference over seeds and
an exact two-sided permutation p-value (all relabelings of the seeds into the two groups; a
seeded Monte-Carlo sample of 20,000 when there are more), which assumes nothing about the
distribution. With 5 seeds per side the smallest possible p is 2/252 ≈ 0.008.
"""

from __future__ import annotations

import csv
import itertools
import math
import random
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bapo_cli import tracking


class ReportError(Exception):
    """Nothing to report (missing dir, no runs, no metrics); the message says why."""


# metric key -> column / plot; a run that never logged a key shows an empty cell
PLOTS: dict[str, tuple[str, ...]] = {
    "reward": ("reward/mean",),
    "entropy": ("actor/entropy",),
    "clip_bounds": ("actor/c_low", "actor/c_high"),
    "rho": ("bapo/rho_before", "bapo/rho"),
    "clip_fractions": ("actor/clipfrac_low", "actor/clipfrac_high"),
    "grad_norm": ("actor/grad_norm",),
    "staleness": ("staleness/mean",),
}
METRICS = tuple(dict.fromkeys(k for keys in PLOTS.values() for k in keys)) + (
    "perf/step_s",
    "actor/rho",
    "response/length_mean",
    "response/clip_frac",
)
QUADRANTS = ("high_pos", "low_pos", "high_neg", "low_neg")  # diagnostics.QUADRANT_KEYS' order
ENTROPY_EFFECT = {"high_pos": -1, "low_pos": +1, "high_neg": +1, "low_neg": -1}
"""Sign of an active token's first-order effect on entropy (algos.diagnostics.ENTROPY_EFFECT,
restated so the report does not import torch)."""
QUADRANT_KEY = re.compile(r"^tokens/quadrant_(high|low)_(pos|neg)_(active|clipped)_mass$")

VAL_KEY = re.compile(r"^val/.+/avg_at_\d+$")  # the held-out outcome `trainer.val_every` logs


def _val(h: dict[str, list[tuple[int, float]]], which: int) -> float | None:
    """First (which=0) or last (-1) value of the run's first validation metric."""
    keys = sorted(k for k in h if VAL_KEY.match(k))
    return h[keys[0]][which][1] if keys and h[keys[0]] else None


COLUMNS = (  # (header, function of a run's histories)
    ("held-out start", lambda h: _val(h, 0)),
    ("held-out final", lambda h: _val(h, -1)),
    ("held-out change", lambda h: _change(_val(h, 0), _val(h, -1))),
    ("final reward", lambda h: _tail_mean(h.get("reward/mean"))),
    ("best reward", lambda h: max((v for _, v in h.get("reward/mean", [])), default=None)),
    ("start entropy", lambda h: _head_mean(h.get("actor/entropy"))),
    ("final entropy", lambda h: _tail_mean(h.get("actor/entropy"))),
    ("mean c_low", lambda h: _mean(h.get("actor/c_low"))),
    ("mean c_high", lambda h: _mean(h.get("actor/c_high"))),
    ("start rho", lambda h: _head_mean(h.get("actor/rho"))),
    ("mean rho before", lambda h: _mean(h.get("bapo/rho_before"))),
    ("mean rho", lambda h: _mean(h.get("bapo/rho"))),
    ("clipfrac low", lambda h: _mean(h.get("actor/clipfrac_low"))),
    ("clipfrac high", lambda h: _mean(h.get("actor/clipfrac_high"))),
    ("length start", lambda h: _head_mean(h.get("response/length_mean"))),
    ("length final", lambda h: _tail_mean(h.get("response/length_mean"))),
    ("budget hit final", lambda h: _tail_mean(h.get("response/clip_frac"))),
    ("step s", lambda h: _mean(h.get("perf/step_s"))),
)
SEED_KEY = "trainer.seed"  # what varies within a group
IGNORED = ("tracking", "paths", "hydra", "launcher", "sweeper", "trainer.resume")
IGNORED += ("trainer.save_every", "trainer.keep_last", "trainer.log_every", "trainer.log_samples")
IGNORED += ("trainer.dist_timeout_min",)
"""Keys (and their sub-keys) that say where and how a run was logged, saved or launched, not
what it trained: never a facet, so runs of one cell logged to other stores or launched by
another launcher still group together."""


@dataclass
class RunData:
    run_id: str
    name: str
    status: str
    overrides: list[str] | None  # a sweep job's typed overrides; None: started on its own
    histories: dict[str, list[tuple[int, float]]]  # metric -> [(step, value)] by step
    params: dict[str, str] = field(default_factory=dict)  # the config it recorded (flattened)
    parent_id: str | None = None
    facets: dict[str, str] = field(default_factory=dict)  # key -> canonical value (`facets`)
    label: str = ""  # facets whose values differ between the runs in the report
    group: str = ""  # label without the seed
    values: dict[str, float | None] = field(default_factory=dict)
    run_dir: str | None = None  # where its checkpoints are (`bapo.run_dir` tag, or sweep dir/job)


# ------------------------------------------------------------------------------------ reading


def sweep_store(sweep_dir: Path) -> str:
    """The tracking URI the jobs of a sweep dir logged to (from a job's saved config)."""
    from omegaconf import OmegaConf

    if not sweep_dir.is_dir():
        raise ReportError(f"sweep dir {sweep_dir} does not exist")
    configs = sorted(sweep_dir.glob("*/.hydra/config.yaml"))
    if not configs:
        raise ReportError(f"{sweep_dir} holds no job dirs (<job#>/.hydra/config.yaml): not a sweep")
    cfg = OmegaConf.load(configs[0])
    backends = saved_backends(cfg.tracking)
    if not backends:
        raise ReportError(f"the jobs in {sweep_dir} ran with tracking=none: nothing was logged")
    if "mlflow" not in backends:
        raise ReportError(
            f"the jobs in {sweep_dir} logged to {', '.join(backends)} only "
            f"(tracking.backends=[{','.join(backends)}]); bapo report reads MLflow: compare them "
            "there, or log with tracking.backends=[mlflow,...] next time"
        )
    return str(cfg.tracking.uri)


def saved_backends(tracking_cfg: Any) -> list[str]:
    """The backends a saved job config logged to: `backends`, or the single `backend` (mlflow
    or none) of configs written before W&B and TensorBoard were added."""
    if "backends" in tracking_cfg:
        return list(tracking_cfg.backends)
    return [] if tracking_cfg.get("backend", "mlflow") == "none" else ["mlflow"]


def load_runs(
    uri: str,
    *,
    sweep_dir: Path | None = None,
    experiment: str | None = None,
    run_ids: list[str] | None = None,
) -> list[RunData]:
    """Runs of a sweep dir, an experiment or a list of ids, with their metric histories."""
    from bapo_cli.tracking import store

    if not tracking.store_exists(uri):
        raise ReportError(
            f"no MLflow store at {uri}; bapo report reads MLflow, so runs logged only to W&B or "
            "TensorBoard are not there"
        )
    client = store.client(uri)  # fail-fast HTTP: a server that is down fails in seconds
    if sweep_dir is not None:
        where = str(sweep_dir.resolve())
        runs = _search(client, f"tags.`{tracking.SWEEP_DIR_TAG}` = '{where}'")
        runs = [r for r in runs if r.data.tags.get(tracking.ROLE_TAG) != "sweep"]
        if not runs:
            raise ReportError(f"no tracked runs of sweep {where} in {uri}")
    elif experiment is not None:
        found = client.get_experiment_by_name(store.experiment_name(experiment))
        if found is None:
            names = ", ".join(sorted(e.name for e in client.search_experiments()))
            raise ReportError(f"no experiment {experiment!r} in {uri}; there are: {names}")
        runs = client.search_runs([found.experiment_id], max_results=10_000)
        runs = [r for r in runs if r.data.tags.get(tracking.ROLE_TAG) != "sweep"]
        if not runs:
            raise ReportError(f"experiment {experiment!r} has no runs")
    else:
        runs = []
        for run_id in run_ids or []:
            try:
                runs.append(client.get_run(run_id))
            except Exception as exc:
                raise ReportError(f"no run {run_id} in {uri}") from exc
    runs.sort(key=lambda r: (int(r.data.tags.get(tracking.JOB_NUM_TAG, -1)), r.info.start_time))
    out = [_run_data(client, r) for r in runs]
    empty = [r.run_id[:12] for r in out if not r.histories]
    if len(empty) == len(out):
        raise ReportError(f"no metrics in run(s) {', '.join(empty)}: nothing to compare yet")
    return [r for r in out if r.histories]


def _search(client: Any, filter_string: str) -> list[Any]:
    ids = [e.experiment_id for e in client.search_experiments()]
    return client.search_runs(ids, filter_string=filter_string, max_results=10_000) if ids else []


def _run_data(client: Any, run: Any) -> RunData:
    tags = run.data.tags
    histories = {}
    for key in run.data.metrics:
        if key in METRICS or VAL_KEY.match(key) or QUADRANT_KEY.match(key):
            points = sorted(
                (m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)
            )
            histories[key] = points
    overrides = tags.get(tracking.OVERRIDES_TAG)
    run_dir = tags.get(tracking.RUN_DIR_TAG)
    if run_dir is None and tracking.SWEEP_DIR_TAG in tags and tracking.JOB_NUM_TAG in tags:
        run_dir = str(Path(tags[tracking.SWEEP_DIR_TAG]) / tags[tracking.JOB_NUM_TAG])
    return RunData(
        run_id=run.info.run_id,
        name=run.info.run_name or run.info.run_id[:12],
        status=run.info.status,
        overrides=overrides.split() if overrides is not None else None,
        histories=histories,
        params=dict(run.data.params),
        parent_id=tags.get(tracking.PARENT_TAG),
        run_dir=run_dir,
    )


# ---------------------------------------------------------------------------------- computing


def _mean(points: list[tuple[int, float]] | None) -> float | None:
    return sum(v for _, v in points) / len(points) if points else None


def _tail_mean(points: list[tuple[int, float]] | None, frac: float = 0.1) -> float | None:
    return _mean(points[-max(int(len(points) * frac), 1) :]) if points else None


def _head_mean(points: list[tuple[int, float]] | None, frac: float = 0.1) -> float | None:
    return _mean(points[: max(int(len(points) * frac), 1)]) if points else None


def _change(start: float | None, final: float | None) -> float | None:
    return None if start is None or final is None else final - start


# ------------------------------------------------------------------------------------ facets


def canonical(value: str) -> str:
    """One spelling per value, so `1e-4` typed and `0.0001` recorded (MLflow params are str()
    of the config) are the same facet value: numbers as Python prints them (integers without
    `.0`), booleans lower-case, quotes dropped."""
    value = _unquote(value.strip())
    if value in ("True", "False"):
        return value.lower()
    try:
        number = float(value)
    except ValueError:
        return value
    if number.is_integer() and abs(number) < 1e15:
        return str(int(number))
    return repr(number)


def _key(key: str) -> str:
    return key.strip().lstrip("+")


def _ignored(key: str) -> bool:
    return any(key == k or key.startswith(k + ".") or key.startswith(k + "/") for k in IGNORED)


def facets(run: RunData) -> dict[str, str]:
    """What the run trained, as `{key: canonical value}`, in label order: a sweep job's typed
    overrides first (the words its user chose, e.g. `experiment=study_v2_reuse8`), then each
    config group's choice (`algo` from the recorded `algo.name`), then every recorded config key.
    Keys of `IGNORED` (where it logged, how it launched) are left out."""
    out: dict[str, str] = {}
    for override in run.overrides or []:
        key, sep, value = override.partition("=")
        if sep and not _ignored(_key(key)):
            out[_key(key)] = canonical(value)
    for key, value in run.params.items():
        if key.endswith(".name") and key.count(".") == 1 and not _ignored(key):
            out.setdefault(key[: -len(".name")], canonical(value))
    for key, value in run.params.items():
        if not _ignored(key):
            out[key] = canonical(value)  # the recorded value wins over its typed spelling
    return out


def _known(runs: list[RunData], key: str) -> bool:
    """Whether every run can say its value of `key`. A config key (`trainer.lr`, `algo.rho0`,
    `algo`) can: a run without it has no such setting. A key only a sweep's typed overrides name
    (`experiment`, `staleness`) cannot for a run started on its own, which records its config
    but not the presets that made it."""
    config = any(key in r.params or f"{key}.name" in r.params for r in runs)
    return config or all(r.overrides is not None for r in runs)


def label_keys(runs: list[RunData]) -> list[str]:
    """The facet keys that label the runs: those whose values differ between them (the seed
    aside), in `facets` order, each kept only when the keys kept before it do not already
    determine it (e.g. `staleness.k` once `experiment` is kept, `algo.loss` once `algo` is).

    Presets label, configs decide: a key only typed overrides name (`experiment`, `staleness`)
    is kept only when the recorded configs determine it, so two runs of the same config typed
    differently (`staleness=8` in one sweep, `experiment=...` setting k = 8 in another, or a
    run started on its own) stay one group."""
    every = list(dict.fromkeys(k for r in runs for k in r.facets))
    typed = {_key(o.partition("=")[0]) for r in runs for o in r.overrides or []}
    aliases = {k for k in every if any(f"{k}.name" in r.params for r in runs)}
    config = [
        k for k in every if k != SEED_KEY and (k in aliases or any(k in r.params for r in runs))
    ]
    sections = list(dict.fromkeys(k.split(".")[0] for k in every))
    order = sorted(  # typed, then group choices, then config keys section by section
        every,
        key=lambda k: (k not in typed, k not in aliases, sections.index(k.split(".")[0])),
    )
    kept: list[str] = []
    for key in order:
        if key == SEED_KEY or not _known(runs, key):
            continue
        if len({r.facets.get(key) for r in runs}) < 2:
            continue
        if config and key not in config and not _determines(runs, config, key):
            continue  # a preset's name that identical configs spell differently
        if _determines(runs, kept, key):
            continue  # the kept keys already determine it
        kept.append(key)
    return kept


def _determines(runs: list[RunData], keys: list[str], key: str) -> bool:
    """Whether runs that agree on `keys` always agree on `key`."""
    seen: dict[tuple[str | None, ...], str | None] = {}
    value = [r.facets.get(key) for r in runs]
    return all(
        seen.setdefault(tuple(r.facets.get(k) for k in keys), v) == v
        for r, v in zip(runs, value, strict=True)
    )


def _words(run: RunData, keys: list[str]) -> list[str]:
    return [f"{k}={run.facets[k]}" for k in keys if k in run.facets]


def label_runs(runs: list[RunData]) -> list[str]:
    """Label = the label keys' values (and the seed); group = label without the seed. Returns
    the label keys."""
    for run in runs:
        run.facets = facets(run)
        run.values = {header: fn(run.histories) for header, fn in COLUMNS}
    keys = label_keys(runs)
    seeds = len({r.facets.get(SEED_KEY) for r in runs}) > 1
    for run in runs:
        group = _words(run, keys)
        run.group = " ".join(group) or "(all)"
        seed = _words(run, [SEED_KEY]) if seeds else []
        run.label = " ".join(group + seed) or run.name
    return keys


def facet_value(run: RunData, facet: str | None) -> str:
    """The run's value of `--facet` (`staleness.k`, `algo`, or several: `experiment,trainer.lr`)
    as shown in panel titles and the comparisons' first column; "" without a facet."""
    if facet is None:
        return ""
    keys = [_key(k) for k in facet.split(",") if k.strip()]
    values = [run.facets.get(k, "") for k in keys]
    if len(keys) == 1:
        return values[0]
    return " ".join(f"{k}={v}" for k, v in zip(keys, values, strict=True))


def check_facet(runs: list[RunData], facet: str, option: str = "--facet") -> None:
    """A facet every run can say, else one line naming the runs that cannot and what they do
    record."""
    for key in (_key(k) for k in facet.split(",") if k.strip()):
        if _known(runs, key) and any(key in r.facets for r in runs):
            continue
        blind = sorted(r.run_id[:12] for r in runs if key not in r.facets)
        if any(key in r.facets for r in runs):
            raise ReportError(
                f"{option} {key}: not recorded by {len(blind)} run(s) ({', '.join(blind[:4])}"
                f"{', ...' if len(blind) > 4 else ''}): a run started on its own records its "
                "config, not the presets that made it; use a config key they record (e.g. "
                "staleness.k, trainer.lr, algo) instead"
            )
        raise ReportError(f"{option} {key}: no run has it; keys that differ: {_differing(runs)}")


def _differing(runs: list[RunData]) -> str:
    return ", ".join(label_keys(runs)) or "(none)"


def group_rows(runs: list[RunData]) -> list[tuple[str, int, dict[str, tuple[float, float] | None]]]:
    """(group, seeds, {column: (mean, std) over the group's runs}) in first-seen order."""
    groups: dict[str, list[RunData]] = {}
    for run in runs:
        groups.setdefault(run.group, []).append(run)
    out = []
    for name, members in groups.items():
        stats: dict[str, tuple[float, float] | None] = {}
        for header, _ in COLUMNS:
            values = [m.values[header] for m in members if m.values[header] is not None]
            if not values:
                stats[header] = None
                continue
            mean = sum(values) / len(values)
            var = sum((v - mean) ** 2 for v in values) / max(len(values) - 1, 1)
            stats[header] = (mean, math.sqrt(var))
        out.append((name, len(members), stats))
    return out


OUTCOMES = ("held-out change", "held-out final", "final reward", "final entropy")
"""What --baseline compares; "held-out change" (final - start) is study v3's primary outcome."""


def permutation_p(a: list[float], b: list[float], *, samples: int = 20_000) -> float:
    """Two-sided p-value of mean(a) - mean(b) under the null that the labels are exchangeable:
    the share of relabelings of a + b into groups of len(a) and len(b) whose |difference| is at
    least the observed one (exact when there are at most `samples` relabelings, else a seeded
    Monte-Carlo estimate that counts the observed split)."""
    if not a or not b:
        raise ValueError("permutation_p needs at least one value on each side")
    pooled, n = [*a, *b], len(a)
    total = sum(pooled)
    observed = abs(sum(a) / n - sum(b) / len(b))
    tol = 1e-12 * max(1.0, abs(observed))

    def extreme(idx: tuple[int, ...] | list[int]) -> bool:
        sa = sum(pooled[i] for i in idx)
        return abs(sa / n - (total - sa) / len(b)) >= observed - tol

    if math.comb(len(pooled), n) <= samples:
        splits = list(itertools.combinations(range(len(pooled)), n))
        return sum(extreme(s) for s in splits) / len(splits)
    rng = random.Random(0)
    hits = sum(extreme(rng.sample(range(len(pooled)), n)) for _ in range(samples))
    return (hits + 1) / (samples + 1)


def comparisons_table(
    runs: list[RunData], baseline: str, facet: str | None = None
) -> tuple[list[str], list[list[str]]]:
    """Each group against the baseline group of its cell: the group whose runs hold the facet
    `baseline` (`algo=grpo`) and agree with it on every other label key but the baseline's own
    (`algo` and `algo.*`). Seeds, mean difference and permutation p per outcome. With `facet`,
    its value is the first column (and a baseline on the facet's own key is refused)."""
    key, sep, wanted = baseline.partition("=")
    key = _key(key)
    if not sep or not key:
        raise ReportError(f"--baseline {baseline}: must be KEY=VALUE, e.g. algo=grpo")
    facet_keys = [_key(k) for k in facet.split(",")] if facet else []
    if key in facet_keys:
        raise ReportError(
            f"--baseline {baseline}: compares groups within one --facet {facet} value, so it "
            "must set another key (e.g. algo=grpo), or drop --facet"
        )
    keys = label_runs(runs)
    check_facet(runs, key, "--baseline")
    cell_keys = [k for k in keys if not _same_setting(k, key, runs)]
    by_group: dict[str, list[RunData]] = {}
    for run in runs:
        by_group.setdefault(run.group, []).append(run)

    def cell(members: list[RunData]) -> tuple[str | None, ...]:
        return tuple(members[0].facets.get(k) for k in cell_keys)

    base_of: dict[tuple[str | None, ...], list[RunData]] = {}
    for group, members in by_group.items():
        if all(m.facets.get(key) == canonical(wanted) for m in members):
            other = base_of.setdefault(cell(members), members)
            if other is not members:
                raise ReportError(
                    f"--baseline {baseline}: two groups have it in one cell ({other[0].group}; "
                    f"{group}); name a narrower baseline"
                )
    if not base_of:
        groups = ", ".join(by_group)
        raise ReportError(f"--baseline {baseline}: no group has it; groups: {groups}")
    header = [facet or "", "group", "vs", "seeds"]
    for outcome in OUTCOMES:
        header += [f"{outcome} diff", f"{outcome} p"]
    rows = []
    for group, members in by_group.items():
        base = base_of.get(cell(members))
        if base is None or base is members:
            continue
        value = facet_value(members[0], facet)
        row = [value, _without(group, facet), _without(base[0].group, facet)]
        row.append(f"{len(members)} vs {len(base)}")
        for outcome in OUTCOMES:
            a = [m.values[outcome] for m in members if m.values[outcome] is not None]
            b = [m.values[outcome] for m in base if m.values[outcome] is not None]
            if not a or not b:
                row += ["", ""]
                continue
            diff = sum(a) / len(a) - sum(b) / len(b)
            row += [f"{diff:+.3f}", f"{permutation_p(a, b):.3f}"]
        rows.append(row)
    if not rows and len(base_of) == len(by_group):
        raise ReportError(f"--baseline {baseline}: every group has it; nothing to compare")
    if not rows:
        raise ReportError(
            f"--baseline {baseline}: no other group agrees with a baseline group on "
            f"{', '.join(cell_keys)}; nothing to compare"
        )
    if facet is None:
        header, rows = header[1:], [r[1:] for r in rows]
    return header, rows


def _same_setting(key: str, baseline_key: str, runs: list[RunData]) -> bool:
    """Whether `key` is part of what the baseline sets, so cells ignore it: the key itself, and
    when it lies in a config group (`algo`, `algo.name`, `algo.loss`) the whole group, whose
    other keys (algo.rho0, algo.eps_high) come with the choice."""
    group = baseline_key.split(".")[0]
    if any(f"{group}.name" in r.params for r in runs):
        return key == group or key.startswith(group + ".")
    return key == baseline_key


def net_entropy_push(run: RunData) -> float | None:
    """A run's net first-order entropy push of the active loss mass: sum of ENTROPY_EFFECT x the
    quadrant's active share (mean over steps); > 0 raises entropy. None when not logged."""
    shares = [_mean(run.histories.get(f"tokens/quadrant_{q}_active_mass")) for q in QUADRANTS]
    if any(v is None for v in shares):
        return None
    return sum(ENTROPY_EFFECT[q] * v for q, v in zip(QUADRANTS, shares, strict=True))


def quadrant_table(runs: list[RunData]) -> tuple[list[str], list[list[str]]] | None:
    """The Entropy-Clip quadrant table per group (None when no run logged it): the share of the
    update's loss mass r|A| that active and clipped tokens carry in each quadrant (probability
    above / below the batch mean, advantage sign), mean over steps then over seeds; and the net
    first-order entropy push of the active mass (sum of ENTROPY_EFFECT x share: > 0 raises
    entropy, < 0 lowers it; clipped tokens push nothing)."""
    if not any(QUADRANT_KEY.match(k) for r in runs for k in r.histories):
        return None
    header = ["group", "seeds"]
    header += [f"{q} {state}" for q in QUADRANTS for state in ("active", "clipped")]
    header.append("net entropy push")
    groups: dict[str, list[RunData]] = {}
    for run in runs:
        groups.setdefault(run.group, []).append(run)
    rows = []
    for group, members in groups.items():
        cells: list[str] = []
        for q in QUADRANTS:
            for state in ("active", "clipped"):
                per_run = [
                    _mean(m.histories.get(f"tokens/quadrant_{q}_{state}_mass")) for m in members
                ]
                values = [v for v in per_run if v is not None]
                cells.append(_fmt(sum(values) / len(values) if values else None))
        push = [p for p in map(net_entropy_push, members) if p is not None]
        cells.append(f"{sum(push) / len(push):+.3f}" if push else "")
        rows.append([group, str(len(members)), *cells])
    return header, rows


def failure_table(
    runs: list[RunData], cache_path: Path
) -> tuple[list[str], list[list[str]]] | None:
    """Where held-out accuracy goes, per group (None when no run has a checkpoint of the pair
    search): the share of held-out samples in each class of `evaluation.failures.CLASSES`, at the
    run's starting weights and at its final checkpoint (each sampled again with the run's seed,
    8 samples per problem), seed means. A run without a final checkpoint or start weights on this
    machine is left out and counted in "runs sampled"."""
    from rich.progress import track

    from bapo_cli.evaluation import failures

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
                cells.append(_fmt(sum(p[i][c] for p in pairs) / len(pairs)))
        rows.append(cells)
    return header, rows


def _fmt(value: float | None) -> str:
    return "" if value is None else f"{value:.3f}"


def _fmt_pm(value: tuple[float, float] | None) -> str:
    return "" if value is None else f"{value[0]:.3f} ± {value[1]:.3f}"


def runs_table(runs: list[RunData]) -> tuple[list[str], list[list[str]]]:
    header = ["run", "run id", "status", "steps", *(h for h, _ in COLUMNS)]
    rows = [
        [r.label, r.run_id[:12], r.status, str(len(r.histories.get("reward/mean", [])))]
        + [_fmt(r.values[h]) for h, _ in COLUMNS]
        for r in runs
    ]
    return header, rows


def groups_table(runs: list[RunData]) -> tuple[list[str], list[list[str]]]:
    header = ["group", "seeds", *(h for h, _ in COLUMNS)]
    rows = [
        [name, str(n)] + [_fmt_pm(stats[h]) for h, _ in COLUMNS]
        for name, n, stats in group_rows(runs)
    ]
    return header, rows


def markdown(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def _write_csv(path: Path, header: list[str], rows: list[list[str]]) -> None:
    with path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        writer.writerows(rows)


# ---------------------------------------------------------------------------------- plotting


def _smooth(values: list[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def _line(ax: Any, members: list[RunData], key: str, color: Any, label: str) -> int:
    """Seed mean of the trailing-mean-smoothed runs (over the runs that reached each step), and a
    min-max band where two or more did. Returns the smoothing window."""
    series = [m.histories[key] for m in members if key in m.histories]
    if not series:
        return 1
    window = max(max(len(s) for s in series) // 20, 1)
    by_step: dict[int, list[float]] = {}
    for points in series:
        smooth = _smooth([v for _, v in points], window)
        for (step, _), value in zip(points, smooth, strict=True):
            by_step.setdefault(step, []).append(value)
    steps = sorted(by_step)
    mean = [sum(by_step[t]) / len(by_step[t]) for t in steps]
    ax.plot(steps, mean, color=color, lw=1.4, label=label)
    if len(series) > 1:
        low = [min(by_step[t]) if len(by_step[t]) > 1 else math.nan for t in steps]
        high = [max(by_step[t]) if len(by_step[t]) > 1 else math.nan for t in steps]
        ax.fill_between(steps, low, high, color=color, alpha=0.12, lw=0)
    return window


def plot(runs: list[RunData], out_dir: Path, facet: str | None = None) -> list[Path]:
    """One PNG per metric family: one line per group (seed mean, min-max band, trailing mean);
    with `facet` (an override key, e.g. staleness), one column of panels per value of it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    facets = list(dict.fromkeys(facet_value(r, facet) for r in runs))
    names = list(dict.fromkeys(_without(r.group, facet) for r in runs))
    colors = plt.get_cmap("tab10" if len(names) <= 10 else "tab20").colors
    color = {n: colors[i % len(colors)] for i, n in enumerate(names)}
    paths = []
    for name, keys in PLOTS.items():
        present = [k for k in keys if any(k in r.histories for r in runs)]
        if not present:
            continue
        shape = (len(present), len(facets)) if facet else (1, len(present))
        fig, axes = plt.subplots(
            *shape, figsize=(5.2 * shape[1], 3.6 * shape[0]), squeeze=False, sharey="row"
        )
        for k, key in enumerate(present):
            for f, value in enumerate(facets):
                ax = axes[k][f] if facet else axes[0][k]
                window = 1
                for group in names:
                    members = [
                        r
                        for r in runs
                        if _without(r.group, facet) == group and facet_value(r, facet) == value
                    ]
                    window = max(window, _line(ax, members, key, color[group], group))
                where = f"{facet}={value}: " if facet else ""
                ax.set_title(f"{where}{key} (trailing mean, {window} steps)", fontsize=9)
                ax.set_xlabel("step")
                ax.grid(alpha=0.3)
        handles: dict[str, Any] = {}  # one legend entry per group
        for ax in axes.flat:
            for h, lab in zip(*ax.get_legend_handles_labels(), strict=True):
                handles.setdefault(lab, h)
        fig.legend(
            list(handles.values()),
            list(handles),
            loc="center left",
            bbox_to_anchor=(1.0, 0.5),
            fontsize=8,
        )
        fig.tight_layout()
        path = out_dir / f"{name}.png"
        fig.savefig(path, dpi=80, bbox_inches="tight")
        plt.close(fig)
        paths.append(path)
    return paths


def _unquote(value: str) -> str:
    return value[1:-1] if len(value) > 1 and value[0] == value[-1] and value[0] in "'\"" else value


def _without(group: str, facet: str | None) -> str:
    if facet is None:
        return group
    keys = {_key(k) for k in facet.split(",")}
    kept = [o for o in group.split() if o.partition("=")[0] not in keys]
    return " ".join(kept) or "(all)"


# ---------------------------------------------------------------------------------- the report


@dataclass
class Report:
    out_dir: Path
    files: list[Path]
    runs: list[RunData]
    parent_id: str | None  # the run the report was logged to


def write_report(
    runs: list[RunData],
    out_dir: Path,
    uri: str | None = None,
    facet: str | None = None,
    baseline: str | None = None,
    failures: bool = False,
) -> Report:
    """Tables and plots into out_dir; logged to the runs' common parent run when there is one."""
    label_runs(runs)
    if facet is not None:
        check_facet(runs, facet)
    comparison = comparisons_table(runs, baseline, facet) if baseline else None
    out_dir.mkdir(parents=True, exist_ok=True)
    files = []
    header, rows = runs_table(runs)
    for suffix, writer in ((".md", None), (".csv", _write_csv)):
        path = out_dir / f"runs{suffix}"
        if writer is None:
            path.write_text(markdown(header, rows), encoding="utf-8")
        else:
            writer(path, header, rows)
        files.append(path)
    if any(r.group != r.label for r in runs):  # several seeds per group
        header, rows = groups_table(runs)
        (out_dir / "groups.md").write_text(markdown(header, rows), encoding="utf-8")
        _write_csv(out_dir / "groups.csv", header, rows)
        files += [out_dir / "groups.md", out_dir / "groups.csv"]
    if comparison is not None:
        (out_dir / "comparisons.md").write_text(markdown(*comparison), encoding="utf-8")
        _write_csv(out_dir / "comparisons.csv", *comparison)
        files += [out_dir / "comparisons.md", out_dir / "comparisons.csv"]
    quadrants = quadrant_table(runs)
    if quadrants is not None:
        (out_dir / "quadrants.md").write_text(markdown(*quadrants), encoding="utf-8")
        _write_csv(out_dir / "quadrants.csv", *quadrants)
        files += [out_dir / "quadrants.md", out_dir / "quadrants.csv"]
    if failures:
        table = failure_table(runs, out_dir / "failures_cache.json")
        if table is not None:
            (out_dir / "failures.md").write_text(markdown(*table), encoding="utf-8")
            _write_csv(out_dir / "failures.csv", *table)
            files += [out_dir / "failures.md", out_dir / "failures.csv"]
    files += plot(runs, out_dir, facet)
    parents = {r.parent_id for r in runs}
    parent = parents.pop() if len(parents) == 1 else None
    if parent and uri:
        from bapo_cli.tracking import store

        store.client(uri).log_artifacts(parent, str(out_dir), "report")
    return Report(out_dir, files, runs, parent)

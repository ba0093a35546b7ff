"""Labels and groups: each run is labelled by its config facets (`facets`): the config it
recorded (MLflow params, `trainer.lr=0.0003`), its group choices (`algo=grpo` from `algo.name`),
and for a sweep job the overrides it was typed with (`experiment=study_v2_reuse8`, the
`bapo.overrides` tag). The label keeps the keys whose values differ between the runs compared and
drops those the kept ones already determine, so runs started one by one and the jobs of one or
many sweeps are labelled, grouped and compared alike. Runs whose labels differ only in
`trainer.seed` form a group.
"""

from __future__ import annotations

from bapo_cli.report.columns import COLUMNS
from bapo_cli.report.runs import ReportError, RunData

SEED_KEY = "trainer.seed"  # what varies within a group
IGNORED = ("tracking", "paths", "hydra", "launcher", "sweeper", "trainer.resume")
IGNORED += ("trainer.save_every", "trainer.keep_last", "trainer.log_every", "trainer.log_samples")
IGNORED += ("trainer.dist_timeout_min",)
"""Keys (and their sub-keys) that say where and how a run was logged, saved or launched, not
what it trained: never a facet, so runs of one cell logged to other stores or launched by
another launcher still group together."""


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


def facet_key(key: str) -> str:
    """A key as typed in an override or on the command line (`+trainer.x`), as a facet key."""
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
        if sep and not _ignored(facet_key(key)):
            out[facet_key(key)] = canonical(value)
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
    typed = {facet_key(o.partition("=")[0]) for r in runs for o in r.overrides or []}
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
    keys = [facet_key(k) for k in facet.split(",") if k.strip()]
    values = [run.facets.get(k, "") for k in keys]
    if len(keys) == 1:
        return values[0]
    return " ".join(f"{k}={v}" for k, v in zip(keys, values, strict=True))


def check_facet(runs: list[RunData], facet: str, option: str = "--facet") -> None:
    """A facet every run can say, else one line naming the runs that cannot and what they do
    record."""
    for key in (facet_key(k) for k in facet.split(",") if k.strip()):
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


def _unquote(value: str) -> str:
    return value[1:-1] if len(value) > 1 and value[0] == value[-1] and value[0] in "'\"" else value


def group_without(group: str, facet: str | None) -> str:
    """A group's label without the words of the `--facet` keys ("(all)" when nothing is left):
    what one line of a faceted plot, or one row of a faceted comparison, is called."""
    if facet is None:
        return group
    keys = {facet_key(k) for k in facet.split(",")}
    kept = [o for o in group.split() if o.partition("=")[0] not in keys]
    return " ".join(kept) or "(all)"

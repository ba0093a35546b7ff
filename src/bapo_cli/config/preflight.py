"""Reject a bad command line before any heavy work: group choices, types, ranges, every sweep job.

`preflight()` is what the CLI runs first. For a multirun it composes and validates the config of
every job the basic sweeper would launch, so `bapo train -m algo.rho0=0.3,1.5` fails before job 0
starts, not halfway through a sweep. A `group=glob(...)` sweep is first turned into the explicit
list of the group's options it matches (`expand_globs`), which is what Hydra is then handed.

Each job's output dir is read from its composed config as Hydra will read it (`Dirs`:
`hydra.run.dir`, or `hydra.sweep.dir` and every job's `hydra.sweep.subdir`, interpolations
resolved), for the CLI's run-dir check (bapo_cli.launch.rundir); two jobs of one sweep that would
share a dir are refused here (`distinct_job_dirs`).

A training step's work is bounded (`step_work_error`: sequences and response tokens per step,
whatever the machine), and a training config must also fit the machine (`step_memory_error`):
a step's samples, every response at `rollout.max_tokens`, need at least `STEP_BYTES_PER_TOKEN`
bytes of host memory per token for their per-token records; a step that needs more than this
machine has is refused.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

from bapo_cli.config import hydra_runner, schema
from bapo_cli.config.errors import ConfigError, explain, unknown_key, unknown_option

PLUGIN_GROUPS = {"hydra/launcher": "sweep or slurm", "hydra/sweeper": "sweep"}


class PreflightError(Exception):
    """A rejected command line; `str()` is the one line shown to the user."""


@dataclass(frozen=True)
class Dirs:
    """Where Hydra will write, read from the composed config the way Hydra reads it when a job
    starts (`hydra.core.utils.run_job`): every interpolation expanded (`${paths.output_root}/..`,
    `${oc.env:PWD}`, `${now:...}`, `${hydra.job.num}`), the path itself left as spelled (the
    CLI makes it a real path: bapo_cli.launch.rundir)."""

    output: str  # hydra.run.dir (a run) or hydra.sweep.dir (a multirun)
    subdirs: list[str] | None  # a multirun's hydra.sweep.subdir, per job; None: sampled jobs
    record: str | None  # hydra.output_subdir (`.hydra`): Hydra's copy of the config; None = off


@dataclass(frozen=True)
class Preflight:
    overrides: list[str]  # normalised, ready for Hydra
    config: Any  # validated dataclass of the first (or only) job
    num_jobs: int | None  # None when the sweeper samples (Optuna)
    jobs: list[list[str]] | None = None  # a multirun's jobs (overrides each), as validated
    dirs: Dirs | None = None  # where Hydra will write


def to_validated(cfg: DictConfig) -> Any:
    """DictConfig -> schema dataclass, with every `check()` run. Raises ConfigError."""
    if "hydra" in cfg:  # Hydra's own node is no part of the schema; the copy keeps its type
        cfg = cfg.copy()
        with open_dict(cfg):
            del cfg["hydra"]
    check_known_keys(cfg)
    try:
        obj = OmegaConf.to_object(cfg)
    except Exception as exc:  # interpolation or missing value: explain it in one line
        raise ConfigError("config", None, explain(exc)) from exc
    schema.validate(obj)
    return obj


def check_known_keys(cfg: DictConfig, prefix: str = "") -> None:
    """Every key of a schema node is one of its dataclass's fields. Hydra's `+key=v` appends with
    the struct flag lifted, so `+trainer.max_stepz=2` would otherwise slip past the schema that
    refuses `trainer.max_stepz=2`; both now get the same ConfigError. Nodes the schema leaves
    open (a dict, `Any`) take any key."""
    kind = OmegaConf.get_type(cfg)
    fields = {f.name for f in dataclasses.fields(kind)} if dataclasses.is_dataclass(kind) else None
    for key in cfg:
        path = f"{prefix}{key}"
        if fields is not None and key not in fields:
            raise unknown_key(path, kind)
        child = cfg._get_node(key)
        if isinstance(child, DictConfig) and not (child._is_none() or child._is_interpolation()):
            check_known_keys(child, path + ".")


def check_group_choices(overrides: list[str]) -> None:
    """`algo=foo` -> `algo=foo: unknown option; valid: bapo, clip_higher, grpo, ppo`."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import Glob

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except Exception as exc:
        raise PreflightError(f"cannot parse override: {explain(exc)}") from exc
    groups = set(hydra_runner.config_groups())
    for override in parsed:
        group = override.key_or_group
        if override.is_delete():
            continue
        value = override.value()
        if isinstance(value, Glob):  # `algo=glob(*)`: checked here, expanded by expand_globs
            glob_options(override)
            continue
        if group not in groups or override.package:
            continue
        valid = hydra_runner.group_options(group)
        if override.is_sweep_override():
            values = [getattr(v, "text", v) for v in override.sweep_iterator()]
        else:
            values = value if isinstance(value, list) else [value]
        for value in values:
            if value is None and group == "experiment":
                continue
            if str(value) not in valid:
                raise PreflightError(unknown_option(group, value, valid))


def glob_options(override: Any) -> list[str]:
    """The options a parsed `group=glob(...)` selects: Hydra's own `Glob.filter` over the group's
    options (conf/<group>/*.yaml, sorted as Hydra sorts them). A glob on a key that is not a
    config group, or one that matches nothing, is a PreflightError."""
    from hydra.core.override_parser.types import Glob

    groups = hydra_runner.config_groups()
    group = override.key_or_group
    if group not in groups:
        raise PreflightError(
            f"{override.input_line}: glob() sweeps the options of a config group "
            f"({', '.join(groups)}), and {group} is not one; sweep values as a,b,c or range(...)"
        )

    def patterns(items: list[Any]) -> list[str]:
        # `staleness=glob(*,exclude=[0,8])`: ints, or the strings the CLI quoted, which
        # fnmatch refuses as they come out of Hydra's parser
        return [str(getattr(item, "text", item)) for item in items]

    typed = override.value()
    glob = Glob(include=patterns(typed.include), exclude=patterns(typed.exclude))
    valid = hydra_runner.group_options(group)
    selected = glob.filter(valid)
    if not selected:
        raise PreflightError(f"{override.input_line}: matches no option; valid: {', '.join(valid)}")
    return selected


def expand_globs(overrides: list[str]) -> list[str]:
    """`algo=glob(*)` -> `algo=bapo,clip_higher,grpo,ppo`, in place, for a multirun.

    Hydra's basic sweeper would expand the glob against every option its config loader lists,
    and that list holds the schemas registered in the ConfigStore (`algo=_bapo_schema`, ...)
    too. Handing Hydra the explicit choice sweep instead means it launches exactly the jobs
    preflight validated, in the same order, whatever the sweeper (Optuna gets a categorical).
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import Glob

    parser = OverridesParser.create()
    out = []
    for line in overrides:
        override = parser.parse_override(line)
        if override.is_delete() or not isinstance(override.value(), Glob):
            out.append(line)
            continue
        options = ",".join(_as_element(parser, o) for o in glob_options(override))
        out.append(f"{override.get_key_element()}={options}")
    return out


def _as_element(parser: Any, option: str) -> str:
    """An option spelled so that Hydra reads back the same string: `bapo`, but `'4'`."""
    try:
        if parser.parse_override(f"k={option}").value() == option:
            return option
    except Exception:
        pass
    return "'" + option.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _name_job(line: str, num: int, job: list[str], swept: set[str]) -> str:
    """`job 1 (algo=clip_higher): algo.rho0: unknown key in algo; ...` when the error does not
    already start with one of the job's swept overrides (`algo.rho0=7.0: must be ...`)."""
    mine = [o for o in job if o.partition("=")[0] in swept]
    keys = [o.partition("=")[0].lstrip("+~") for o in mine]
    if not mine or any(re.match(re.escape(k) + "[=:]", line) for k in keys):
        return line
    shown = "".join(c if c.isprintable() else ascii(c)[1:-1] for c in " ".join(mine))
    return f"job {num} ({shown}): {line}"


# Per response token a step keeps, in Python lists, its id, its policy version and its behaviour
# log-prob: three 8-byte list slots plus a 24-byte float object. A lower bound: the int objects,
# vLLM's own log-probs, the decoded text and the collated tensors (~45 bytes more, on the
# training device) come on top.
STEP_BYTES_PER_TOKEN = 48


def machine_memory_bytes() -> int | None:
    """Physical memory of this machine, or its cgroup's limit when lower; None if unknown."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None
    try:
        limit = open("/sys/fs/cgroup/memory.max").read().strip()  # noqa: SIM115
    except OSError:
        limit = "max"
    return min(total, int(limit)) if limit.isdigit() else total


def step_memory_error(cfg: Any, memory_bytes: int | None) -> str | None:
    """One line when a training step's samples cannot fit in `memory_bytes`, else None.

    Samples per step (`trainer.prompts_per_step` × `rollout.n`) × the response budget
    (`rollout.max_tokens`) × `STEP_BYTES_PER_TOKEN`: what the step needs when every response
    runs to its budget, counting only records it cannot do without, so a refusal is certain to
    be a config that cannot run here."""
    if memory_bytes is None:
        return None
    prompts, n, tokens = cfg.trainer.prompts_per_step, cfg.rollout.n, cfg.rollout.max_tokens
    need = prompts * n * tokens * STEP_BYTES_PER_TOKEN
    if need <= memory_bytes:
        return None
    return (
        f"trainer.prompts_per_step={prompts} × rollout.n={n} × rollout.max_tokens={tokens}: a "
        f"step's responses need at least {_gib(need)} of memory ({STEP_BYTES_PER_TOKEN} bytes "
        f"per token) and this machine has {_gib(memory_bytes)}; lower one of them"
    )


# The most work one training step may ask for, whatever the machine. The largest published
# recipes are well inside: DAPO (512 prompts × 16 × 20,480 tokens) is 8,192 sequences and 168M
# tokens a step. Past these a typo (`rollout.n=100000`: 3.2M sequences a step) would load the
# model and generate for hours or days before its first update; it is refused in one line.
MAX_STEP_SEQUENCES = 65_536
MAX_STEP_TOKENS = 2**30


def step_work_error(cfg: Any) -> str | None:
    """One line when a step's sequences (prompts × n) or response tokens (× max_tokens) exceed
    `MAX_STEP_SEQUENCES` / `MAX_STEP_TOKENS`, else None."""
    prompts, n, tokens = cfg.trainer.prompts_per_step, cfg.rollout.n, cfg.rollout.max_tokens
    seqs = prompts * n
    product = f"trainer.prompts_per_step={prompts} × rollout.n={n}"
    if seqs > MAX_STEP_SEQUENCES:
        return (
            f"{product} = {seqs:,} sequences per step; the limit is {MAX_STEP_SEQUENCES:,} "
            "(8x the largest published recipe's); lower one of them"
        )
    if seqs * tokens > MAX_STEP_TOKENS:
        return (
            f"{product} × rollout.max_tokens={tokens} = {seqs * tokens:,} response tokens per "
            f"step; the limit is {MAX_STEP_TOKENS:,} (6x the largest published recipe's); lower "
            "one of them"
        )
    return None


def _gib(n: int) -> str:
    return f"{n / 2**30:,.1f} GiB"


def _resolved(cfg: DictConfig, key: str, num: int | None = None) -> str:
    """`key` of the composed config (with its `hydra` node) as Hydra resolves it for job `num`
    of a multirun (None: a single run): `hydra.job.num`/`id` set as the launcher sets them and
    the config installed as HydraConfig, so `${hydra:...}` resolves too."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import read_write

    if num is not None:
        basic = str(cfg.hydra.launcher.get("_target_", "")).endswith(".BasicLauncher")
        with read_write(cfg.hydra), open_dict(cfg.hydra):
            cfg.hydra.job.num = num
            cfg.hydra.job.id = num if basic else f"{cfg.hydra.job.name}_{num}"  # joblib's
    held = HydraConfig.instance().cfg
    try:
        HydraConfig.instance().set_config(cfg)
        return str(OmegaConf.select(cfg, key, throw_on_missing=True))
    except Exception as exc:
        detail = explain(exc).removeprefix(f"{key}: ")
        raise PreflightError(f"{key}: cannot resolve it ({detail})") from exc
    finally:
        HydraConfig.instance().cfg = held


def _typed(cfg: DictConfig, key: str) -> str:
    """`hydra.sweep.subdir` as written in the config or on the command line (unresolved)."""
    parent, _, leaf = key.rpartition(".")
    return str(OmegaConf.to_container(OmegaConf.select(cfg, parent), resolve=False)[leaf])


def distinct_job_dirs(sweep_dir: str, subdirs: list[str], typed: str) -> None:
    """No two jobs of a sweep share a dir, or nest one in another: their checkpoints, samples
    and `.hydra` would mix. A job's dir is `os.path.join(sweep dir, subdir)` as Hydra makes it
    (an absolute subdir replaces the sweep dir), compared as real paths."""
    seen: dict[str, int] = {}
    for num, sub in enumerate(subdirs):
        path = os.path.realpath(os.path.join(sweep_dir, sub))
        if path in seen:
            raise PreflightError(
                f"hydra.sweep.subdir={typed}: jobs {seen[path]} and {num} would share one dir "
                f"({path}) and mix their checkpoints and samples; the subdir must differ per "
                "job, e.g. ${hydra.job.num} (the default) or ${hydra.job.override_dirname}"
            )
        seen[path] = num
    for path, num in seen.items():
        outer = next((str(p) for p in Path(path).parents if str(p) in seen), None)
        if outer is not None:
            raise PreflightError(
                f"hydra.sweep.subdir={typed}: job {num}'s dir ({path}) lies inside job "
                f"{seen[outer]}'s ({outer}); each job needs a dir of its own, e.g. "
                "${hydra.job.num} (the default)"
            )


def _at_once(cfg: DictConfig) -> str | None:
    """How the sweep's launcher runs several jobs at once (a phrase), None when one at a time."""
    launcher = cfg.hydra.launcher
    target = str(launcher.get("_target_", ""))
    if target.endswith(".BasicLauncher"):
        return None
    if "joblib" in target.lower():
        n_jobs = launcher.get("n_jobs")
        return None if n_jobs == 1 else f"hydra/launcher=joblib runs them at once (n_jobs={n_jobs})"
    return f"its launcher ({target.rsplit('.', 1)[-1]}) runs them at once"


def distinct_job_servers(servers: list[list[str]], at_once: str | None) -> None:
    """Jobs that run at once never share a generation server: a server belongs to one training
    run at a time (bapo_cli.rollout.lease); the second would be refused when it starts."""
    if at_once is None:
        return
    seen: dict[str, int] = {}
    for num, urls in enumerate(servers):
        for url in urls:
            if url in seen:
                raise PreflightError(
                    f"rollout.servers: jobs {seen[url]} and {num} of this sweep both generate on "
                    f"{url}, and {at_once}: a server belongs to one training run at a time; give "
                    "each job its own servers (sweep rollout.servers with the jobs), or run them "
                    "one after another (hydra.launcher.n_jobs=1)"
                )
            seen[url] = num


def _sampled_job_dirs(cfg: DictConfig) -> None:
    """A sampling sweeper's trials are not known ahead: the subdir must at least name the job
    (`${hydra.job.num}`), or every trial writes into one dir."""
    first, second = _resolved(cfg, "hydra.sweep.subdir", 0), _resolved(cfg, "hydra.sweep.subdir", 1)
    if first == second:
        raise PreflightError(
            f"hydra.sweep.subdir={_typed(cfg, 'hydra.sweep.subdir')}: the same ({first}) for "
            "every trial of this sampling sweep, which would all write into one dir; name the "
            "job in it, e.g. ${hydra.job.num} (the default)"
        )


def _record(cfg: DictConfig) -> str | None:
    record = cfg.hydra.output_subdir
    return None if record is None else str(record)


def _compose_checked(config_name: str, overrides: list[str]) -> tuple[Any, DictConfig]:
    """The validated config of one job, and what Hydra composed (its `hydra` node included)."""
    try:
        cfg = hydra_runner.compose(config_name, overrides, with_hydra=True)
    except Exception as exc:
        line = explain(exc)
        for group, extra in PLUGIN_GROUPS.items():
            if line.startswith(group + "="):
                line += f" (install the plugin: pip install 'bapo-cli[{extra}]')"
        raise PreflightError(line) from exc
    try:
        config = to_validated(cfg)
    except ConfigError as exc:
        raise PreflightError(exc.line()) from exc
    from bapo_cli import redact

    redact.remember_tree(dataclasses.asdict(config))  # resolved values: ${oc.env:...} URIs
    if isinstance(config, schema.TrainConfig):
        line = step_memory_error(config, machine_memory_bytes()) or step_work_error(config)
        if line is not None:
            raise PreflightError(line)
    reward = getattr(config, "reward", None)
    if reward is not None and reward.name == "python":
        check_reward_fn(reward.fn)
    check_tracking(config, overrides)
    return config, cfg


def check_tracking(config: Any, overrides: list[str]) -> None:
    """Tracking settings that would fail only when the trackers start, after the model loads:
    an MLflow URI with no store behind its scheme, a store or log dir that cannot be created,
    a TensorBoard dir holding another run's events (bapo_cli.tracking.checks). Rank 0 only:
    the other ranks of a torchrun launch track nothing (and rank 0 may be writing there)."""
    from bapo_cli.tracking import checks

    tracking = getattr(config, "tracking", None)
    if tracking is None or int(os.environ.get("RANK", "0") or 0) > 0:
        return
    trainer = getattr(config, "trainer", None)
    resume = bool(getattr(trainer, "resume", False))
    line = checks.settings_error(tracking, resume=resume, run_dir=named_run_dir(overrides))
    if line is not None:
        raise PreflightError(line)


def named_run_dir(overrides: list[str]) -> str | None:
    """The run dir the command line names (`hydra.run.dir=...`, the last one), None when it
    names none or one that Hydra has yet to interpolate."""
    named = [o for o in overrides if o.lstrip("+").startswith("hydra.run.dir=")]
    if not named:
        return None
    path = named[-1].partition("=")[2].strip("'\"")
    return None if "${" in path or not path else path


def check_reward_fn(spec: str) -> None:
    """reward=python: import reward.fn here, before any model loads, and check its arguments."""
    from bapo_cli.rewards.plugin import RewardPluginError, check_spec

    try:
        check_spec(spec)
    except RewardPluginError as exc:
        raise PreflightError(f"reward.fn={spec}: {exc}") from None


def preflight(config_name: str, overrides: list[str], *, multirun: bool = False) -> Preflight:
    """Normalise, check and compose; raise PreflightError (one readable line) if anything is off."""
    from bapo_cli import redact

    redact.remember_overrides(list(overrides))  # masked as literals in every line shown from now
    overrides = hydra_runner.normalize_overrides(list(overrides))
    check_group_choices(overrides)
    if not multirun:
        config, cfg = _compose_checked(config_name, overrides)
        dirs = Dirs(_resolved(cfg, "hydra.run.dir"), None, _record(cfg))
        return Preflight(overrides, config, 1, dirs=dirs)
    from hydra.core.override_parser.overrides_parser import OverridesParser

    overrides = expand_globs(overrides)
    parsed = OverridesParser.create().parse_overrides(overrides)
    fixed = [o.input_line for o in parsed if not o.is_sweep_override()]
    try:  # a preset may declare the sweep itself (hydra.sweeper.params), or pick another sweeper
        declared = hydra_runner.sweeper_params(config_name, fixed)
    except Exception as exc:
        _compose_checked(config_name, fixed)  # the readable error, if composing is what failed
        raise PreflightError(f"cannot compose the sweeper: {explain(exc)}") from exc
    try:
        jobs = None if declared is None else hydra_runner.expand_sweep(declared + overrides)
    except Exception as exc:
        raise PreflightError(f"cannot expand the sweep: {explain(exc)}") from exc
    if jobs is None:  # a sampling sweeper: validate what is fixed; each trial checks itself
        config, cfg = _compose_checked(config_name, fixed)
        _sampled_job_dirs(cfg)
        dirs = Dirs(_resolved(cfg, "hydra.sweep.dir"), None, _record(cfg))
        return Preflight(overrides, config, None, dirs=dirs)
    swept = {
        o.get_key_element()
        for o in OverridesParser.create().parse_overrides(declared + overrides)
        if o.is_sweep_override()
    }
    first, subdirs, servers = None, [], []
    for num, job in enumerate(jobs):
        try:
            config, cfg = _compose_checked(config_name, job)
            subdirs.append(_resolved(cfg, "hydra.sweep.subdir", num))
            if config_name == "train":
                servers.append([str(u).rstrip("/") for u in config.rollout.servers])
        except PreflightError as exc:
            if len(jobs) == 1:
                raise
            raise PreflightError(_name_job(str(exc), num, job, swept)) from exc
        if first is None:  # one sweep dir for every job: the CLI pins it (bapo_cli.launch.rundir)
            first = config
            dirs = Dirs(_resolved(cfg, "hydra.sweep.dir"), subdirs, _record(cfg))
            typed = _typed(cfg, "hydra.sweep.subdir")
    distinct_job_dirs(dirs.output, subdirs, typed)
    distinct_job_servers(servers, _at_once(cfg))
    return Preflight(overrides, first, len(jobs), jobs, dirs)

"""The `bapo` command: Typer in front, Hydra behind, no training logic here.

Every command takes Hydra overrides untouched (`key=v`, `+key=v`, `~key`, `group=option`, sweep
syntax). The CLI checks them first (bapo_cli.config.preflight) so a bad value costs one line and
exit code 2, then hands them to Hydra (bapo_cli.config.hydra_runner), which composes, creates the
run dir and calls the job (bapo_cli.launch.jobs).
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from collections.abc import Iterator
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from bapo_cli import __version__
from bapo_cli.config.errors import USAGE_EXIT_CODE
from bapo_cli.quick_exit import skip_last_collection

app = typer.Typer(
    name="bapo",
    help=(
        "Off-policy RL for LLMs with BAPO (adaptive clipping) beside PPO, GRPO and clip-higher.\n\n"
        "Configs compose with Hydra: pass overrides as KEY=VALUE, choose presets as GROUP=OPTION."
    ),
    epilog=(
        "Examples:\n\n"
        "  bapo train algo=bapo staleness=4\n\n"
        "  bapo train -m algo.rho0=0.3,0.4,0.5\n\n"
        "  bapo eval model.path=outputs/runs/<date>/<time>/checkpoints/last benchmark=aime24\n\n"
        "  bapo config algo=bapo staleness=4\n\n"
        "  bapo config --docs"
    ),
    rich_markup_mode="rich",
    no_args_is_help=True,
    add_completion=False,
    context_settings={"help_option_names": ["-h", "--help"]},
    pretty_exceptions_enable=False,
)

OVERRIDES_HELP = "Config overrides: key=value, +key=value, ~key, group=option."
SWEEP_OVERRIDES_HELP = OVERRIDES_HELP[:-1] + "; with -m, key=1,2,3 runs one job per value."
_err = Console(stderr=True)


def _fail(line: str) -> typer.Exit:
    from bapo_cli import redact

    line = redact.text(line)  # an override it quotes may hold credentials
    # the line quotes user text: a Text is printed as it is, never read as markup (`[/]`) or
    # emoji codes (`host:-1:`)
    _err.print(Text.assemble(("error:", "bold red"), " ", line), highlight=False, soft_wrap=True)
    return typer.Exit(USAGE_EXIT_CODE)


def _say(line: str) -> None:
    """A line that quotes user text (a path, a URI): printed as it is, no markup, no emoji."""
    Console().print(line, markup=False, emoji=False, highlight=False, soft_wrap=True)


def _preflight(config_name: str, overrides: list[str] | None, multirun: bool = False):
    from bapo_cli.launch import launcher

    try:
        return launcher.check(config_name, overrides, multirun)
    except launcher.Refused as exc:
        raise _fail(str(exc)) from None


@app.command(
    context_settings={"allow_extra_args": False},
    epilog=(
        "Examples:\n\n"
        "  bapo train                                   # tiny model, BAPO, staleness 4\n\n"
        "  bapo train algo=grpo staleness=8 trainer.lr=1e-3\n\n"
        "  bapo train -m algo=grpo,clip_higher,bapo staleness=0,4,8\n\n"
        "  bapo train -m hydra/launcher=joblib hydra.launcher.n_jobs=2 algo.rho0=0.3,0.5"
    ),
)
def train(
    overrides: list[str] | None = typer.Argument(
        None, help=SWEEP_OVERRIDES_HELP, show_default=False
    ),
    multirun: bool = typer.Option(
        False, "--multirun", "-m", help="Run a Hydra sweep (one job per combination)."
    ),
    nproc: int = typer.Option(
        0,
        "--nproc",
        help="Data-parallel processes on this machine (per node with --nnodes): re-runs itself "
        "via torchrun (1 = one process in a process group, e.g. NCCL/FSDP2 on one GPU); "
        "0 = this process (1 per node with --nnodes > 1).",
    ),
    nnodes: int = typer.Option(
        1, "--nnodes", help="Machines; run the same command on each (docs/distributed.md)."
    ),
    node_rank: int | None = typer.Option(
        None,
        "--node-rank",
        help="This machine's rank (0 runs at --rdzv-endpoint): fixed ranks, torchrun's static "
        "rendezvous; omitted = c10d rendezvous assigns them.",
        show_default=False,
    ),
    rdzv_endpoint: str | None = typer.Option(
        None,
        "--rdzv-endpoint",
        help="HOST:PORT where the nodes meet (--nnodes > 1).",
        show_default=False,
    ),
    slurm_script: Path | None = typer.Option(
        None,
        "--slurm-script",
        help="Write an sbatch script (srun + torchrun, --nnodes × --nproc) instead of training; "
        "every attempt (requeue, preemption, time limit) continues one run dir.",
        show_default=False,
    ),
    gpus_per_node: int | None = typer.Option(
        None,
        "--gpus-per-node",
        min=0,
        help="With --slurm-script: GPUs to ask SLURM for per node (0: none); default --nproc "
        "when model.device=cuda, else 0.",
        show_default=False,
    ),
    sbatch: list[str] | None = typer.Option(
        None,
        "--sbatch",
        help="With --slurm-script: one more #SBATCH option, long form (--sbatch=--partition=gpu "
        "--sbatch=--time=04:00:00 --sbatch=--mem=64G); repeatable.",
        show_default=False,
    ),
) -> None:
    """Train a policy with the composed config (conf/train.yaml)."""
    from bapo_cli.launch import jobs, launcher

    layout = launcher.TrainLayout(
        nproc, nnodes, node_rank, rdzv_endpoint, slurm_script, gpus_per_node, tuple(sbatch or ())
    )
    try:
        code = launcher.train(overrides, multirun, layout, jobs.train_job)
    except launcher.Refused as exc:
        raise _fail(str(exc)) from None
    except KeyboardInterrupt as stopped:  # the trainer saved, closed and said how to resume
        raise typer.Exit(getattr(stopped, "code", 130)) from None
    if code:
        raise typer.Exit(code)


@app.command(
    "eval",
    epilog=(
        "Examples:\n\n"
        "  bapo eval model.path=Qwen/Qwen2.5-Math-1.5B benchmark=aime24 eval.n=16\n\n"
        "  bapo eval benchmark=math500 benchmark.path=data/math500.jsonl eval.limit=20\n\n"
        "  bapo eval benchmark=[aime24,aime25] eval.n=16\n\n"
        "  bapo eval --watch RUN_DIR eval.server=http://127.0.0.1:8003 benchmark=aime24"
    ),
)
def evaluate(
    overrides: list[str] | None = typer.Argument(
        None, help=SWEEP_OVERRIDES_HELP, show_default=False
    ),
    multirun: bool = typer.Option(False, "--multirun", "-m", help="Run a Hydra sweep."),
    allow_existing_dir: bool = typer.Option(
        False,
        "--allow-existing-dir",
        help="Write into a hydra.run.dir that holds a run, an evaluation or a checkpoint "
        "(results.json, samples.jsonl, eval.log beside it; Hydra's record in .hydra-eval).",
    ),
    watch: Path | None = typer.Option(
        None,
        "--watch",
        metavar="RUN_DIR",
        help="Score every checkpoint of the training run in RUN_DIR as it appears, on the "
        "server of eval.server (its own), and log the scores to that run at their step; ends "
        "with the run.",
    ),
) -> None:
    """Score a model on a benchmark with the composed config (conf/eval.yaml).

    Several benchmarks in one call (`benchmark=[aime24,aime25]`) run as a multirun: one job and
    one results.json per benchmark.
    """
    from bapo_cli.launch import jobs, launcher

    overrides, several = _benchmark_list(list(overrides or []))
    try:
        if watch is not None:
            _watch(overrides, watch, multirun or several)
            return
        launcher.launch("eval", overrides, multirun or several, jobs.eval_job, allow_existing_dir)
    except launcher.Refused as exc:
        raise _fail(str(exc)) from None


def _watch(overrides: list[str], run_dir: Path, several: bool) -> None:
    """`bapo eval --watch RUN_DIR` (launch/watch.py); a failure after it started exits 1."""
    from bapo_cli.launch import watch

    try:
        watch.main(overrides, run_dir, several)
    except watch.WatchFailed as exc:
        _fail(str(exc))
        raise typer.Exit(1) from None


@app.command(
    epilog=(
        "Examples:\n\n"
        "  bapo serve --port 8001\n\n"
        "  bapo serve model=tiny_pairs --port 8002 --host 0.0.0.0\n\n"
        "  bapo serve --port 8001 --print-command\n\n"
        "  bapo serve model.path=DIR model.device=cuda --weights nccl --port 8001"
    ),
)
def serve(
    overrides: list[str] | None = typer.Argument(None, help=OVERRIDES_HELP, show_default=False),
    port: int = typer.Option(8000, "--port", min=1, max=65535, help="Port to listen on."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on (loopback)."),
    print_command: bool = typer.Option(
        False,
        "--print-command",
        help="Print the vLLM command (and its environment), start nothing.",
    ),
    weights: str = typer.Option(
        "filesystem",
        "--weights",
        help=(
            "How the trainer's weights arrive (its staleness.weights): filesystem | nccl (GPU) "
            "| gloo (vLLM's weight transfer over gloo; also takes filesystem pushes)."
        ),
    ),
) -> None:
    """Start a vLLM generation server for the run's model (rollout.servers=[URL]); prints its URL.

    The overrides are a training run's (the same model=..., model.path=...): the server gets the
    flags a run needs (worker extension, log-probs, weight routes), docs/engines.md.
    """
    from bapo_cli.rollout import serve as serving

    console = Console(highlight=False, soft_wrap=True, markup=False, emoji=False)
    try:
        with serving.StopSignals() as signals:  # SIGTERM, SIGINT, SIGHUP: 128 + N, server gone
            checked = _preflight("train", overrides)
            code = serving.run(
                checked.config,
                port=port,
                host=host,
                print_only=print_command,
                say=console.print,
                signals=signals,
                weights=weights,
            )
    except serving.Stopped as stopped:
        raise typer.Exit(128 + stopped.signum) from None
    except (serving.ServeError, serving.models.ModelLoadError) as err:
        raise _fail(str(err)) from None
    raise typer.Exit(code)


@app.command(
    "merge-lora",
    epilog="Example:\n\n  bapo merge-lora outputs/runs/<date>/<time>/checkpoints/step_000100 out/",
)
def merge_lora(
    checkpoint: Path = typer.Argument(..., help="A LoRA checkpoint (adapter_config.json)."),
    out: Path = typer.Argument(..., help="New or empty directory to write the merged model to."),
    base: str | None = typer.Option(
        None, "--base", help="Base model (HF id or dir); default: the one the adapter names."
    ),
    force: bool = typer.Option(
        False, "--force", help="Use a non-empty OUT: its contents are renamed aside, not deleted."
    ),
) -> None:
    """Merge a LoRA checkpoint into its base: a plain HF model dir (transformers, vLLM, eval).

    Never deletes what it did not write: a non-empty OUT is refused (--force sets it aside as
    OUT.replaced-<time>), and OUT may never be a link, a file, CKPT or a directory holding it."""
    from bapo_cli.models import lora

    try:
        merged = lora.merge(checkpoint, out, base=base, force=force)
    except lora.ModelLoadError as err:
        raise _fail(str(err)) from None
    said = f"merged {checkpoint} into {merged.path}"
    if merged.set_aside is not None:
        said += f" (its previous contents are in {merged.set_aside})"
    _say(said)


def _benchmark_list(overrides: list[str]) -> tuple[list[str], bool]:
    """`benchmark=[a,b]` → `benchmark=a,b` (a sweep), since one job scores one benchmark."""
    out, several = [], False
    for raw in overrides:
        if raw.startswith("benchmark=[") and raw.endswith("]"):
            out.append("benchmark=" + raw[len("benchmark=[") : -1])
            several = True
        else:
            out.append(raw)
    return out, several


@app.command(
    epilog=(
        "Examples:\n\n"
        "  bapo config algo=bapo staleness=4\n\n"
        "  bapo config --eval benchmark=aime25 --resolve\n\n"
        "  bapo config --docs"
    ),
)
def config(
    overrides: list[str] | None = typer.Argument(None, help=OVERRIDES_HELP, show_default=False),
    resolve: bool = typer.Option(False, "--resolve", help="Resolve ${...} interpolations."),
    eval_: bool = typer.Option(False, "--eval", help="Compose conf/eval.yaml instead of train."),
    docs: bool = typer.Option(False, "--docs", help="List every option with its documentation."),
) -> None:
    """Print the composed, validated config as YAML (nothing runs)."""
    from omegaconf import OmegaConf

    from bapo_cli.config import hydra_runner, schema

    name = "eval" if eval_ else "train"
    if docs:
        _print_docs(schema.TrainConfig if name == "train" else schema.EvalRunConfig)
        return
    from bapo_cli import redact

    checked = _preflight(name, overrides)
    cfg = hydra_runner.compose(name, checked.overrides)
    shown = redact.tree(OmegaConf.to_container(cfg, resolve=resolve))  # credentials masked
    sys.stdout.write(OmegaConf.to_yaml(shown))


def _print_docs(top: type) -> None:
    from rich.markup import escape

    from bapo_cli.config import schema

    table = Table(title=f"Options of bapo {'train' if top is schema.TrainConfig else 'eval'}")
    for column in ("key", "type", "schema default", "meaning"):
        table.add_column(column, overflow="fold")
    for row in schema.option_docs(top):
        table.add_row(*(escape(cell) for cell in row))  # `[bapo]`, `list[float]`: not markup
    Console(width=max(Console().width, 140)).print(table)


@app.command()
def runs(
    uri: str | None = typer.Option(None, help="Tracking URI (default: the train config's)."),
    experiment: str | None = typer.Option(None, help="Only this MLflow experiment."),
    limit: int = typer.Option(20, help="Newest N runs."),
) -> None:
    """List tracked runs in the MLflow store, newest first."""
    from bapo_cli import redact, tracking

    if uri is None:
        uri = _preflight("train", []).config.tracking.uri
    with _store_errors(uri):
        rows = tracking.list_runs(uri, experiment, limit)  # fail-fast HTTP (tracking.store)
    if not rows:
        _say(f"no runs yet in {redact.text(uri)}")
        return
    from bapo_cli.tracking import reader

    reader.print_whole(reader.runs_table(rows, redact.text(uri), RUN_COLUMNS), Console())


@contextlib.contextmanager
def _store_errors(uri: str) -> Iterator[None]:
    """A store that is down or refuses (MLflow's errors): one masked `error:` line, exit 1."""
    from mlflow.exceptions import MlflowException

    from bapo_cli import tracking

    try:
        yield
    except MlflowException as exc:
        _fail(f"tracking: cannot read runs from {uri} ({tracking.describe_failure(exc)})")
        raise typer.Exit(1) from None


RUN_COLUMNS = ("reward/mean", "actor/entropy", "actor/c_low", "actor/c_high", "staleness/mean")


@app.command(
    epilog=(
        "Examples:\n\n"
        "  bapo report --sweep outputs/sweeps/2026-01-01/12-00-00\n\n"
        "  bapo report --experiment staleness_study --facet staleness --out docs/study\n\n"
        "  bapo report 4ae6d249496d 9939f111ddfb"
    ),
)
def report(
    run_ids: list[str] | None = typer.Argument(None, help="MLflow run ids.", show_default=False),
    sweep: Path | None = typer.Option(None, help="A sweep dir (outputs/sweeps/<date>/<time>)."),
    experiment: str | None = typer.Option(None, help="Every run of this MLflow experiment."),
    uri: str | None = typer.Option(None, help="Tracking URI (default: the sweep's or config's)."),
    out: Path | None = typer.Option(None, help="Report dir (default: <sweep>/report or outputs)."),
    facet: str | None = typer.Option(
        None,
        help="A config facet (e.g. staleness.k, algo, or staleness.k,trainer.lr): one column "
        "of plot panels per value.",
    ),
    baseline: str | None = typer.Option(
        None,
        help="A facet KEY=VALUE (e.g. algo=grpo): compare every group with the group holding "
        "it in the same cell of the other facets (mean difference, permutation p) in "
        "comparisons.md.",
    ),
    failures: bool = typer.Option(
        False,
        "--failures",
        help="Pair-search runs: sample each run's final checkpoint and its starting weights on "
        "the held-out split again and class every wrong sample (no stop, malformed, wrong sum, "
        "false stop, wrong verdict, wrong pair) in failures.md; cached in the report dir.",
    ),
) -> None:
    """Compare runs: a table (markdown, CSV) and plots per metric, logged to the sweep's parent."""
    import time

    from bapo_cli import report as rep

    if sum(x is not None and x != [] for x in (run_ids, sweep, experiment)) != 1:
        raise _fail("give exactly one of --sweep DIR, --experiment NAME or RUN_ID...")
    try:
        if uri is None:
            uri = (
                rep.sweep_store(sweep)
                if sweep is not None
                else _preflight("train", []).config.tracking.uri
            )
        with _store_errors(uri):
            runs = rep.load_runs(uri, sweep_dir=sweep, experiment=experiment, run_ids=run_ids)
        if out is None:
            root = Path(_preflight("train", []).config.paths.output_root)
            stamp = time.strftime("%Y-%m-%d/%H-%M-%S")
            out = sweep / "report" if sweep is not None else root / "reports" / stamp
        with _store_errors(uri):
            result = rep.write_report(runs, out, uri, facet, baseline, failures=failures)
    except rep.ReportError as exc:
        raise _fail(str(exc)) from None
    Console().print(f"{len(result.runs)} runs compared")
    for path in result.files:
        print(path)
    if result.parent_id:
        Console().print(f"logged to MLflow parent run {result.parent_id} (artifacts: report/)")


@app.command()
def ui(
    uri: str | None = typer.Option(None, help="Tracking URI (default: the train config's)."),
    experiment: str | None = typer.Option(
        None, help="The experiment whose runs it opens on (default: the train config's)."
    ),
    port: int = typer.Option(5000, help="Port on 127.0.0.1."),
) -> None:
    """Start the MLflow UI on your tracking store and print the address of your runs.

    Ctrl-C (or closing the terminal) stops all of it."""
    from bapo_cli import redact
    from bapo_cli.tracking import server, store

    if uri is None or experiment is None:  # the train config's defaults (composing it: seconds)
        tracking = _preflight("train", []).config.tracking
        uri = tracking.uri if uri is None else uri
        experiment = experiment or tracking.experiment
    address = store.ui_address(uri, experiment, "127.0.0.1", port)
    _say(f"MLflow UI for {redact.text(uri)}: {address}  (Ctrl-C stops it)")
    raise typer.Exit(server.run_ui(uri, port))


def _version(value: bool) -> None:
    if value:
        print(f"bapo-cli {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Show the version and exit."
    ),
) -> None:
    """Off-policy RL for LLMs with BAPO."""


def _help_from_docstrings() -> None:
    """Each command's help is its docstring, one line per paragraph (the console wraps it, not
    the source's line breaks) and printed as written (`benchmark=[a,b]` is no markup)."""
    from rich.markup import escape

    for info in app.registered_commands:
        doc = inspect.getdoc(info.callback) or ""
        paragraphs = [" ".join(p.split()) for p in doc.split("\n\n")]
        info.help = "\n\n".join(escape(p) for p in paragraphs if p)


_help_from_docstrings()


def main() -> None:
    try:
        app()
    finally:
        skip_last_collection()  # the process ends: its objects are the OS's to free


if __name__ == "__main__":
    main()

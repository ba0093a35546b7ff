"""What a training run records once, when its tracking starts: the params and config.yaml
(secrets masked), the run name, the tags (algo, staleness, regime, model, engine) and the git
commit of the bapo-cli checkout it runs from."""

from __future__ import annotations

import subprocess
import tomllib
from pathlib import Path

from omegaconf import OmegaConf

from bapo_cli import redact
from bapo_cli.config.schema import TrainConfig
from bapo_cli.tracking import flatten

__all__ = ["run_name", "run_record", "run_tags", "source_commit"]


def run_record(cfg: TrainConfig) -> tuple[dict[str, str], str]:
    """What a run records of its config in MLflow: the flattened params and config.yaml, with
    URL credentials and secret-named values masked (bapo_cli.redact)."""
    params = redact.params(flatten(cfg))
    tree = redact.tree(OmegaConf.to_container(OmegaConf.structured(cfg)))
    return params, OmegaConf.to_yaml(tree)


def run_name(cfg: TrainConfig, swept: list[str] | None = None) -> str:
    """`bapo-reuse4-tiny-s0`, and for a sweep job the values it sweeps (`...-s0-rho0=0.3`), so
    the children of one sweep are told apart by name."""
    stale = f"{cfg.staleness.regime}{cfg.staleness.k}"
    name = f"{cfg.algo.name}-{stale}-{cfg.model.name}-s{cfg.trainer.seed}"
    return "-".join([name, *(swept or [])])


def run_tags(cfg: TrainConfig, engine: str) -> dict[str, str]:
    tags = {
        "algo": cfg.algo.name,
        "staleness": str(cfg.staleness.k),
        "regime": cfg.staleness.regime,
        "model": cfg.model.name,
        "rollout": engine,
    }
    commit = source_commit()
    if commit is not None:
        tags["git_commit"] = commit
    return tags


def _git(cwd: Path, *args: str) -> str:
    """A git command's output, "" when it fails (no git, not a repository)."""
    try:
        done = subprocess.run(["git", *args], capture_output=True, text=True, timeout=5, cwd=cwd)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return done.stdout.strip() if done.returncode == 0 else ""


def source_commit(package: Path | None = None) -> str | None:
    """HEAD of the bapo-cli checkout this package runs from, else None.

    Only when the package is `<top>/src/bapo_cli` of a repository whose pyproject.toml names
    bapo-cli: a package installed into site-packages of a venv that lies inside some other
    repository (or inside this one) must not tag runs with a commit it did not come from.
    """
    package = (package or Path(__file__).parents[1]).resolve()
    top = _git(package, "rev-parse", "--show-toplevel")
    if not top or package != Path(top).resolve() / "src" / "bapo_cli":
        return None
    try:
        with (Path(top) / "pyproject.toml").open("rb") as f:
            name = tomllib.load(f).get("project", {}).get("name")
    except (OSError, tomllib.TOMLDecodeError):
        return None
    if name != "bapo-cli":
        return None
    return _git(package, "rev-parse", "HEAD") or None

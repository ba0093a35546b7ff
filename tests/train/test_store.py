"""Where a single run's MLflow store and artifacts live, and what commit it is tagged with.

- First runs that start together on a fresh SQLite store both get a run (the store and the
  experiment are created under a file lock; MLflow's schema migration races otherwise).
- Artifacts go next to the store (outputs/mlartifacts), not into ./mlruns of whatever directory
  the first run started in.
- `git_commit` is bapo-cli's own commit, never that of a repository the package sits in.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from mlflow.tracking import MlflowClient

import bapo_cli
from bapo_cli.config.preflight import preflight
from bapo_cli.trainer import run_record
from tests.conftest import REPO
from tests.train.conftest import run_train

# one process of the race: import everything, say so, wait for the start signal of each round,
# then open the round's fresh store the way `bapo train` does
RACER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from bapo_cli.tracking import MlflowTracker

    root, me, rounds = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    for r in range(rounds):
        (root / f"ready-{r}-{me}").touch()
        while not (root / f"go-{r}").exists():
            time.sleep(0.001)
        try:
            tracker = MlflowTracker(f"sqlite:///{root}/store{r}/mlflow.db", "bapo", flush_every=1)
            tracker.close()
            print(f"{r} ok {tracker.run_id}", flush=True)
        except Exception as exc:
            print(f"{r} failed {type(exc).__name__}: {str(exc)[:200]!r}", flush=True)
    """
)


def test_first_runs_on_a_fresh_store_at_the_same_moment_all_succeed(tmp_path: Path) -> None:
    """Before the lock: 3 processes on a fresh store failed 8-10 times in 12 (see
    benchmarks/bench_store_race.py)."""
    procs, rounds = 3, 3
    env = {**os.environ, "PYTHONPATH": str(Path(bapo_cli.__file__).parents[1])}
    racers = [
        subprocess.Popen(
            [sys.executable, "-c", RACER, str(tmp_path), str(i), str(rounds)],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=env,
        )
        for i in range(procs)
    ]
    for r in range(rounds):
        deadline = time.monotonic() + 240
        while len(list(tmp_path.glob(f"ready-{r}-*"))) < procs:
            assert time.monotonic() < deadline, "the racers did not get ready"
            assert all(p.poll() is None for p in racers), "a racer died"
            time.sleep(0.01)
        (tmp_path / f"go-{r}").touch()
    lines = [line for p in racers for line in p.communicate(timeout=240)[0].splitlines()]
    assert all(" ok " in line for line in lines), lines
    assert len(lines) == procs * rounds
    for r in range(rounds):
        client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/store{r}/mlflow.db")
        experiment = client.get_experiment_by_name("bapo")
        runs = client.search_runs([experiment.experiment_id])
        ids = {line.split()[2] for line in lines if line.startswith(f"{r} ")}
        assert {run.info.run_id for run in runs} == ids and len(ids) == procs


def test_artifacts_go_next_to_the_store_not_into_the_cwd(tmp_path: Path, monkeypatch) -> None:
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    store = tmp_path / "outputs" / "mlflow.db"
    uri = f"sqlite:///{store}"
    result = run_train(
        tmp_path, "trainer.max_steps=1", "tracking=mlflow", f"tracking.uri={uri}", name="run"
    )
    assert list(cwd.iterdir()) == []  # MLflow's default would have made ./mlruns here
    client = MlflowClient(tracking_uri=uri)
    run = client.get_run(result.run_id)
    location = client.get_experiment(run.info.experiment_id).artifact_location
    assert Path(location.removeprefix("file://")) == tmp_path / "outputs" / "mlartifacts"
    logged = tmp_path / "outputs" / "mlartifacts" / result.run_id / "artifacts"
    assert (logged / "config.yaml").is_file() and (logged / "samples.jsonl").is_file()


def _git(cwd: Path, *args: str) -> str:
    env = {
        **os.environ,
        "GIT_AUTHOR_NAME": "t",
        "GIT_AUTHOR_EMAIL": "t@t",
        "GIT_COMMITTER_NAME": "t",
    }
    env["GIT_COMMITTER_EMAIL"] = "t@t"
    done = subprocess.run(["git", *args], cwd=cwd, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def _repo_with(tmp_path: Path, package_at: str, project_name: str) -> tuple[Path, str]:
    """A git repository holding a copy of the package at `package_at`; (package dir, HEAD)."""
    repo = tmp_path / "other"
    package = repo / package_at
    shutil.copytree(Path(bapo_cli.__file__).parent, package, ignore=shutil.ignore_patterns("*.pyc"))
    (repo / "pyproject.toml").write_text(f'[project]\nname = "{project_name}"\n')
    _git(repo, "init", "-q")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "someone else's project")
    return package, _git(repo, "rev-parse", "HEAD")


def test_git_commit_is_this_checkouts_head() -> None:
    head = _git(REPO, "rev-parse", "HEAD")
    assert run_record.source_commit() == head
    cfg = preflight("train", []).config
    assert run_record.run_tags(cfg, "hf")["git_commit"] == head


def test_no_git_commit_from_a_repository_the_package_was_installed_into(tmp_path: Path) -> None:
    """A venv inside someone else's repository, its site-packages tracked there: the run tags
    of `bapo train` imported from that copy carry no commit (they carried the other one's)."""
    package, head = _repo_with(tmp_path, ".venv/lib/python3.11/site-packages/bapo_cli", "app")
    shutil.copytree(REPO / "conf", package / "conf")  # where a wheel keeps the configs
    probe = (
        "import bapo_cli; from bapo_cli.config.preflight import preflight; "
        "from bapo_cli.trainer.run_record import run_tags; print(bapo_cli.__file__); "
        "print(run_tags(preflight('train', []).config, 'hf').get('git_commit'))"
    )
    env = {**os.environ, "PYTHONPATH": str(package.parent)}
    done = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    where, commit = done.stdout.split()
    assert Path(where).parent == package  # the copy ran, not this checkout
    assert head and commit == "None"
    assert run_record.source_commit(package) is None


def test_no_git_commit_from_another_project_with_the_same_layout(tmp_path: Path) -> None:
    package, head = _repo_with(tmp_path, "src/bapo_cli", "not-bapo")
    assert head and run_record.source_commit(package) is None


def test_git_commit_of_a_copy_of_the_bapo_cli_checkout(tmp_path: Path) -> None:
    package, head = _repo_with(tmp_path, "src/bapo_cli", "bapo-cli")
    assert run_record.source_commit(package) == head

"""Secrets the first masking rule let through (issue 22): env-style names (`PGPASSWORD`,
`MYSQL_PWD`, `*_PASS`), every value under `hydra.job.env_set`, a quoted password with a space,
credentialed URLs in free-form fields (the plan table, the experiment name), and the store and
run-dir files that keep secrets as typed, created owner-only."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from bapo_cli import redact
from bapo_cli.launch import plan, rundir
from bapo_cli.tracking import store

PW = "Pw0rd-s3cr3t"


@pytest.mark.parametrize(
    ("key", "secret"),
    [
        ("PGPASSWORD", True),
        ("+hydra.job.env_set.PGPASSWORD", True),
        ("MYSQL_PWD", True),
        ("DB_PASS", True),
        ("GITHUBTOKEN", True),
        ("AWS_SECRET_ACCESS_KEY", True),
        ("SSH_PASSPHRASE", True),
        ("hydra.job.env_set.ANY_NAME", True),  # every env var handed to a job
        ("hydra.job.env_set.MLFLOW_TRACKING_USERNAME", True),
        ("db_pass", True),
        ("mysqlPwd", True),
        ("rollout.max_tokens", False),
        ("trainer.prompts_per_step", False),
        ("compass", False),
        ("passes", False),
        ("monkey", False),
        ("hydra.job.env_set", False),  # the node itself, not a value under it
    ],
)
def test_env_style_names_and_env_set_values(key: str, secret: bool) -> None:
    assert redact.is_secret_name(key) is secret


def test_sweep_tags_mask_env_set_values_whatever_their_name() -> None:
    typed = [f"+hydra.job.env_set.PGPASSWORD={PW}", f"+hydra.job.env_set.DB_URL={PW}x", "a=1"]
    shown = redact.params({"bapo.command": "bapo train -m " + " ".join(typed)})
    assert shown["bapo.command"] == (
        "bapo train -m +hydra.job.env_set.PGPASSWORD=*** +hydra.job.env_set.DB_URL=*** a=1"
    )
    assert redact.overrides(typed) == [
        "+hydra.job.env_set.PGPASSWORD=***",
        "+hydra.job.env_set.DB_URL=***",
        "a=1",
    ]


def test_a_quoted_password_with_a_space_is_masked_wherever_it_is_printed() -> None:
    spaced = "my s3cret pass"
    redact.remember_overrides(
        [
            f"tracking.uri='http://alice:{spaced}@127.0.0.1:1'",
            f"+hydra.job.env_set.X_PWD='{spaced}2'",
        ]
    )
    # the plan table and the error line print the value unquoted, where no pattern finds its end
    assert redact.text(f"tracking  http://alice:{spaced}@127.0.0.1:1") == (
        "tracking  http://alice:***@127.0.0.1:1"
    )
    assert redact.text(f"error: X_PWD={spaced}2 is not a number") == (
        "error: X_PWD=*** is not a number"
    )
    assert redact.url_secret("https://tok en@h/x") == "tok en"
    assert redact.url_secret("file:///a/b@c") is None  # a path, not user info


def test_an_unquoted_env_value_that_is_a_common_word_is_not_masked_everywhere() -> None:
    redact.remember_overrides(["+hydra.job.env_set.TOKENIZERS_PARALLELISM=false"])
    assert redact.text("trainer.resume: false") == "trainer.resume: false"


def test_the_plan_masks_every_free_form_field() -> None:
    rows = [("model", f"http://alice:{PW}@hub.example/m (x)"), ("tracking", "e2e")]
    console = Console(record=True, width=200)
    plan.show("bapo train", rows, console)
    printed = console.export_text()
    assert PW not in printed and "http://alice:***@hub.example/m (x)" in printed


@pytest.fixture(scope="module")
def fresh_store(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One SQLite store made by the project under a usual umask (MLflow's migration of a new
    store takes seconds: the tests below share it)."""
    root = tmp_path_factory.mktemp("store") / "outputs"
    old = os.umask(0o022)
    try:
        uri = f"sqlite:///{root}/mlflow.db"
        store.open_experiment(uri, "bapo")
    finally:
        os.umask(old)
    return uri


def test_the_experiment_name_is_stored_masked(fresh_store: str) -> None:
    uri = fresh_store
    client, exp_id = store.open_experiment(uri, f"exp http://alice:{PW}@h:1")
    assert client.get_experiment(exp_id).name == "exp http://alice:***@h:1"
    # the same name finds it again (masking is idempotent)
    assert store.open_experiment(uri, f"exp http://alice:{PW}@h:1")[1] == exp_id


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_the_store_and_run_dirs_are_private(fresh_store: str, tmp_path: Path) -> None:
    assert _mode(store.sqlite_path(fresh_store)) == 0o600  # was 0644 under umask 022
    old = os.umask(0o022)
    try:
        run = rundir.claim_timestamped(tmp_path / "outputs", "runs")
        named = tmp_path / "named" / "run"
        rundir.create_private(named)
    finally:
        os.umask(old)
    assert _mode(run) == 0o700
    assert _mode(named) == 0o700


# the real launch path with a job that validates its config as `bapo train`'s does and reports
# the modes of what Hydra wrote
JOB = """
import os, stat, sys
from pathlib import Path
from hydra.core.hydra_config import HydraConfig
from bapo_cli.launch import launcher
from bapo_cli.launch import jobs

def task(cfg):
    jobs._validated(cfg)
    hydra = HydraConfig.get()
    run = Path(hydra.runtime.output_dir)
    found = [run, *sorted((run / ".hydra").glob("*.yaml"))]
    if sys.argv[1] == "1":
        found += [Path(hydra.sweep.dir), Path(hydra.sweep.dir) / "multirun.yaml"]
    for path in found:
        print("MODE", oct(stat.S_IMODE(path.stat().st_mode)), path.name, flush=True)

os.umask(0o022)
launcher.launch("train", sys.argv[2:], sys.argv[1] == "1", task)
"""


@pytest.mark.slow
@pytest.mark.parametrize("multirun", ["0", "1"])
def test_hydra_records_of_a_run_are_owner_only(multirun: str, _output_root: Path) -> None:
    overrides = ["tracking=none", f"+hydra.job.env_set.PGPASSWORD={PW}"]
    if multirun == "1":
        overrides.append("algo.rho0=0.3,0.4")
    done = subprocess.run(
        [sys.executable, "-c", JOB, multirun, *overrides],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    modes = [line.split()[1:] for line in done.stdout.splitlines() if line.startswith("MODE")]
    names = {name for _, name in modes}
    assert {"config.yaml", "overrides.yaml", "hydra.yaml"} <= names
    if multirun == "1":
        assert "multirun.yaml" in names
    for mode, name in modes:
        assert mode == ("0o600" if name.endswith(".yaml") else "0o700"), (name, mode)


def test_the_run_name_is_stored_masked(fresh_store: str) -> None:
    """Run names are made of free-form fields (`model.name`): `bapo-reuse4-<model.name>-s0`."""
    from bapo_cli.tracking import MlflowTracker

    uri = fresh_store
    tracker = MlflowTracker(uri, "bapo", run_name=f"bapo-reuse4-http://alice:{PW}@hub/m-s0")
    tracker.close()
    run = store.client(uri).get_run(tracker.run_id)
    assert run.info.run_name == "bapo-reuse4-http://alice:***@hub/m-s0"


@pytest.mark.slow
def test_a_jobs_error_line_is_masked(_output_root: Path) -> None:
    """The job's `error:` lines quote what failed to load, credentials included."""
    from tests.conftest import run_bapo

    result = run_bapo("train", "tracking=none", f"model.path=https://alice:{PW}@127.0.0.1:1/m")
    assert result.returncode == 2, result.stderr[-2000:]
    assert "error: model.path=https:/alice:***@127.0.0.1:1/m: no such directory" in result.stderr
    assert PW not in result.stdout + result.stderr
    (log,) = _output_root.glob("runs/*/*/train.log")
    assert PW not in log.read_text()


def test_a_short_secret_is_masked_by_pattern_only_and_tests_forget_literals() -> None:
    redact.remember_overrides(["tracking.uri=http://u:2026@h:1", "+hydra.job.env_set.DB_PASS=a b"])
    assert redact.text("http://u:2026@h:1 on 2026-12-01") == "http://u:***@h:1 on 2026-12-01"
    assert redact.text("DB_PASS is 'a b'") == "DB_PASS is '***'"
    redact.forget()
    assert redact.text("DB_PASS is 'a b'") == "DB_PASS is 'a b'"

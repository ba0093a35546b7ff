"""Secrets never leave the machine in clear: credentials in `tracking.uri` and values of
secret-named keys are masked in MLflow params, tags and the config.yaml artifact, in `bapo config`,
the plan and summary tables, error lines and tracking warnings (bapo_cli.tracking.redact).

The end-to-end test runs a sweep against a real `mlflow server` on 127.0.0.1 with
`http://alice:<password>@127.0.0.1:<port>`: the server has no auth, so it ignores the basic-auth
header and the run is recorded, which lets the test read back everything that was sent.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient
from typer.testing import CliRunner

from bapo_cli import redact, tracking
from bapo_cli.cli import app
from bapo_cli.config import schema
from bapo_cli.config.preflight import preflight
from bapo_cli.tracking import MlflowTracker
from bapo_cli.trainer.run_record import run_record
from tests.conftest import BENCHMARKS, run_bapo

PW = "Pw0rd-s3cr3t"  # appears nowhere else in any output
TOKEN = "hf_T0ken-s3cr3t"
runner = CliRunner()

# ------------------------------------------------------------------------- the pure redactor

SAFE = st.text("abcdefghijklmnopqrstuvwxyz0123456789-_.", min_size=1, max_size=12)
SECRET = st.text(
    st.characters(exclude_categories=("Z", "Cc", "Cs")), min_size=1, max_size=24
).filter(lambda s: not any(c.isspace() for c in s))


@settings(max_examples=300, deadline=None)
@given(
    scheme=st.sampled_from(["http", "https", "postgresql+psycopg2", "mysql"]),
    user=SAFE,
    password=SECRET,
    host=SAFE,
    tail=st.sampled_from(["", ":5000", ":5000/", "/db?x=1", ":1/api"]),
)
def test_url_password_is_masked_and_the_rest_kept(scheme, user, password, host, tail) -> None:
    url = f"{scheme}://{user}:{password}@{host}{tail}"
    assert redact.text(url) == f"{scheme}://{user}:***@{host}{tail}"
    line = f"error: tracking: cannot start the MLflow run at {url} (connection refused)"
    assert redact.text(line) == line.replace(f"{user}:{password}@", f"{user}:***@")


@settings(max_examples=200, deadline=None)
@given(token=SECRET.filter(lambda s: ":" not in s.rstrip(":")), host=SAFE)
def test_url_token_as_user_is_masked(token, host) -> None:
    assert redact.text(f"https://{token}@{host}/x") == f"https://***@{host}/x"


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=60))
def test_masking_is_idempotent(text: str) -> None:
    once = redact.text(text)
    assert redact.text(once) == once


def test_overrides_as_hydra_prints_them() -> None:
    """Hydra's launchers log each job's overrides with `:` escaped."""
    line = rf"#0 : tracking.uri=http\://alice\:{PW}@127.0.0.1\:5000 algo.rho0=0.3"
    masked = r"#0 : tracking.uri=http\://alice\:***@127.0.0.1\:5000 algo.rho0=0.3"
    assert redact.text(line) == masked


@pytest.mark.parametrize(
    "override",
    [
        f"tracking.uri=[http://alice:{PW}@h:1",  # Hydra's parser quotes it
        f"tracking.uri={{http://alice:{PW}@h:1}}",  # OmegaConf quotes it as a dict, no scheme
        f"tracking.uri=http://alice:{PW}@h:1)",
    ],
)
def test_error_lines_quoting_a_uri_mask_it(override: str) -> None:
    result = runner.invoke(app, ["config", override])
    assert result.exit_code == 2
    assert "error:" in result.output and PW not in result.output
    assert "alice:***@h:1" in result.output


def test_sweep_of_uris_masks_both() -> None:
    line = redact.text(f"tracking.uri=http://a:{PW}@h1:5000,http://b:{PW}x@h2:5000")
    assert PW not in line and line.endswith("@h2:5000")


@pytest.mark.parametrize(
    ("key", "secret"),
    [
        ("HF_TOKEN", True),
        ("hydra.job.env_set.MLFLOW_TRACKING_PASSWORD", True),
        ("+hydra.job.env_set.WANDB_API_KEY", True),
        ("tracking.api_key", True),
        ("db.passwd", True),
        ("apiKey", True),
        ("client_secret", True),
        ("key", True),
        ("aws/credentials", True),
        ("hydra.job.env_set.MLFLOW_TRACKING_USERNAME", True),  # every env_set value
        ("rollout.max_tokens", False),
        ("algo.low_range", False),
        ("keyboard", False),
        ("monkey", False),
        ("sort_keys", False),
        ("tokenizer", False),
        ("tracking.uri", False),
    ],
)
def test_secret_names(key: str, secret: bool) -> None:
    assert redact.is_secret_name(key) is secret


def test_no_option_of_the_schema_counts_as_secret() -> None:
    """The rule must not hide real settings (`algo.low_range`, `rollout.max_tokens`, ...)."""
    for top in (schema.TrainConfig, schema.EvalRunConfig):
        keys = [row[0] for row in schema.option_docs(top)]
        assert keys and not [k for k in keys if redact.is_secret_name(k)]


def test_overrides_params_and_trees() -> None:
    assert redact.overrides(
        [f"+hydra.job.env_set.HF_TOKEN={TOKEN}", "algo.rho0=0.3", "HF_TOKEN='a b'", "api_key="]
    ) == ["+hydra.job.env_set.HF_TOKEN=***", "algo.rho0=0.3", "HF_TOKEN=***", "api_key="]
    assert redact.text(f"x=1 db_password={PW}&y=2") == "x=1 db_password=***&y=2"
    assert redact.params({"a.token": TOKEN, "a.key": None, "u": f"http://u:{PW}@h"}) == {
        "a.token": "***",
        "a.key": "None",  # nothing to hide
        "u": "http://u:***@h",
    }
    tree = {"env": {"HF_TOKEN": TOKEN, "n": 1}, "credentials": {"user": "u", "pw": PW}}
    assert redact.tree(tree) == {
        "env": {"HF_TOKEN": "***", "n": 1},
        "credentials": {"user": "***", "pw": "***"},
    }


# ---------------------------------------------------------------- what the code records or prints


def test_run_record_masks_a_uri_from_the_environment(monkeypatch) -> None:
    monkeypatch.setenv("BAPO_SECRET_URI", f"http://alice:{PW}@127.0.0.1:1/")
    cfg = preflight("train", ["tracking.uri=${oc.env:BAPO_SECRET_URI}"]).config
    assert cfg.tracking.uri == f"http://alice:{PW}@127.0.0.1:1/"  # what the client connects to
    params, config_yaml = run_record(cfg)
    assert params["tracking.uri"] == "http://alice:***@127.0.0.1:1/"
    assert params["algo.rho0"] == "0.4" and params["algo.low_range"] == "[0.6, 0.9]"
    assert PW not in " ".join(params.values()) and PW not in config_yaml
    recorded = yaml.safe_load(config_yaml)
    assert recorded["tracking"]["uri"] == "http://alice:***@127.0.0.1:1/"
    assert recorded["algo"]["low_range"] == [0.6, 0.9]


def test_job_tags_and_store_errors_mask_credentials() -> None:
    tags = tracking.job_tags(
        [f"tracking.uri=http://alice:{PW}@h:5000", f"+hydra.job.env_set.HF_TOKEN={TOKEN}"],
        "/sweep",
        0,
        None,
    )
    shown = tags[tracking.OVERRIDES_TAG]
    assert shown == "tracking.uri=http://alice:***@h:5000 +hydra.job.env_set.HF_TOKEN=***"
    # MLflow's REST errors name the URL they called, credentials included
    err = MlflowException(f"API request to http://alice:{PW}@h:5000/api/2.0/x failed: Boom")
    assert PW not in tracking.describe_failure(err)
    assert "alice:***@h:5000" in tracking.describe_failure(err)


@pytest.mark.parametrize("via_env", [False, True])
def test_bapo_config_masks_credentials(via_env: bool, monkeypatch) -> None:
    monkeypatch.setenv("BAPO_SECRET_URI", f"http://alice:{PW}@127.0.0.1:1/")
    uri = "${oc.env:BAPO_SECRET_URI}" if via_env else f"http://alice:{PW}@127.0.0.1:1/"
    result = runner.invoke(app, ["config", f"tracking.uri={uri}", "--resolve"])
    assert result.exit_code == 0, result.output
    assert PW not in result.output
    assert yaml.safe_load(result.output)["tracking"]["uri"] == "http://alice:***@127.0.0.1:1/"


def test_failing_train_masks_the_uri_in_plan_error_and_log(_output_root: Path) -> None:
    uri = f"http://alice:{PW}@127.0.0.1:1/"  # nothing listens on port 1
    result = run_bapo(
        "train", "experiment=smoke", "rollout=hf", "tracking=mlflow", f"tracking.uri={uri}"
    )
    assert result.returncode == 1, result.stdout + result.stderr
    out = result.stdout + result.stderr
    assert PW not in out
    assert "http://alice:***@127.0.0.1:1/" in result.stdout  # the plan
    assert "error: tracking: cannot start the MLflow run at http://alice:***@127.0.0.1:1/" in (
        " ".join(result.stderr.split())
    )
    (log,) = (_output_root / "runs").glob("*/*/train.log")
    assert PW not in log.read_text()


@pytest.mark.slow
def test_sweep_on_a_server_records_no_secret(
    mlflow_server, _output_root: Path, caplog, monkeypatch
) -> None:
    monkeypatch.setenv(tracking.QUIET_LINKS, "false")  # restored after the tracker below sets it
    host = mlflow_server.uri.removeprefix("http://")
    uri = f"http://alice:{PW}@{host}"
    result = run_bapo(
        "train",
        "-m",
        "experiment=smoke",
        "tracking=mlflow",
        "rollout=hf",
        "trainer.max_steps=1",
        f"tracking.uri={uri}",
        f"+hydra.job.env_set.HF_TOKEN={TOKEN}",
        "algo.rho0=0.3,0.5",
        env={"OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr
    printed = result.stdout + result.stderr
    assert PW not in printed and TOKEN not in printed
    assert f"http://alice:***@{host}" in printed

    client = MlflowClient(tracking_uri=mlflow_server.uri)
    runs = client.search_runs([client.get_experiment_by_name("bapo").experiment_id])
    (parent,) = [r for r in runs if r.data.tags.get(tracking.ROLE_TAG) == "sweep"]
    children = tracking.child_runs(client, parent.info.run_id)
    assert len(children) == 2
    command = parent.data.tags["bapo.command"]
    assert f"tracking.uri=http://alice:***@{host}" in command
    assert "+hydra.job.env_set.HF_TOKEN=***" in command
    for child in children:
        assert child.data.params["tracking.uri"] == f"http://alice:***@{host}"
        escaped = host.replace(":", "\\:")  # the job's overrides as Hydra hands them over
        overrides = child.data.tags[tracking.OVERRIDES_TAG]
        assert f"tracking.uri=http\\://alice\\:***@{escaped}" in overrides
        config_yaml = Path(client.download_artifacts(child.info.run_id, "config.yaml"))
        assert yaml.safe_load(config_yaml.read_text())["tracking"]["uri"] == (
            f"http://alice:***@{host}"
        )
    for run in runs:
        recorded = " ".join([*run.data.params.values(), *run.data.tags.values()])
        assert PW not in recorded and TOKEN not in recorded, run.info.run_id
    for log in _output_root.glob("sweeps/*/*/*/train.log"):
        assert PW not in log.read_text()

    # the warnings of a tracker whose server went away name it masked
    tracker = MlflowTracker(uri, "bapo", run_dir=_output_root / "down", delivery_timeout_s=0)
    mlflow_server.stop()
    with caplog.at_level(logging.WARNING, logger="bapo_cli.tracking"):
        tracker.log_metrics({"reward/mean": 1.0}, step=1)
        tracker.flush()
        tracker.close()
    warned = caplog.text
    assert f"http://alice:***@{host} not reachable" in warned
    assert "not delivered to" in warned and PW not in warned


def test_failing_eval_masks_the_uri_and_keeps_the_results(_output_root: Path) -> None:
    """bapo eval scores first and tracks last: a store that is down is one masked line, and the
    scores already written stay in the run dir."""
    uri = f"http://alice:{PW}@127.0.0.1:1/"  # nothing listens on port 1
    data = BENCHMARKS / "aime24.jsonl"
    result = run_bapo(
        "eval",
        f"benchmark.path={data}",
        "eval.limit=2",
        "eval.n=1",
        "eval.max_tokens=8",
        "rollout=hf",
        "tracking=mlflow",
        f"tracking.uri={uri}",
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert PW not in result.stdout + result.stderr
    error = " ".join(result.stderr.split())
    assert "error: tracking: cannot start the MLflow run at http://alice:***@127.0.0.1:1/" in error
    assert "Traceback" not in result.stderr
    kept = list(_output_root.glob("runs/*/*/results.json"))
    assert len(kept) == 1 and "aime24" in json.loads(kept[0].read_text())

"""W&B and TensorBoard beside MLflow: each survives its own outage like MLflow does (the run goes
on, what was not delivered is listed in the run dir), a backend that cannot start stops the run
in one line, resumed TensorBoard logs skip the steps they hold, and neither library is imported
by a run that does not use it. Runs are real: W&B offline, TensorBoard event files on disk."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from mlflow.tracking import MlflowClient

from bapo_cli import tracking
from bapo_cli.tracking.fanout import FanoutTracker
from bapo_cli.tracking.tensorboard_tracker import TensorBoardTracker
from bapo_cli.tracking.wandb_tracker import WandbTracker
from tests.tracking.readback import tb_scalars, wandb_history, wandb_records


def settings(*backends: str, uri: str = "", mode: str | None = "offline", log_dir=None):
    """A `tracking` config as the trainer passes it (attribute access, like OmegaConf's)."""
    return SimpleNamespace(
        backends=list(backends),
        uri=uri,
        experiment="test",
        wandb=SimpleNamespace(project=None, entity=None, mode=mode),
        tensorboard=SimpleNamespace(log_dir=log_dir),
    )


def _metrics(step: int) -> dict[str, float]:
    return {"reward/mean": step / 10, "actor/entropy": 1.0 + step}


def _wandb_core_pids() -> list[int]:
    """The W&B service processes this test process started."""
    out = subprocess.run(["pgrep", "-P", str(os.getpid())], capture_output=True, text=True)
    pids = []
    for pid in map(int, out.stdout.split()):
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        if b"wandb-core" in cmdline:
            pids.append(pid)
    return pids


def _forget_dead_wandb_service() -> None:
    """After killing this process's W&B service: drop the SDK's import hooks (they report each
    later import to the dead service and raise there, in tests that never use W&B) and its
    process-wide setup, so later tests in this process start a fresh service."""
    from wandb.sdk import wandb_setup
    from wandb.sdk.lib import import_hooks
    from wandb.sdk.lib.service import service_token

    import_hooks.unregister_all_post_import_hooks()
    service_token.clear_service_in_env()  # else the new setup dials the dead socket again
    setup = wandb_setup._singleton
    connection = getattr(setup, "_connection", None)
    if connection is not None:
        # its exit hook would tear the dead connection down when pytest exits and print a
        # ConnectionResetError traceback under the test summary (CI's log): tear it down now,
        # quietly (the hook is unregistered first, then the send to the dead socket fails)
        with contextlib.suppress(Exception):
            connection.teardown(0)
        setup._connection = None
    wandb_setup._singleton = None


@pytest.mark.slow
def test_wandb_service_gone_mid_run_the_run_goes_on_and_the_rest_is_listed(
    tmp_path, caplog, request
) -> None:
    """The W&B service process killed after step 2: logging goes on without an error,
    TensorBoard (the other backend) still gets every step, and W&B's steps 3-5 end in
    `undelivered_metrics.wandb.jsonl`, once each, with one warning."""
    run_dir = tmp_path / "run"
    tracker = tracking.make_tracker(settings("wandb", "tensorboard"), run_dir=run_dir)
    assert isinstance(tracker, FanoutTracker)
    wandb_tracker = next(t for t in tracker.trackers if isinstance(t, WandbTracker))
    wandb_tracker.delivery_timeout_s = 0.5
    for step in (1, 2):
        tracker.log_metrics(_metrics(step), step)
    tracker.flush()
    deadline = time.monotonic() + 60  # the service writes its log on its own time
    while wandb_history(wandb_records(run_dir)) != {s: _metrics(s) for s in (1, 2)}:
        assert time.monotonic() < deadline, "W&B never wrote steps 1-2"
        time.sleep(0.5)
    pids = _wandb_core_pids()
    assert pids
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    request.addfinalizer(_forget_dead_wandb_service)
    with caplog.at_level(logging.WARNING, logger="bapo_cli.tracking"):
        for step in (3, 4, 5):
            tracker.log_metrics(_metrics(step), step)
            tracker.flush()
        tracker.close()
    undelivered = run_dir / "undelivered_metrics.wandb.jsonl"
    rows = [json.loads(line) for line in undelivered.read_text().splitlines()]
    assert [(r["step"], r["key"], r["value"]) for r in rows] == [
        (s, k, v) for s in (3, 4, 5) for k, v in _metrics(s).items()
    ]
    assert {r["run_id"] for r in rows} == {wandb_tracker.run_id}
    assert not (run_dir / tracking.UNDELIVERED_FILE).exists()  # MLflow's name: not W&B's
    down = [r for r in caplog.records if "not reachable" in r.getMessage()]
    assert len(down) == 1 and "W&B test" in down[0].getMessage()
    lost = [r for r in caplog.records if "not delivered" in r.getMessage()]
    assert len(lost) == 1 and "6 metrics of steps 3-5" in lost[0].getMessage()
    scalars = tb_scalars(run_dir / "tensorboard")
    assert [s for s, _ in scalars["reward/mean"]] == [1, 2, 3, 4, 5]
    assert wandb_history(wandb_records(run_dir)) == {s: _metrics(s) for s in (1, 2)}


DISK_FULL = textwrap.dedent(
    """
    import json, resource, signal, sys
    from pathlib import Path
    from bapo_cli.tracking.tensorboard_tracker import TensorBoardTracker

    log_dir, run_dir = Path(sys.argv[1]), Path(sys.argv[2])
    tracker = TensorBoardTracker(log_dir, run_dir=run_dir)
    metrics = lambda s: {"reward/mean": s / 10, "actor/entropy": 1.0 + s}
    for step in (1, 2):
        tracker.log_metrics(metrics(step), step)
    tracker.flush()
    # no file may grow now (writes fail with EFBIG, as on a full disk)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1, resource.RLIM_INFINITY))
    for step in (3, 4, 5):
        tracker.log_metrics(metrics(step), step)
        tracker.flush()
    failed = tracker.failed_flushes
    resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    tracker.log_metrics(metrics(6), 6)
    tracker.close()
    print(json.dumps({"failed": failed}))
    """
)


@pytest.mark.slow
def test_tensorboard_disk_full_mid_run_keeps_the_steps_and_writes_each_once(tmp_path) -> None:
    """Event files that cannot grow (RLIMIT_FSIZE: the write fails as on a full disk) while
    steps 3-5 are logged: training goes on, and once writing works again every step is in
    the event files exactly once (a new file holds the rest); nothing is left undelivered."""
    log_dir, run_dir = tmp_path / "tb", tmp_path / "run"
    out = subprocess.run(
        [sys.executable, "-c", DISK_FULL, str(log_dir), str(run_dir)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report == {"failed": 3}  # each flush while the disk was full
    scalars = tb_scalars(log_dir)
    assert [s for s, _ in scalars["reward/mean"]] == [1, 2, 3, 4, 5, 6]
    values = [v for _, v in scalars["actor/entropy"]]
    assert values == pytest.approx([1.0 + s for s in range(1, 7)])
    assert "not reachable" in out.stderr and "back after" in out.stderr
    assert not list(run_dir.glob("undelivered_metrics*"))


def test_a_resumed_tensorboard_run_does_not_log_its_steps_twice(tmp_path) -> None:
    """A resume replays the steps after the checkpoint; those already in the event files are
    not written again (as MLflow skips the steps its store holds)."""
    log_dir = tmp_path / "tb"
    first = TensorBoardTracker(log_dir)
    for step in (1, 2, 3):
        first.log_metrics(_metrics(step), step)
    first.close()
    resumed = TensorBoardTracker(log_dir)  # the checkpoint was at step 1: 2 and 3 replay
    assert resumed.logged_until == 3
    for step in (2, 3, 4):
        resumed.log_metrics(_metrics(step), step)
    resumed.close()
    assert [s for s, _ in tb_scalars(log_dir)["reward/mean"]] == [1, 2, 3, 4]


@pytest.mark.slow
def test_wandb_that_cannot_start_stops_the_run_in_one_line_and_fails_mlflow_s(
    tmp_path, monkeypatch
) -> None:
    """W&B online without an API key: `make_tracker` raises before any step, the MLflow run it
    had started is ended FAILED, and the error is one line naming W&B and how to go on."""
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:1")
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc key either
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    config = settings("mlflow", "wandb", uri=uri, mode="online")
    with pytest.raises(tracking.TrackerStartError) as err:
        tracking.make_tracker(config, run_dir=tmp_path / "run")
    message = tracking.start_failure(config, err.value, "unused")
    assert message == (
        "tracking: cannot start the W&B run (project=test mode=online): UsageError: No API key "
        "configured. Use `wandb login` to log in.; fix it, or leave it out: "
        "tracking.backends=[mlflow]"
    )
    (run,) = MlflowClient(tracking_uri=uri).search_runs(["0", "1"])
    assert run.info.status == "FAILED"


@pytest.mark.slow
def test_neither_library_is_imported_by_help_or_an_mlflow_run(tmp_path) -> None:
    """`import wandb` costs about a second: `bapo --help` and MLflow-only tracking never pay it."""
    code = textwrap.dedent(
        f"""
        import sys, time
        from types import SimpleNamespace as NS
        t0 = time.perf_counter()
        from bapo_cli import cli
        from bapo_cli.tracking import make_tracker
        cfg = NS(backends=["mlflow"], uri="sqlite:///{tmp_path}/m.db", experiment="e")
        make_tracker(cfg).close()
        heavy = sorted({{m.split(".")[0] for m in sys.modules}} & {{"wandb", "tensorboard"}})
        print(heavy)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_report_on_a_sweep_without_mlflow_says_so_in_one_line(tmp_path) -> None:
    from bapo_cli.report import ReportError, sweep_store

    def job(tracking_yaml: str) -> Path:
        sweep = tmp_path / f"sweep{len(list(tmp_path.iterdir()))}"
        (sweep / "0" / ".hydra").mkdir(parents=True)
        (sweep / "0" / ".hydra" / "config.yaml").write_text(f"tracking:\n{tracking_yaml}")
        return sweep

    sweep = job("  backends: [wandb, tensorboard]\n  uri: sqlite:///x.db\n")
    with pytest.raises(ReportError) as err:
        sweep_store(sweep)
    assert str(err.value) == (
        f"the jobs in {sweep} logged to wandb, tensorboard only "
        "(tracking.backends=[wandb,tensorboard]); bapo report reads MLflow: compare them there, "
        "or log with tracking.backends=[mlflow,...] next time"
    )
    assert sweep_store(job("  backends: [mlflow, wandb]\n  uri: sqlite:///y.db\n")) == (
        "sqlite:///y.db"
    )
    # configs saved before `backends`: one `backend`, mlflow or none
    assert sweep_store(job("  backend: mlflow\n  uri: sqlite:///z.db\n")) == "sqlite:///z.db"
    with pytest.raises(ReportError, match="ran with tracking=none"):
        sweep_store(job("  backend: none\n  uri: ''\n"))


def test_a_backend_that_is_not_installed_is_refused_before_the_run_in_one_line() -> None:
    """Without the `trackers` extra (here: `wandb` blocked in sys.modules, as if absent) the
    config check says what to install, before any model is loaded."""
    code = textwrap.dedent(
        """
        import sys
        sys.modules["wandb"] = None  # import wandb now fails, find_spec says it is not there
        from bapo_cli.config.preflight import PreflightError, preflight
        try:
            preflight("train", ["tracking.backends=[mlflow,wandb]"])
        except PreflightError as err:
            print(err)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == (
        "tracking.backends=wandb: is not installed: pip install 'bapo-cli[trackers]'"
    )


def test_the_end_of_run_lines_name_each_backend_and_no_mlflow_run_when_it_was_off(tmp_path) -> None:
    from bapo_cli.trainer.progress import where_lines

    config = settings("wandb", "tensorboard")
    others = tracking.backends.where_lines(config, "abc123", tmp_path)
    assert others == [
        "W&B: project=test mode=offline  run abc123",
        f"upload it: wandb sync {tmp_path}/wandb/offline-run-*-abc123",
        f"TensorBoard: tensorboard --logdir {tmp_path}/tensorboard",
    ]
    lines = where_lines(tmp_path, "sqlite:///x.db", "abc123", mlflow=False, others=others)
    assert lines == [f"run dir: {tmp_path}", *others]  # the W&B id is not an MLflow run
    assert where_lines(tmp_path, "", None, mlflow=False) == [
        f"run dir: {tmp_path}",
        "MLflow: off (tracking=none)",
    ]

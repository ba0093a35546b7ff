"""Study v3's held-out failure read-out: a checkpoint sampled again as the trainer validates,
every sample classed, and `bapo report --failures`' table over runs' final checkpoints."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlflow
import pytest

from bapo_cli import report
from bapo_cli.config.preflight import preflight
from bapo_cli.evaluation import failures
from bapo_cli.models.tiny import SHIPPED_ROOT
from bapo_cli.report.failures import failure_table
from bapo_cli.tracking import flatten

SHIPPED = SHIPPED_ROOT / "tiny_pairs"
# the model.tiny.* params a `model=tiny_pairs` run records (MLflow params: strings)
TINY_PAIRS_PARAMS = flatten(
    preflight("train", ["experiment=pairs"]).config.model.tiny, "model.tiny."
)


@pytest.fixture(scope="module")
def seed0_counts() -> dict[str, int]:
    return failures.sample_checkpoint(SHIPPED, seed=0)


def test_sampling_the_shipped_weights_repeats_their_recorded_held_out_accuracy(
    seed0_counts: dict[str, int],
) -> None:
    """The build record measured avg@8 per seed the way `bapo train` validates at step 0; the
    read-out samples the same way, so its 'correct' share is that number, not just near it."""
    record = json.loads((SHIPPED / "build_info.json").read_text())["heldout_avg_at_8"]
    assert sum(seed0_counts.values()) == 200 * 8
    assert failures.shares(seed0_counts)["correct"] == pytest.approx(record["per_seed"]["0"])
    # the starting model fails mostly by never stopping (the 40-token budget), as the task says
    wrong = {c: k for c, k in seed0_counts.items() if c != "correct"}
    assert max(wrong, key=wrong.get) == "no_stop"


def test_classify_counts_every_sample_once() -> None:
    counts = failures.classify(["6+8=14!", "1+6=7!", "1+6=7<"], ["6,8", "6,8", "6,8"])
    expected = {**dict.fromkeys(failures.CLASSES, 0), "correct": 1, "false_stop": 1, "no_stop": 1}
    assert counts == expected
    assert sum(failures.shares(counts).values()) == pytest.approx(1.0)


def _run_dir(tmp_path: Path, name: str, step: int, complete: bool = True) -> Path:
    run_dir = tmp_path / name
    ckpt = run_dir / "checkpoints" / f"step_{step:06d}"
    shutil.copytree(SHIPPED, ckpt)
    if complete:
        (ckpt / "COMPLETE").write_text("1")
    return run_dir


def test_start_weights_are_the_build_of_the_recorded_settings() -> None:
    """The shipped build only for exactly its settings; other settings name a build of their
    own (this machine's cache, None when it is not built), never the preset's shipped one."""
    assert failures.start_weights({"model.path": "tiny", **TINY_PAIRS_PARAMS}) == SHIPPED
    other = {**TINY_PAIRS_PARAMS, "model.tiny.sft_steps": "1601"}
    assert (
        failures.start_weights({"model.path": "tiny", "model.name": "tiny_pairs", **other}) is None
    )
    assert failures.start_weights({"model.path": "tiny"}) is None  # settings not recorded


def test_final_checkpoint_is_the_last_complete_one(tmp_path: Path) -> None:
    run_dir = _run_dir(tmp_path, "r", 48)
    (run_dir / "checkpoints" / "step_000050").mkdir()  # crashed while writing: no COMPLETE
    assert failures.final_checkpoint(run_dir) == run_dir / "checkpoints" / "step_000048"
    assert failures.final_checkpoint(tmp_path / "nothing") is None


def test_report_table_compares_final_with_start_and_caches(
    tmp_path: Path, seed0_counts: dict[str, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run whose 'final' checkpoint is the shipped model itself shifts no class; the cache
    keeps every sampled checkpoint, so a second report samples nothing."""
    params = {
        "data.kind": "pairs",
        "model.path": "tiny",
        "model.name": "tiny_pairs",
        "trainer.seed": "0",
        "trainer.val_n": "8",
        "model.max_model_len": "96",
        **TINY_PAIRS_PARAMS,
    }
    runs = [
        report.RunData(
            "a",
            "a",
            "FINISHED",
            ["algo=grpo"],
            {},
            params,
            run_dir=str(_run_dir(tmp_path, "a", 48)),
        ),
        report.RunData("b", "b", "FINISHED", ["algo=grpo"], {}, params, run_dir=None),
    ]
    for r in runs:
        r.group = "grpo"
    cache = tmp_path / "report" / "failures_cache.json"
    header, rows = failure_table(runs, cache)
    assert rows[0][:2] == ["grpo", "1/2"]  # run b has no run dir: left out, and counted
    cells = dict(zip(header, rows[0], strict=True))
    expected = failures.shares(seed0_counts)
    for c in failures.CLASSES:
        assert cells[f"{c} start"] == cells[f"{c} final"] == f"{expected[c]:.3f}"
    assert len(json.loads(cache.read_text())) == 1  # start and final: the same weights, one key

    def no_sampling(*args: object, **kwargs: object) -> None:
        raise AssertionError("sampled again despite the cache")

    monkeypatch.setattr(failures, "sample_checkpoint", no_sampling)
    assert failure_table(runs, cache) == (header, rows)


def test_runs_read_from_a_store_know_their_run_dir(tmp_path: Path) -> None:
    """From the `bapo.run_dir` tag, or for runs logged before it from sweep dir / job number."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = mlflow.MlflowClient(uri)
    exp = client.create_experiment("e")
    tagged = client.create_run(exp, tags={"bapo.run_dir": "/x/run"})
    swept = client.create_run(exp, tags={"bapo.sweep_dir": "/x/sweep", "bapo.job_num": "3"})
    for run in (tagged, swept):
        client.log_metric(run.info.run_id, "reward/mean", 0.5, step=1)
        client.set_terminated(run.info.run_id)
    runs = {r.run_id: r for r in report.load_runs(uri, experiment="e")}
    assert runs[tagged.info.run_id].run_dir == "/x/run"
    assert runs[swept.info.run_id].run_dir == str(Path("/x/sweep") / "3")

"""The run-dir check sees the dir Hydra will write to, however it is spelled (issue 33 item 3),
and `bapo eval` keeps out of other runs' dirs (item 4): launch/rundir.py `settle`, pre-flight's
`Dirs` (config/preflight.py).

All of these are refused at pre-flight, before any model loads: no training runs here (the
smallest step and evaluation are asked for all the same, so that the old code, which let them
run, fails these tests quickly too)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from bapo_cli.cli import app
from bapo_cli.config.preflight import PreflightError, distinct_job_dirs
from bapo_cli.launch import launcher

SAMPLES = '{"step": 1}\n'
TINY = ("tracking=none", "trainer.max_steps=1")
EVAL = ("tracking=none", "eval.limit=1", "eval.n=1")


def _used(path: Path) -> Path:
    """A dir a training run left: Hydra's record, a checkpoint, samples."""
    (path / ".hydra").mkdir(parents=True)
    (path / ".hydra" / "config.yaml").write_text("trainer: {}\n")
    (path / "checkpoints" / "step_000001").mkdir(parents=True)
    (path / "samples.jsonl").write_text(SAMPLES)
    return path


def _invoke(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, list(args))
    return result.exit_code, " ".join(result.output.split())


def _untouched(used: Path) -> None:
    assert (used / "samples.jsonl").read_text() == SAMPLES
    assert (used / ".hydra" / "config.yaml").read_text() == "trainer: {}\n"
    assert sorted(p.name for p in used.iterdir()) == [".hydra", "checkpoints", "samples.jsonl"]


@pytest.mark.parametrize(
    "spelling",
    [
        "{tmp}/x/../shared",
        "{tmp}/./shared/",
        "${{paths.output_root}}/../shared",
        "${{oc.env:PWD}}/shared",
        "${{oc.env:PWD}}/link",
    ],
)
def test_every_spelling_of_a_used_dir_is_refused(
    spelling: str, tmp_path: Path, _output_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    used = _used(tmp_path / "shared")  # `x` does not exist: Hydra's mkdir -p would create it
    (tmp_path / "link").symlink_to(used)
    monkeypatch.setenv("BAPO_OUTPUT_ROOT", str(tmp_path / "outputs"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PWD", str(tmp_path))
    typed = spelling.format(tmp=tmp_path)
    code, out = _invoke("train", *TINY, f"hydra.run.dir={typed}")
    assert code == 2, out
    assert out == (
        f"error: hydra.run.dir={typed} (that is {used}) already holds a run (.hydra, "
        "checkpoints, samples.jsonl); add trainer.resume=true to continue it, or choose a new "
        "hydra.run.dir (or drop it: each run gets a fresh dir)"
    )
    _untouched(used)


def test_hydra_is_handed_the_real_path_that_was_checked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A resume or a new named dir: Hydra writes exactly where the check looked, `${now:...}`
    included (resolved once, at pre-flight)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "x").mkdir()
    checked = launcher.check("train", ["tracking=none", f"hydra.run.dir={tmp_path}/x/../new"])
    launcher.claim_output_dir(checked, multirun=False)
    assert f"hydra.run.dir={tmp_path / 'new'}" in checked.overrides
    assert (tmp_path / "new").is_dir() and oct((tmp_path / "new").stat().st_mode)[-3:] == "700"
    checked = launcher.check("train", ["tracking=none", "hydra.run.dir=${now:%Y}/../r"])
    launcher.claim_output_dir(checked, multirun=False)
    assert f"hydra.run.dir={tmp_path / 'r'}" in checked.overrides


@pytest.mark.parametrize(
    ("subdir", "sweep", "share"),
    [
        ("same", "algo.rho0=0.3,0.4", "same"),
        ("/abs/one", "algo.rho0=0.3,0.4", None),  # an absolute subdir replaces the sweep dir
        ("${{hydra.job.override_dirname}}", "algo.rho0=0.3,0.3", "algo.rho0=0.3,"),
        ("x/${{hydra.job.name}}", "staleness=0,4", "x/train"),
    ],
)
def test_two_jobs_of_a_sweep_never_share_a_dir(
    subdir: str, sweep: str, share: str | None, _output_root: Path
) -> None:
    typed = subdir.format()
    code, out = _invoke("train", "-m", *TINY, sweep, f"hydra.sweep.subdir={typed}")
    assert code == 2, out
    assert out.startswith(f"error: hydra.sweep.subdir={typed}: jobs 0 and 1 would share one dir (")
    if share is None:
        assert "(/abs/one)" in out
    else:
        assert f"/{share}" in out
    assert not (_output_root / "sweeps").exists()  # refused before any dir was made


def test_job_dirs_may_not_nest_and_the_default_subdir_passes(tmp_path: Path) -> None:
    with pytest.raises(PreflightError, match=r"job 1's dir \(.*/a/b\) lies inside job 0's"):
        distinct_job_dirs(str(tmp_path), ["a", "a/b"], "x")
    with pytest.raises(PreflightError, match="jobs 0 and 2 would share one dir"):
        distinct_job_dirs(str(tmp_path), ["a", "b", "./a/"], "x")
    distinct_job_dirs(str(tmp_path), ["0", "1", "10"], "${hydra.job.num}")
    checked = launcher.check("train", ["tracking=none", "algo.rho0=0.3,0.4,0.5"], multirun=True)
    assert checked.dirs.subdirs == ["0", "1", "2"]


def test_a_sweep_job_dir_that_holds_a_run_is_refused(tmp_path: Path) -> None:
    used = _used(tmp_path / "used")
    code, out = _invoke(
        "train",
        "-m",
        *TINY,
        "algo.rho0=0.3",
        f"hydra.sweep.dir={tmp_path}/sweep",
        "hydra.sweep.subdir=../used",
    )
    assert code == 2, out
    assert out.startswith(
        f"error: job 0: hydra.sweep.subdir=../used (that is {used}) already holds a run"
    )
    _untouched(used)


# ------------------------------------------------------------------------- bapo eval (item 4)


def test_eval_keeps_out_of_a_training_runs_dir(tmp_path: Path) -> None:
    used = _used(tmp_path / "run")
    code, out = _invoke("eval", *EVAL, f"hydra.run.dir={used}")
    assert code == 2, out
    assert out == (
        f"error: hydra.run.dir={used} already holds a run or a checkpoint (.hydra, "
        "checkpoints, samples.jsonl); bapo eval writes there only with --allow-existing-dir "
        "(results.json, samples.jsonl and eval.log beside what is there), or choose a new "
        "hydra.run.dir (or drop it: each run gets a fresh dir)"
    )
    _untouched(used)
    # the switch never lets it replace a training run's samples
    code, out = _invoke("eval", "--allow-existing-dir", *EVAL, f"hydra.run.dir={used}")
    assert code == 2, out
    assert out == (
        f"error: hydra.run.dir={used} holds a training run's samples.jsonl, which bapo eval "
        "would replace (even with --allow-existing-dir); choose a new hydra.run.dir (or drop "
        "it: each run gets a fresh dir)"
    )
    _untouched(used)


def test_eval_keeps_out_of_a_checkpoint_unless_told(tmp_path: Path) -> None:
    ckpt = tmp_path / "step_000010"
    ckpt.mkdir()
    for name in ("config.json", "model.safetensors", "trainer_state.pt", "COMPLETE"):
        (ckpt / name).write_text(name)
    code, out = _invoke("eval", *EVAL, f"hydra.run.dir={ckpt}/")
    assert code == 2, out
    assert out.startswith(
        f"error: hydra.run.dir={ckpt}/ (that is {ckpt}) already holds a run or a checkpoint "
        "(COMPLETE, trainer_state.pt, config.json, model.safetensors); bapo eval writes there "
        "only with --allow-existing-dir"
    )
    assert sorted(p.name for p in ckpt.iterdir()) == [
        "COMPLETE",
        "config.json",
        "model.safetensors",
        "trainer_state.pt",
    ]
    checked = launcher.check("eval", ["tracking=none", f"hydra.run.dir={ckpt}"])
    launcher.claim_output_dir(checked, multirun=False, allow_existing=True)
    assert f"hydra.run.dir={ckpt}" in checked.overrides
    assert not any(o.startswith("hydra.output_subdir=") for o in checked.overrides)


def test_eval_told_to_writes_its_record_beside_another_runs(tmp_path: Path) -> None:
    """An earlier evaluation's dir: --allow-existing-dir replaces its results, but Hydra's
    record of this one goes to `.hydra-eval` (then `-1`, ...), never into the other `.hydra`."""
    earlier = tmp_path / "eval"
    (earlier / ".hydra").mkdir(parents=True)
    (earlier / "results.json").write_text("{}")
    (earlier / "samples.jsonl").write_text(SAMPLES)
    code, out = _invoke("eval", *EVAL, f"hydra.run.dir={earlier}")
    assert code == 2 and "(.hydra, samples.jsonl, results.json)" in out, out
    overrides = ["tracking=none", f"hydra.run.dir={earlier}", "hydra.output_subdir=.hydra"]
    checked = launcher.check("eval", overrides)
    launcher.claim_output_dir(checked, multirun=False, allow_existing=True)
    records = [o for o in checked.overrides if o.startswith("hydra.output_subdir=")]
    assert records == ["hydra.output_subdir=.hydra-eval"]
    (earlier / ".hydra-eval").mkdir()
    checked = launcher.check("eval", ["tracking=none", f"hydra.run.dir={earlier}"])
    launcher.claim_output_dir(checked, multirun=False, allow_existing=True)
    assert checked.overrides[-1] == "hydra.output_subdir=.hydra-eval-1"


def test_a_dir_that_cannot_be_resolved_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("BAPO_NO_SUCH_VAR", raising=False)
    code, out = _invoke("train", *TINY, "hydra.run.dir=${oc.env:BAPO_NO_SUCH_VAR}/r")
    assert code == 2, out
    assert out == (
        "error: hydra.run.dir: cannot resolve it (KeyError raised while resolving "
        "interpolation: \"Environment variable 'BAPO_NO_SUCH_VAR' not found\")"
    )


@pytest.mark.slow
def test_eval_told_to_leaves_the_other_record_as_it_was(tmp_path: Path) -> None:
    """The real command: an evaluation into an earlier one's dir with --allow-existing-dir
    replaces its results, and Hydra's record of it lands in `.hydra-eval`, owner-only."""
    from tests.conftest import run_bapo

    earlier = tmp_path / "eval"
    (earlier / ".hydra").mkdir(parents=True)
    (earlier / ".hydra" / "config.yaml").write_text("earlier: true\n")
    (earlier / "results.json").write_text("{}")
    result = run_bapo("eval", "--allow-existing-dir", *EVAL, f"hydra.run.dir={earlier}")
    assert result.returncode == 0, result.stderr
    assert (earlier / ".hydra" / "config.yaml").read_text() == "earlier: true\n"
    assert sorted(p.name for p in (earlier / ".hydra").iterdir()) == ["config.yaml"]
    record = earlier / ".hydra-eval" / "config.yaml"
    assert "benchmark:" in record.read_text() and oct(record.stat().st_mode)[-3:] == "600"
    assert list(json.loads((earlier / "results.json").read_text())) == ["aime24"]

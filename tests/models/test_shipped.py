"""The warmed-up tiny models ship with the package: the presets load them, no first-run build.

The numbers checked are the ones docs/training.md states, recorded by the command that made the
files (`python -m bapo_cli.launch.testbed build <name>`; `bapo_cli.models.release` when the shipped
ones were made) in each directory's build_info.json.
Tolerances: held-out greedy accuracy within 0.01 (5 of 512 answers; on the machine that made the
files it is exact, another CPU's kernels may flip an argmax or two), the step-0 held-out avg@8 of
one seed within 0.02 of the record's, its 5-seed mean within 0.005 of the documented one.
"""

from __future__ import annotations

import hashlib
import json

import pytest
import torch

from bapo_cli.config.preflight import preflight
from bapo_cli.data.pairs import PairTask
from bapo_cli.data.tasks import ArithTask
from bapo_cli.launch import testbed
from bapo_cli.models import loading, tiny

PRESETS = ("tiny", "tiny_pairs")
HELD_OUT = {"tiny": ArithTask, "tiny_pairs": PairTask}
TASK = {"tiny": "arith", "tiny_pairs": "pairs"}
DOCUMENTED_AVG8 = {"tiny_pairs": 0.205}  # docs/training.md: step-0 held-out avg@8, seeds 0-4


def record(name: str) -> dict:
    return json.loads((tiny.SHIPPED_ROOT / name / tiny.BUILD_INFO).read_text())


@pytest.fixture
def no_build(monkeypatch):
    monkeypatch.setattr(tiny, "warm_up", lambda *a, **k: pytest.fail("a preset must not build"))


@pytest.mark.parametrize("name", PRESETS)
def test_preset_loads_the_shipped_files_without_building(name, no_build, tmp_path, monkeypatch):
    monkeypatch.setenv("BAPO_CACHE_DIR", str(tmp_path))  # an empty cache: nothing built before
    cfg = preflight("train", [f"model={name}"]).config.model
    directory = loading.model_dir(cfg)
    assert directory == tiny.SHIPPED_ROOT / name
    assert not list(tmp_path.iterdir())  # nothing written to the cache
    info = record(name)
    assert info["key"] == tiny.build_key(cfg.tiny)
    assert info["settings"] == tiny.settings_of(cfg.tiny)
    assert info["steps"] == cfg.tiny.sft_steps and info["threads"] == 1
    python, m, module, *args = info["command"].split()
    assert (python, m, args[:2]) == ("python", "-m", ["build", name])
    # the shipped files were made before issue 30 moved the tool out of `models` (same code)
    assert module in ("bapo_cli.launch.testbed", "bapo_cli.models.release")
    assert info["environment"] == testbed.PINNED_ENV
    for file, digest in info["sha256"].items():
        assert hashlib.sha256((directory / file).read_bytes()).hexdigest() == digest, file


def test_other_settings_are_built_not_shipped() -> None:
    cfg = preflight("train", ["model=tiny_pairs", "model.tiny.sft_steps=999"]).config.model
    assert tiny.shipped_dir(cfg.tiny) is None
    assert tiny.shipped_dir(preflight("train", ["model.tiny.seed=1"]).config.model.tiny) is None


def greedy_heldout(model, tokenizer, name: str) -> float:
    """The build's own check: greedy accuracy on the task's 512 held-out problems, one thread."""
    problems = HELD_OUT[name](0).held_out(tiny.EVAL_SIZE)
    threads = torch.get_num_threads()
    torch.set_num_threads(tiny.BUILD_THREADS)
    try:
        return tiny.greedy_accuracy(model, tokenizer, problems, TASK[name])
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("name", PRESETS)
def test_shipped_model_gives_its_recorded_greedy_accuracy(name, no_build) -> None:
    model, tokenizer = loading.load_policy(preflight("train", [f"model={name}"]).config.model)
    assert greedy_heldout(model, tokenizer, name) == pytest.approx(
        record(name)["accuracy"], abs=0.01
    )


def test_tiny_generates_answers(no_build) -> None:
    from bapo_cli.rollout.base import Request, SamplingParams
    from bapo_cli.rollout.hf import HFEngine

    model, tokenizer = loading.load_policy(preflight("train", []).config.model)
    engine = HFEngine(model, tokenizer)
    problems = ArithTask(0).held_out(16)
    requests = [
        Request(tuple(tokenizer(f"{p.question}=").input_ids), max_tokens=8) for p in problems
    ]
    generations = engine.generate(requests, SamplingParams(temperature=0.0, max_tokens=8))
    texts = [tokenizer.decode(g.token_ids, skip_special_tokens=True) for g in generations]
    assert all(t.lstrip("-").isdigit() for t in texts), texts  # the warm-up taught the format


@pytest.mark.slow
def test_tiny_pairs_step0_heldout_avg8_is_the_documented_one(no_build) -> None:
    """What `bapo train experiment=pairs` logs as val/pairs/avg_at_8 before its first update."""
    info = record("tiny_pairs")["heldout_avg_at_8"]
    measured = testbed.heldout_avg(tiny.SHIPPED_ROOT / "tiny_pairs", "pairs", 96, seeds=(0,))
    assert measured["per_seed"]["0"] == pytest.approx(info["per_seed"]["0"], abs=0.02)
    assert info["mean"] == pytest.approx(DOCUMENTED_AVG8["tiny_pairs"], abs=0.005)


def test_testbed_build_writes_the_files_and_their_record(tmp_path, monkeypatch) -> None:
    """The rebuild command's own path (2 warm-up steps, the avg@8 measurement stubbed: it is
    checked above on the shipped files): files renamed into a new folder, record complete."""
    from bapo_cli.config.schema import TinyModelConfig

    small = TinyModelConfig(sft_steps=2, sft_batch_size=8)
    monkeypatch.setattr(testbed, "preset", lambda name: (small, 64))
    monkeypatch.setattr(testbed, "heldout_avg", lambda *a, **k: {"mean": 0.5})
    out = tmp_path / "new" / "tiny"
    info = testbed.build("tiny", out, ["build", "tiny", "--out", str(out)])
    written = json.loads((out / tiny.BUILD_INFO).read_text())
    assert written == json.loads(json.dumps(info))
    assert written["command"] == f"python -m bapo_cli.launch.testbed build tiny --out {out}"
    assert written["steps"] == 2 and written["heldout_avg_at_8"] == {"mean": 0.5}
    digest = hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest()
    assert written["sha256"]["model.safetensors"] == digest
    assert not (out / tiny.COMPLETE_MARKER).exists()
    assert {oct(p.stat().st_mode & 0o777) for p in out.iterdir()} == {"0o644"}
    assert oct(out.stat().st_mode & 0o777) == "0o755"
    assert sorted(p.name for p in out.parent.iterdir()) == ["tiny"]  # no temporary folder left
    assert "identical" in testbed.compare("tiny", digest, digest)
    assert "differ" in testbed.compare("tiny", digest, "0" * 64)


def test_a_rebuild_in_progress_is_not_a_shipped_build(tmp_path) -> None:
    for folder, key in (("tiny", "a" * 16), (".tiny-x1", "b" * 16)):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / tiny.BUILD_INFO).write_text(json.dumps({"key": key}))
    assert tiny.shipped_builds(tmp_path) == {"a" * 16: tmp_path / "tiny"}

"""No network: loading by hub id fails in seconds, quietly, with how to pass a local path.

Without the hub probe (bapo_cli.models.hub) huggingface_hub retried each request with back-off:
22–44 retry warnings over 25–70 s before the error. Real HF libraries throughout; the endpoint is
a closed port on this machine (connection refused), or HF_HUB_OFFLINE=1.
"""

from __future__ import annotations

import socket
import time
from types import SimpleNamespace

import datasets
import huggingface_hub
import pytest

from bapo_cli.data.records import DataError
from bapo_cli.evaluation.evaluate import load_problems
from bapo_cli.models import hub, loading
from tests.conftest import run_bapo

HUB_MODEL = "Qwen/Qwen2.5-Math-1.5B"  # the model preset's hub id; not in this machine's HF cache


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again on leaving: nothing listens there


@pytest.fixture
def unreachable_hub(monkeypatch: pytest.MonkeyPatch) -> str:
    """HF_ENDPOINT at a closed port, for this process's HF libraries too (they read it at import);
    every flag the probe may flip is restored afterwards."""
    url = f"http://127.0.0.1:{_closed_port()}"
    monkeypatch.setenv("HF_ENDPOINT", url)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")  # restored (removed) after the test
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", url)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_ENDPOINT", url)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", False)
    monkeypatch.setattr(hub, "_checked", {})
    return url


def test_model_by_hub_id_fails_in_seconds_when_the_hub_refuses(unreachable_hub: str) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401 - imported untimed

    cfg = SimpleNamespace(path=HUB_MODEL, device="cpu", dtype="float32")
    started = time.monotonic()
    with pytest.raises(loading.ModelLoadError) as err:
        loading.load_policy(cfg)
    assert time.monotonic() - started < 10  # 57 s of retries before
    line = str(err.value)
    assert "\n" not in line
    assert f"cannot connect to {unreachable_hub}: Connection refused" in line
    assert "pass a local directory: model.path=/path/to/model" in line


def test_benchmark_by_hub_id_fails_in_seconds_when_the_hub_refuses(unreachable_hub: str) -> None:
    bench = SimpleNamespace(
        name="aime24",
        path=None,  # by hub id
        hf_id="HuggingFaceH4/aime_2024",
        split="train",
        hf_config=None,
        id_field="id",
        problem_field="problem",
        answer_field="answer",
    )
    started = time.monotonic()
    with pytest.raises(DataError) as err:
        load_problems(bench)
    assert time.monotonic() - started < 10  # 25 s of retries before
    line = str(err.value)
    assert "\n" not in line
    assert f"cannot connect to {unreachable_hub}" in line
    assert "pass a local file: benchmark.path=/path/to/aime24.jsonl" in line
    assert "(or the copy that ships: benchmark.path=shipped:aime24)" in line


@pytest.mark.slow
def test_hf_hub_offline_gives_one_line_naming_the_local_path_option() -> None:
    result = run_bapo(
        "train", "model=qwen2.5-math-1.5b", "tracking=none", env={"HF_HUB_OFFLINE": "1"}
    )
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"error: model.path={HUB_MODEL}: ")
    assert "(HF_HUB_OFFLINE=1)" in line and "model.path=/path/to/model" in line
    assert "Retrying" not in result.stdout + result.stderr

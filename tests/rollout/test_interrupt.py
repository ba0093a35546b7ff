"""Interruptible generation on the transformers engine (`staleness.interrupt`, the async worker).

An interrupted round stops every unfinished response where it is (finish reason `budget`); the
next round continues it from the prompt plus its partial response. With the same weights and
greedy decoding, stopping and continuing must change nothing; with new weights between rounds,
every token must carry the version (and the behaviour log-prob) of the round that sampled it.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from bapo_cli.rollout.base import FINISH_BUDGET, Request, Sample, SamplingParams
from bapo_cli.rollout.collect import Collector
from bapo_cli.rollout.hf import HFEngine
from tests.rollout.conftest import perturb_embedding, prompt_ids, score_with

QUESTIONS = [f"{a}+{b}=" for a, b in [(3, 4), (12, 9), (7, 7), (20, 31), (5, 0), (9, 18)]]


def _collector(model, tokenizer, params: SamplingParams) -> Collector:
    return Collector(
        engine=HFEngine(model, tokenizer),
        tokenizer=tokenizer,
        params=params,
        n=2,
        encode=lambda q: prompt_ids(tokenizer, q),
        reward=None,
        score=score_with(model, tokenizer, params.temperature or 1.0),
    )


def _unscored(s: Sample) -> Sample:
    """The same tokens without behaviour log-probs, to score again."""
    return Sample(s.prompt_ids, s.group, None, list(s.response_ids), versions=list(s.versions))


def _every(count: int):
    """An `interrupt` that says yes at every `count`-th token of a round."""
    calls = itertools.count(1)
    return lambda: next(calls) % count == 0


def test_interrupt_stops_every_unfinished_row_after_that_token(policy) -> None:
    model, tokenizer = policy
    engine = HFEngine(model, tokenizer)
    params = SamplingParams(temperature=0.0, max_tokens=12)
    requests = [Request(prompt_ids(tokenizer, q), max_tokens=12) for q in QUESTIONS]
    gens = engine.generate(requests, params, interrupt=_every(2))
    for gen in gens:
        assert 1 <= len(gen.token_ids) <= 2
        if gen.finish_reason == FINISH_BUDGET:  # stopped by the interrupt, not by its end token
            assert len(gen.token_ids) == 2


def test_greedy_rounds_cut_by_interrupts_continue_into_the_uninterrupted_responses(policy) -> None:
    model, tokenizer = policy
    params = SamplingParams(temperature=0.0, max_tokens=12)
    whole = _collector(model, tokenizer, params)
    expected = whole.start(QUESTIONS)
    whole.advance(expected)
    assert all(s.done for s in expected)

    cut = _collector(model, tokenizer, params)
    samples = cut.start(QUESTIONS)
    rounds = 0
    while not all(s.done for s in samples):
        cut.advance(samples, interrupt=_every(1))
        rounds += 1
    assert rounds > 1  # some response was cut and continued
    for got, want in zip(samples, expected, strict=True):
        assert got.response_ids == want.response_ids
        assert got.finish_reason == want.finish_reason
        # scored in pieces (each round scores only its new tokens) or whole: the same log-probs,
        # up to float32 summation order (the pieces are scored in batches of other widths)
        assert got.logprobs == pytest.approx(want.logprobs, abs=1e-4)


def test_tokens_after_a_weight_change_carry_the_new_version_and_its_logprobs(policy) -> None:
    model, tokenizer = policy
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        params = SamplingParams(temperature=1.0, max_tokens=12, seed=0)
        collector = _collector(model, tokenizer, params)
        torch.manual_seed(0)
        samples = collector.start(QUESTIONS)
        states = {0: {k: v.clone() for k, v in model.state_dict().items()}}
        while not all(s.done for s in samples):
            collector.advance(samples, interrupt=_every(2))
            version = collector.engine.version + 1  # "the trainer published new weights"
            perturb_embedding(model, scale=0.02, seed=version)
            states[version] = {k: v.clone() for k, v in model.state_dict().items()}
            collector.engine.sync_weights(model, version)
        spanning = [s for s in samples if len(set(s.versions)) > 1]
        assert spanning
        for s in samples:
            assert len(s.versions) == len(s.logprobs) == len(s.response_ids)
            # two tokens per round: round r's tokens carry version r
            assert s.versions == [i // 2 for i in range(len(s.response_ids))]
        # each token's behaviour log-prob is that of the weights of its own version
        for version, state in states.items():
            model.load_state_dict(state)
            rescored = [_unscored(s) for s in samples]
            score_with(model, tokenizer, 1.0)(rescored)
            for s, r in zip(samples, rescored, strict=True):
                for i, v in enumerate(s.versions):
                    if v == version:
                        assert s.logprobs[i] == pytest.approx(r.logprobs[i], abs=1e-4)
        # and the versions differ enough that this is a real check: somewhere a later-version
        # token's log-prob under the first weights is off by more than the tolerance above
        # (a near-certain token barely moves, so the largest gap is taken, not one token's)
        model.load_state_dict(states[0])
        stale = [_unscored(s) for s in spanning]
        score_with(model, tokenizer, 1.0)(stale)
        gaps = [
            abs(old.logprobs[i] - s.logprobs[i])
            for s, old in zip(spanning, stale, strict=True)
            for i, v in enumerate(s.versions)
            if v > 0
        ]
        assert max(gaps) > 1e-2
    finally:
        model.load_state_dict(saved)


@pytest.mark.vllm
def test_vllm_refuses_an_interrupt() -> None:
    pytest.importorskip("vllm")
    from bapo_cli.rollout.vllm import VLLMEngine

    with pytest.raises(ValueError, match="needs the transformers engine"):
        VLLMEngine.generate(object(), [], SamplingParams(), interrupt=lambda: False)

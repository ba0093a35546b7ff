"""Truncated importance-sampling weights and the Collector's mismatch metric, by hand."""

from __future__ import annotations

import math

import torch

from bapo_cli.rollout.base import FINISH_STOP, Generation, Request, Sample, SamplingParams
from bapo_cli.rollout.collect import Collector
from bapo_cli.rollout.scoring import collate
from bapo_cli.trainer.off_policy import tis_weights


def sample(trainer: list[float], engine: list[float]) -> Sample:
    n = len(trainer)
    return Sample(
        prompt_ids=[1, 5],
        group=0,
        problem=None,
        response_ids=list(range(10, 10 + n)),
        logprobs=trainer,
        engine_logprobs=engine,
        versions=[0] * n,
    )


def test_tis_weight_is_the_truncated_trainer_to_engine_ratio() -> None:
    a = sample([-1.0, -2.0, -0.5], [-1.0, -3.0, -0.25])  # ratios 1, e, e^-0.25
    b = sample([-0.1], [-0.1])
    mb = collate([a, b], pad_id=0, device=torch.device("cpu"))
    w = tis_weights(mb, cap=2.0)
    assert w.shape == mb.mask.shape == (2, 3)
    expected = torch.tensor([[1.0, 2.0, math.exp(-0.25)], [1.0, 1.0, 1.0]])  # e capped at 2
    torch.testing.assert_close(w, expected)
    assert not w.requires_grad


def test_sequence_level_and_masked_weights() -> None:
    a = sample([-1.0, -2.0, -0.5], [-1.0, -3.0, -0.25])  # token ratios 1, e, e^-0.25
    b = sample([-0.1, -0.2], [-0.3, -0.2])  # e^0.2, 1
    mb = collate([a, b], pad_id=0, device=torch.device("cpu"))
    seq_a, seq_b = math.exp(0.75), math.exp(0.2)  # products of each sequence's ratios
    # sequence-level TIS: one weight per sequence, truncated at the cap; padding weighs 1
    w = tis_weights(mb, cap=3.0, level="sequence")
    torch.testing.assert_close(w, torch.tensor([[seq_a, seq_a, seq_a], [seq_b, seq_b, 1.0]]))
    w = tis_weights(mb, cap=1.5, level="sequence")
    torch.testing.assert_close(w, torch.tensor([[1.5, 1.5, 1.5], [seq_b, seq_b, 1.0]]))
    # MIS: over the cap means weight 0, per token or for the whole sequence
    w = tis_weights(mb, cap=2.0, mode="mask")
    expected = torch.tensor([[1.0, 0.0, math.exp(-0.25)], [seq_b, 1.0, 1.0]])
    torch.testing.assert_close(w, expected)
    w = tis_weights(mb, cap=3.0, level="sequence", mode="mask")
    torch.testing.assert_close(w, torch.tensor([[seq_a, seq_a, seq_a], [seq_b, seq_b, 1.0]]))
    w = tis_weights(mb, cap=1.5, level="sequence", mode="mask")
    torch.testing.assert_close(w, torch.tensor([[0.0, 0.0, 0.0], [seq_b, seq_b, 1.0]]))


def test_tokens_without_engine_logprobs_weigh_one() -> None:
    mb = collate([sample([-1.0, -2.0], [])], pad_id=0, device=torch.device("cpu"))
    assert torch.equal(tis_weights(mb, cap=1.5), torch.ones(1, 2))


class _Engine:
    """Reports fixed tokens and log-probs, as vLLM would."""

    name, version = "fake", 3

    def generate(self, requests: list[Request], params: SamplingParams) -> list[Generation]:
        return [Generation([7, 8], [-0.5, -1.0], FINISH_STOP) for _ in requests]


def test_collector_scores_engine_tokens_with_the_trainer_and_reports_the_gap() -> None:
    def score(samples: list[Sample]) -> None:  # the trainer: 0.1 and 0.3 away from the engine
        for s in samples:
            s.logprobs.extend([-0.4, -1.3][len(s.logprobs) :])

    collector = Collector(
        engine=_Engine(),
        tokenizer=type("T", (), {"decode": staticmethod(lambda ids, **_: "x")})(),
        params=SamplingParams(max_tokens=4),
        n=2,
        encode=lambda p: [1, 2],
        reward=lambda text, p: 1.0,
        score=score,
    )
    samples = collector.complete(["p"])
    for s in samples:
        assert s.logprobs == [-0.4, -1.3] and s.engine_logprobs == [-0.5, -1.0]
        assert s.versions == [3, 3]
    gap = collector.take_mismatch()
    assert math.isclose(gap["rollout/logprob_abs_diff_mean"], 0.2)
    assert math.isclose(gap["rollout/logprob_abs_diff_max"], 0.3)
    assert collector.take_mismatch() == {}  # counted afresh after each take

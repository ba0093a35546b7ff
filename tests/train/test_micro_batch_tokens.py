"""Micro-batches by token budget (trainer.micro_batch_tokens): the split packs well and changes
nothing but summation order.

An optimizer update over a mini-batch must not depend on how its samples are split into
micro-batches: the loss is normalised by the mini-batch's token count, BAPO's per-update search
(bound_scope=minibatch) sums over all micro-batches, the KL term is a sum over tokens, and every
logged metric is combined token-weighted. The oracle is the same update on one micro-batch holding
the whole mini-batch. (bound_scope=microbatch searches each micro-batch on its own: that one is
split-dependent by definition, and named as the approximation it is.)
"""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bapo_cli.algos.advantages import REGISTRY as ADVANTAGES
from bapo_cli.rollout.base import Sample
from bapo_cli.rollout.scoring import (
    ResponseLogits,
    collate,
    pack_by_tokens,
    split_micro,
    split_to_count,
    token_logprobs,
)
from bapo_cli.trainer.update import Learner, LossSpec, optimizer_update
from tests.train.test_chunked_logprobs import _qwen
from tests.train.test_distributed import SEARCH

VOCAB = 40


@settings(max_examples=200, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 300), min_size=0, max_size=60),
    budget=st.integers(1, 2000),
)
def test_packing_covers_each_sample_once_within_the_budget(lengths, budget) -> None:
    groups = pack_by_tokens(lengths, budget)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for g in groups:
        width = max(max(lengths[i] for i in g), 1)
        # within the budget, or one sample that alone is over it (it gets its own micro-batch)
        assert len(g) * width <= budget or len(g) == 1
    order = [i for g in groups for i in g]  # longest first, ties by index: deterministic
    assert order == sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    assert pack_by_tokens(lengths, budget) == groups
    # greedy packing is tight: a micro-batch closed only when the next sample did not fit
    for a in groups[:-1]:
        width = max(lengths[a[0]], 1)
        assert (len(a) + 1) * width > budget


def test_split_by_count_keeps_arrival_order() -> None:
    samples = [Sample([1] * p, 0, None, [2] * r) for p, r in [(1, 5), (2, 1), (1, 9), (3, 3)]]
    assert split_micro(samples, size=3) == [samples[:3], samples[3:]]
    by_tokens = split_micro(samples, size=3, tokens=12)  # lengths 6, 3, 10, 6
    assert by_tokens == [[samples[2]], [samples[0], samples[3]], [samples[1]]]


def _padded(micro: list[Sample]) -> int:
    return len(micro) * max(len(s.prompt_ids) + len(s.response_ids) for s in micro)


@settings(max_examples=200, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 300), min_size=1, max_size=40),
    budget=st.integers(1, 2000),
    extra=st.integers(0, 40),
)
def test_split_to_count_fills_the_agreed_count_without_growing_a_micro_batch(
    lengths, budget, extra
) -> None:
    """FSDP2's ranks agree on the largest count; a rank with fewer micro-batches splits its
    own: exactly `count` of them, every sample once and in order, none wider than before."""
    samples = [Sample([1], 0, None, [2] * (n - 1)) for n in lengths]
    micro = split_micro(samples, size=1, tokens=budget)
    count = min(len(micro) + extra, len(samples))
    out = split_to_count(micro, count)
    assert len(out) == count and all(out)
    assert [id(s) for m in out for s in m] == [id(s) for m in micro for s in m]
    assert max(map(_padded, out)) <= max(map(_padded, micro))
    assert split_to_count(micro, len(micro)) == micro  # enough already: unchanged


def test_split_to_count_halves_the_widest_first_and_needs_enough_samples() -> None:
    s = [Sample([1], 0, None, [2] * r) for r in (9, 9, 3, 3, 3, 3)]  # widths 10 and 4
    micro = [s[:2], s[2:]]  # padded 20 and 16
    assert split_to_count(micro, 3) == [[s[0]], [s[1]], s[2:]]
    assert split_to_count(micro, 4) == [[s[0]], [s[1]], s[2:4], s[4:]]  # then 16 (8 < 16)
    with pytest.raises(ValueError, match="6 samples cannot fill 7 micro-batches"):
        split_to_count(micro, 7)


def _model() -> torch.nn.Module:
    return _qwen(tied=True, vocab=VOCAB)


def _batch(lengths: list[tuple[int, int]], seed: int) -> list[Sample]:
    """Groups of 4 samples with the given (prompt, response) lengths; stale behaviour log-probs
    (ratios far from 1, so clipping and BAPO's search have work to do)."""
    g = torch.Generator().manual_seed(seed)
    model = _model()
    samples = []
    for i, (p, r) in enumerate(lengths):
        prompt = torch.randint(3, VOCAB, (p,), generator=g).tolist()
        response = torch.randint(3, VOCAB, (r,), generator=g).tolist()
        samples.append(Sample(prompt, i // 4, None, response, versions=[0] * r))
    rewards = torch.rand(len(samples), generator=g).round().double()
    adv, _ = ADVANTAGES.get("grpo")(rewards, torch.tensor([s.group for s in samples]))
    with torch.no_grad():
        mb = collate(samples, 0, torch.device("cpu"))
        logp, _ = token_logprobs(model, mb, 1.0)
    noise = 0.5 * torch.randn(logp.shape, generator=g)
    for i, s in enumerate(samples):
        s.advantage = float(adv[i])
        r = len(s.response_ids)
        s.logprobs = (logp[i, :r] + noise[i, :r]).tolist()
    return samples


SPECS = {
    "ppo": LossSpec.of("ppo", eps=0.2),
    "bapo": LossSpec.of("bapo", **SEARCH),
    "bapo+kl": LossSpec.of("bapo", **SEARCH, kl_coef=0.1),
    "ppo-seq-mean": LossSpec.of("ppo", agg="seq-mean-token-mean", eps=0.2),
}


def _update(samples: list[Sample], spec: LossSpec, tokens: int | None):
    model = _model()
    ref = ResponseLogits(copy.deepcopy(model).requires_grad_(False)) if spec.kl_coef else None
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    parts = split_micro(samples, size=len(samples), tokens=tokens)
    micro = [collate(part, 0, torch.device("cpu")) for part in parts]  # A_i from the samples
    learner = Learner(ResponseLogits(model, chunk=7), optimizer, ref_model=ref)
    result = optimizer_update(learner, spec, micro, version=1)
    return result.metrics, [p.detach().clone() for p in model.parameters()], len(micro)


@pytest.mark.parametrize("spec", list(SPECS), ids=list(SPECS))
@settings(max_examples=5, deadline=None)
@given(
    lengths=st.lists(
        st.tuples(st.integers(1, 6), st.integers(0, 40)), min_size=8, max_size=16
    ).filter(lambda ls: sum(r for _, r in ls) > 0),
    budget=st.integers(8, 200),
    seed=st.integers(0, 1000),
)
def test_the_update_and_every_metric_do_not_depend_on_the_split(
    spec, lengths, budget, seed
) -> None:
    samples = _batch(lengths, seed)
    whole, whole_params, _ = _update(samples, SPECS[spec], tokens=None)
    split, split_params, count = _update(samples, SPECS[spec], tokens=budget)
    assert count >= 1
    for a, b in zip(split_params, whole_params, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert set(split) == set(whole)
    for key, value in whole.items():
        assert split[key] == pytest.approx(value, rel=1e-4, abs=1e-5), key

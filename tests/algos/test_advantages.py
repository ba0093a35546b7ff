"""Group advantage estimators against hand formulas; zero-variance groups; bad input."""

from __future__ import annotations

import pytest
import torch

from bapo_cli.algos import advantages
from bapo_cli.algos.advantages import drgrpo, grpo, rloo

REWARDS = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.5, 0.25], dtype=torch.float64)


def per_group(fn):
    out = []
    for g in REWARDS.view(3, 3):
        out.append(fn(g))
    return torch.cat(out)


def test_registry_keys():
    assert advantages.REGISTRY.names() == ["dcpo", "drgrpo", "grpo", "rloo", "signed"]
    with pytest.raises(ValueError, match="unknown advantage estimator 'gae'; valid: dcpo"):
        advantages.REGISTRY.get("gae")


def test_grpo_matches_torch_std_and_zeroes_flat_groups():
    adv, stats = grpo(REWARDS, group_size=3)

    def want(g):
        if bool((g == g[0]).all()):
            return torch.zeros_like(g)
        return (g - g.mean()) / (g.std() + 1e-6)  # torch.std: unbiased, as verl / TRL

    torch.testing.assert_close(adv, per_group(want))
    assert stats == {
        "groups": 3,
        "zero_variance_groups": 1,
        "zero_variance_frac": pytest.approx(1 / 3),
        "singleton_groups": 0,
    }
    biased, _ = grpo(REWARDS, group_size=3, unbiased=False)
    torch.testing.assert_close(
        biased[:3], (REWARDS[:3] - REWARDS[:3].mean()) / (REWARDS[:3].std(correction=0) + 1e-6)
    )


def test_drgrpo_and_rloo_formulas():
    adv, _ = drgrpo(REWARDS, group_size=3)
    torch.testing.assert_close(adv, per_group(lambda g: g - g.mean()))
    adv, stats = rloo(REWARDS, group_size=3)
    torch.testing.assert_close(adv, per_group(lambda g: g - (g.sum() - g) / (g.numel() - 1)))
    assert stats["zero_variance_groups"] == 1
    assert bool((adv[3:6] == 0).all())


@pytest.mark.parametrize("name", advantages.REGISTRY.names())
def test_group_ids_in_any_order_equal_contiguous_groups(name):
    fn = advantages.REGISTRY[name]
    perm = torch.tensor([4, 0, 8, 2, 6, 1, 3, 7, 5])
    ids = torch.tensor([10, 10, 10, 42, 42, 42, 7, 7, 7])[perm]
    adv, stats = fn(REWARDS[perm], ids)
    want, want_stats = fn(REWARDS, group_size=3)
    torch.testing.assert_close(adv, want[perm])
    assert stats == want_stats
    assert adv.dtype == REWARDS.dtype


@pytest.mark.parametrize(
    "name", [n for n in advantages.REGISTRY.names() if advantages.REGISTRY[n].groups]
)
def test_singletons_are_zero_variance(name):
    adv, stats = advantages.REGISTRY[name](torch.tensor([1.0, 0.0, 1.0]), torch.tensor([0, 1, 1]))
    assert adv[0] == 0.0
    assert stats["singleton_groups"] == 1 and stats["zero_variance_groups"] == 1


def test_flat_group_of_inexact_floats_is_exactly_zero():
    adv, stats = grpo(torch.full((4,), 0.1), group_size=4)
    assert bool((adv == 0).all()) and stats["zero_variance_groups"] == 1


@pytest.mark.parametrize(
    "kwargs, word",
    [
        (dict(rewards=torch.ones(4)), "exactly one"),
        (dict(rewards=torch.ones(4), group_size=3), "group_size"),
        (dict(rewards=torch.ones(4), group_size=0), "group_size"),
        (dict(rewards=torch.ones(4), group_ids=torch.zeros(3)), "group_ids"),
        (dict(rewards=torch.ones(4), group_ids=torch.zeros(4), group_size=2), "exactly one"),
        (dict(rewards=torch.tensor([1.0, float("nan")]), group_size=2), "rewards"),
        (dict(rewards=torch.ones(2, 2), group_size=2), "rewards"),
        (dict(rewards=torch.ones(4, dtype=torch.long), group_size=2), "rewards"),
    ],
)
@pytest.mark.parametrize("name", advantages.REGISTRY.names())
def test_bad_input(name, kwargs, word):
    with pytest.raises(ValueError, match=word):
        advantages.REGISTRY[name](**kwargs)


def test_grpo_eps_must_be_non_negative():
    with pytest.raises(ValueError, match="eps"):
        grpo(torch.ones(2), group_size=2, eps=-1.0)

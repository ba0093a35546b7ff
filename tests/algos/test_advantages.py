"""Group advantage estimators against hand formulas; zero-variance groups; bad input."""

from __future__ import annotations

import math
from collections import defaultdict

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


# ------------------------------------------------------------------ DCPO's smooth standardisation


def dcpo_get_mean_std(old_mean, old_std, times, new_mean, new_std):
    """lime-RL/DCPO@01787b0 `get_mean_std`, restated (its np.sqrt as torch.sqrt: the same
    float64 square root, without NumPy's warning on a tensor)."""
    old_times = times - 1
    if old_times == 0:
        mean = new_mean
        std = new_std
    elif old_times > 0:
        mean = (old_mean * old_times + new_mean) / (old_times + 1)
        var = (
            old_times * (old_std**2)
            + (new_std**2)
            + old_times / (times) * (new_mean - old_mean) ** 2
        )
        var = var / times
        std = torch.sqrt(torch.as_tensor(var))
    return mean, std


def dcpo_outcome_advantage(scores, index, old_times, old_mean, old_std):
    """`compute_dcpo_outcome_advantage` (norm_adv_by_std_in_grpo=True, user_old_mean_ratio=1),
    restated on one score per response: (advantages, uid2mean, uid2std)."""
    id2score, id2mean, id2std, id2times = defaultdict(list), {}, {}, {}
    id2mean_new, id2std_new = {}, {}
    scores = scores.clone()
    bsz = scores.shape[0]
    for i in range(bsz):
        id2score[index[i]].append(scores[i])
        id2mean[index[i]] = old_mean[i]
        id2std[index[i]] = old_std[i]
        id2times[index[i]] = old_times[i]
    for idx in id2score:
        if len(id2score[idx]) > 1:
            new_mean = torch.mean(torch.tensor(id2score[idx], dtype=torch.float64))
            new_std = torch.std(torch.tensor(id2score[idx], dtype=torch.float64))
            id2mean_new[idx] = new_mean
            id2std_new[idx] = new_std
            id2mean[idx], id2std[idx] = dcpo_get_mean_std(
                id2mean[idx], id2std[idx], id2times[idx] + 1, new_mean, new_std
            )
        else:
            raise ValueError(f"no score in prompt index: {idx}")
    out = torch.zeros_like(scores)
    for i in range(bsz):
        idx = index[i]
        scoresi_new = torch.tensor(0.0, dtype=torch.float64)
        scoresi_old = torch.tensor(0.0, dtype=torch.float64)
        if id2std_new[idx] > 0:
            scoresi_new = (scores[i] - id2mean_new[idx]) / id2std_new[idx]
        if id2std[idx] > 0:
            scoresi_old = (scores[i] - id2mean[idx]) / id2std[idx]
        t = id2times[idx]
        scoresi1 = 1 / (t + 1) * scoresi_old + (1 - 1 / (t + 1)) * scoresi_new
        scoresi2 = 1 / (t + 1) * scoresi_new + (1 - 1 / (t + 1)) * scoresi_old
        out[i] = torch.where(abs(scoresi1) < abs(scoresi2), scoresi1, scoresi2)
    return out, id2mean, id2std


def test_dcpo_matches_the_authors_code_over_steps():
    """Six steps over a pool of five prompts (groups of four, some all right, some all wrong,
    each prompt drawn again and again): the advantages and the kept statistics are the
    reference's, which keeps them per prompt as its trainer does (`old_mean_std`)."""
    g = torch.Generator().manual_seed(3)
    kept: dict[int, tuple[float, float, float]] = {}  # prompt -> (times, mean, std), ours
    theirs: dict[int, tuple[int, float, float]] = {}  # the reference's old_mean_std
    later_flat = 0
    for _ in range(6):
        prompts = torch.randperm(5, generator=g)[:3].tolist()
        p_right = torch.rand(3, generator=g)
        rewards = (torch.rand(3, 4, generator=g) < p_right[:, None]).double().flatten()
        ids = torch.tensor(prompts).repeat_interleave(4)
        unseen = (0.0, 0.0, 0.0)
        prior = torch.tensor([kept.get(int(k), unseen) for k in ids], dtype=torch.float64)
        adv, _ = advantages.dcpo(rewards, ids, prior=prior)
        after = advantages.dcpo_history(rewards, ids, prior=prior)
        t, m, s = (
            [theirs.get(int(k), (0, 0.0, 0.0))[j] for k in ids] for j in range(3)
        )  # the dataset's row starts at times 0, mean 0, std 0
        want, uid2mean, uid2std = dcpo_outcome_advantage(rewards, ids.tolist(), t, m, s)
        torch.testing.assert_close(adv, want, rtol=1e-12, atol=1e-12)
        for k in set(ids.tolist()):
            theirs[k] = (theirs.get(k, (0, 0.0, 0.0))[0] + 1, float(uid2mean[k]), float(uid2std[k]))
            row = after[ids == k][0].tolist()
            assert row == pytest.approx(list(theirs[k]), rel=1e-12, abs=1e-12)
            kept[k] = tuple(row)
            flat = bool((rewards[ids == k] == rewards[ids == k][0]).all())
            later_flat += int(flat and theirs[k][0] > 1 and bool((adv[ids == k] != 0).any()))
    assert later_flat > 0  # an all-equal group still trained, from its prompt's earlier rewards


def test_dcpo_without_history_is_grpo_without_eps_and_checks_its_prior():
    adv, _ = advantages.dcpo(REWARDS, group_size=3)
    torch.testing.assert_close(adv, grpo(REWARDS, group_size=3, eps=0.0)[0])
    history = advantages.dcpo_history(REWARDS, group_size=3)
    assert history[:, 0].tolist() == [1.0] * 9  # each prompt seen once
    torch.testing.assert_close(history[:3, 1], REWARDS[:3].mean().expand(3))
    bad = [
        (torch.zeros(9, 2), "prior must be \\[N, 3\\]"),
        (torch.full((9, 3), math.nan), "finite"),
        (torch.tensor([[-1.0, 0.0, 0.0]] * 9), "steps seen >= 0"),
        (torch.tensor([[1.0, 0.5, 0.1]] * 8 + [[2.0, 0.5, 0.1]]), "one prompt, one row"),
    ]
    for prior, word in bad:
        with pytest.raises(ValueError, match=word):
            advantages.dcpo(REWARDS, group_size=3, prior=prior)


def test_signed_rewards_and_which_estimators_compare_a_group():
    adv, stats = advantages.signed(REWARDS, group_size=3)
    torch.testing.assert_close(adv, 2 * REWARDS - 1)
    assert stats["zero_variance_groups"] == 1  # reported, yet that group trains (all +1)
    groups = {n: advantages.REGISTRY[n].groups for n in advantages.REGISTRY.names()}
    assert groups == {"dcpo": True, "drgrpo": True, "grpo": True, "rloo": True, "signed": False}
    cumulative = [n for n in advantages.REGISTRY.names() if advantages.REGISTRY[n].cumulative]
    assert cumulative == ["dcpo"]

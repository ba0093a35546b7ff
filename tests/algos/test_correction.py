"""Off-policy sequence and token masks (`algos.correction`, `rollout.seq_mask`) against their
references restated here: verl's geometric rejection (`compute_rollout_rejection_mask(rollout_rs=
"geometric")`), TRL's `get_off_policy_mask` (DeepSeek-V3.2's OPSM), IcePop's ratio band (AReaL's
IcePop-style filter, `_apply_importance_ratio_token_filter`) and AReaL's KPop (the Bernoulli KL
of the token's probability both ways, written out in plain Python), on ragged batches with an
empty row; and the config's one-line errors."""

from __future__ import annotations

import math

import pytest
import torch

from bapo_cli.algos import correction
from bapo_cli.config import schema
from bapo_cli.config.errors import ConfigError
from tests.algos.test_rivals import rival_batch


def verl_geometric_keep(log_ratio, response_mask, upper, lower=None):
    """verl's geometric rejection, restated: 1 = kept, per sequence."""
    lower = lower if lower is not None else 1.0 / upper
    mean = (log_ratio * response_mask).sum(-1) / response_mask.sum(-1)
    weights = torch.exp(torch.clamp(mean, min=-20.0, max=20.0))
    return (weights >= lower) & (weights <= upper)


def trl_off_policy_mask(advantages, per_token_logps, sampling_per_token_logps, mask, threshold):
    """TRL's get_off_policy_mask (DeepSeek-V3.2's OPSM), restated: 1 = kept, [B, 1]."""
    kl_div = sampling_per_token_logps - per_token_logps.detach()
    seq_kl = (kl_div * mask).sum(dim=1, keepdim=True) / mask.sum(dim=1, keepdim=True).clamp(min=1.0)
    return ((advantages >= 0) | (seq_kl <= threshold)).to(mask.dtype)


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("t", [1.05, 1.3])
def test_geo_keeps_what_verl_keeps(seed, t):
    log_prob, old, _, mask = rival_batch(seed, stale=0.3)
    log_ratio = torch.where(mask, old - log_prob, 0.0)  # pi_trainer / pi_engine per token
    keep = correction.geo_keep(log_ratio, mask, t)
    rows = mask.any(-1)  # verl divides by the row's tokens: an empty row is NaN there
    want = verl_geometric_keep(log_ratio[rows], mask[rows].double(), t)
    assert torch.equal(keep[rows], want)
    assert bool(keep[~rows].all())  # an empty row: mean 0, ratio 1, kept


def test_geo_is_two_sided():
    mask = torch.ones(3, 2, dtype=torch.bool)
    log_ratio = torch.tensor([[0.1, 0.3], [-0.1, -0.3], [0.05, -0.05]]).double()
    assert correction.geo_keep(log_ratio, mask, 1.2).tolist() == [False, False, True]
    assert correction.geo_keep(log_ratio, mask, 1.25).tolist() == [True, True, True]


@pytest.mark.parametrize("kind", ["mixed", "all_positive", "all_negative"])
@pytest.mark.parametrize("seed", range(4))
def test_opsm_keeps_what_trl_keeps(seed, kind):
    log_prob, old, adv, mask = rival_batch(seed, kind, stale=0.5)
    keep = correction.opsm_keep(torch.where(mask, old - log_prob, 0.0), adv, mask, 0.1)
    want = trl_off_policy_mask(adv[:, None], log_prob, old, mask.double(), 0.1)[:, 0].bool()
    assert torch.equal(keep, want)
    if kind == "all_positive":
        assert bool(keep.all())  # only negative sequences are ever dropped
    if kind == "all_negative":
        assert not bool(keep.all())


def masked_tis_case(seed):
    """A stale batch whose per-sequence advantages went through masked TIS
    (`rollout.tis_mode=mask`): per-token weights, 0 where a token's weight is over the cap."""
    log_prob, old, adv, mask = rival_batch(seed, stale=0.5)
    g = torch.Generator().manual_seed(1000 + seed)
    weight = torch.exp(torch.randn(mask.shape, generator=g, dtype=adv.dtype) * 0.6)
    weight = torch.where(weight <= 1.5, weight, 0.0)  # MIS: over the cap -> 0
    weight = torch.where(mask, weight, 1.0)
    return log_prob, old, adv, mask, adv[:, None] * weight


def test_opsm_after_masked_tis_is_trls_rule_per_token():
    """Issue 34, fix 1: with per-token (TIS-weighted) advantages, the sign comes per token (TRL's
    get_off_policy_mask on per-token advantages), which is the sequence's sign before weighting
    on every token with a weight. The old rule read the first valid token's weighted advantage:
    when that token's weight was 0 a negative far-off-policy sequence escaped."""
    escaped = 0
    for seed in range(200):
        log_prob, old, adv, mask, weighted = masked_tis_case(seed)
        log_ratio = torch.where(mask, old - log_prob, 0.0)
        got, keep = correction.mask_sequences("opsm", 0.1, weighted, mask, log_ratio)
        trl = trl_off_policy_mask(weighted, log_prob, old, mask.double(), 0.1).bool()
        assert torch.equal(got, torch.where(trl, weighted, 0.0)), seed
        # the same as deciding from the advantage before weighting
        before = trl_off_policy_mask(adv[:, None], log_prob, old, mask.double(), 0.1).bool()
        assert torch.equal(got, torch.where(before, weighted, 0.0)), seed
        # a sequence counts as masked when the rule dropped a token of it (one whose masked TIS
        # weights are all 0 had nothing left to drop)
        assert torch.equal(keep, ~(~trl & mask).any(-1)), seed
        # how many cases the first-valid-token rule got wrong (the cases this test is about)
        first = mask.to(torch.int64).argmax(-1)
        first_adv = weighted.gather(-1, first[:, None])[:, 0]
        old_rule = ~((first_adv < 0) & (log_ratio.sum(-1) / mask.sum(-1).clamp(min=1) > 0.1))
        escaped += int((old_rule & ~before[:, 0] & mask.any(-1)).sum())
    assert escaped > 0  # the random cases include sequences the old rule let through


def test_mask_sequences_zeroes_whole_sequences_in_either_advantage_shape():
    log_prob, old, adv, mask = rival_batch(3, "all_negative", stale=0.5)
    log_ratio = torch.where(mask, old - log_prob, 0.0)
    per_seq, keep = correction.mask_sequences("opsm", 0.1, adv, mask, log_ratio)
    per_tok, keep2 = correction.mask_sequences(
        "opsm", 0.1, adv[:, None].expand_as(mask) * 2.0, mask, log_ratio
    )
    assert torch.equal(keep, keep2) and not bool(keep.all()) and bool(keep.any())
    assert torch.equal(per_seq, torch.where(keep, adv, 0.0))
    want = torch.where(keep[:, None], adv[:, None] * 2.0, 0.0).expand_as(mask)
    assert torch.equal(per_tok, want)
    with pytest.raises(ValueError, match="unknown seq_mask 'foo'; valid: geo, opsm, icepop, kpop"):
        correction.mask_sequences("foo", 1.0, adv, mask, log_ratio)


def test_the_config_knows_the_masks_and_refuses_bad_thresholds():
    assert schema.SEQ_MASKS == correction.SEQ_MASKS
    schema.RolloutConfig(seq_mask="geo", seq_mask_threshold=1.01).check()
    schema.RolloutConfig(seq_mask="opsm", seq_mask_threshold=0.5).check()
    schema.RolloutConfig(seq_mask="icepop", seq_mask_threshold=5.0, seq_mask_low=0.5).check()
    schema.RolloutConfig(seq_mask="kpop", seq_mask_threshold=2.0).check()
    bad = [
        ({"seq_mask": "geo"}, "seq_mask_threshold: required with seq_mask=geo"),
        ({"seq_mask": "geo", "seq_mask_threshold": 0.9}, "must be > 1 with seq_mask=geo"),
        ({"seq_mask": "opsm", "seq_mask_threshold": math.inf}, "must be a finite number > 0"),
        ({"seq_mask": "tis"}, "seq_mask=tis: must be one of none, geo, opsm, icepop, kpop"),
        ({"seq_mask": "icepop", "seq_mask_threshold": 1.0}, "must be a finite number > 1"),
        ({"seq_mask": "kpop", "seq_mask_threshold": 0.0}, "must be a finite number > 0 with kpop"),
        ({"seq_mask": "kpop"}, "seq_mask_threshold: required with seq_mask=kpop"),
        (
            {"seq_mask": "geo", "seq_mask_threshold": 2.0, "seq_mask_low": 0.5},
            "seq_mask_low=0.5: is icepop's lower bound: set rollout.seq_mask=icepop",
        ),
        (
            {"seq_mask": "icepop", "seq_mask_threshold": 5.0, "seq_mask_low": 1.5},
            "seq_mask_low=1.5: must be within (0, 1)",
        ),
    ]
    for fields, message in bad:
        with pytest.raises(ConfigError) as info:
            schema.RolloutConfig(**fields).check()
        assert message in info.value.line()


# ------------------------------------------------------------------------------ IcePop and KPop


def areal_icepop_filter(logprobs, old_logp, loss_mask, lower_bound, upper_bound):
    """AReaL's `_apply_importance_ratio_token_filter` (inclusionAI/AReaL fcc4b9c, the IcePop-style
    filter), restated: the filtered loss mask."""
    ratio_filter_candidates = loss_mask.bool()
    training_inference_ratio = torch.exp(logprobs.detach() - old_logp)
    ratio_in_bounds = (training_inference_ratio >= lower_bound).logical_and(
        training_inference_ratio <= upper_bound
    )
    return ratio_filter_candidates.logical_and(ratio_in_bounds)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize(("low", "high"), [(0.5, 5.0), (None, 1.5)])
def test_icepop_keeps_the_tokens_in_its_band(seed, low, high):
    log_prob, old, adv, mask = rival_batch(seed, stale=1.0)
    log_ratio = torch.where(mask, log_prob - old, 0.0)  # pi_trainer / pi_engine per token
    keep = correction.sequence_keep("icepop", high, adv, mask, log_ratio, low=low)
    want = areal_icepop_filter(log_prob, old, mask, 1 / high if low is None else low, high)
    assert torch.equal(keep & mask, want)
    assert bool((mask & ~keep).any()) and bool((mask & keep).any())
    got, kept = correction.apply_keep(adv, keep, mask)  # [B] advantages become [B, T]
    assert torch.equal(got, torch.where(keep, adv[:, None].expand_as(mask), 0.0))
    assert torch.equal(kept, ~(mask & ~keep).any(-1))


def plain_bernoulli_kl(p: float, q: float) -> float:
    """KL(Ber(p) || Ber(q)) on Python floats, 0 log 0 = 0."""

    def term(a: float, b: float) -> float:
        if a == 0.0:
            return 0.0
        return math.inf if b == 0.0 else a * math.log(a / b)

    return term(p, q) + term(1.0 - p, 1.0 - q)


@pytest.mark.parametrize("seed", range(4))
def test_kpop_drops_what_the_larger_bernoulli_kl_puts_over_the_threshold(seed):
    g = torch.Generator().manual_seed(seed)
    log_q = -torch.rand(6, 7, generator=g, dtype=torch.float64) * 4  # behaviour: 0.02 .. 1
    log_p = (log_q + torch.randn(6, 7, generator=g, dtype=torch.float64) * 2).clamp(max=0.0)
    mask = torch.rand(6, 7, generator=g) < 0.8
    keep = correction.sequence_keep("kpop", 0.5, torch.ones(6), mask, log_p - log_q, log_q=log_q)
    for i, j in zip(*torch.where(mask), strict=True):
        p, q = math.exp(log_p[i, j].item()), math.exp(log_q[i, j].item())
        worst = max(plain_bernoulli_kl(p, q), plain_bernoulli_kl(q, p))
        assert bool(keep[i, j]) == (worst <= 0.5), (p, q, worst)
    assert bool((mask & ~keep).any()) and bool((mask & keep).any())


def test_kpop_on_the_issues_cases_and_non_finite_log_probs():
    """A rare token whose probability grew tenfold moves little (kept); a likely one that
    collapsed moves far (dropped, KPop's 2.0); probability 0 on either side, or a NaN, is
    dropped, never kept by a NaN comparison."""
    f64 = torch.float64
    log_p = torch.tensor([math.log(0.01), math.log(0.01), 0.0, -math.inf, math.nan], dtype=f64)
    log_q = torch.tensor(
        [math.log(1e-3), math.log(0.95), math.log(0.5), math.log(0.5), -1], dtype=f64
    )
    keep = correction.kpop_keep(log_p, log_q, 2.0)
    assert keep.tolist() == [True, False, False, False, False]
    kl = correction.bernoulli_kl(log_p, log_q)
    assert kl[0].item() == pytest.approx(plain_bernoulli_kl(0.01, 0.001), rel=1e-12)
    assert kl[1].item() == pytest.approx(plain_bernoulli_kl(0.01, 0.95), rel=1e-12)
    assert correction.bernoulli_kl(log_q[:3], log_q[:3]).tolist() == [0.0, 0.0, 0.0]

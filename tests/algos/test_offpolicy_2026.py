"""Issue 34's additions against restated references: the ESS of the importance weights
(`algos.ess`), A-3PO's interpolated proximal log-probs (`algos.proximal`, AReaL's
`compute_prox_logp_approximations`), the losses `prime_default` (prime-rl's `default_loss_fn`),
`minpro` (the prefix-minimum ratio, written from its definition) and `vcpo` (sequence-level
truncated IS), VCPO's baseline and step scale, Clip-Cov's recipe clip [0, 2] and the two-sided
TIS rejection. Values and gradients to float64 rounding, ragged masks with an empty row, every
aggregation, all-positive / all-negative advantages."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bapo_cli.algos import ess, proximal, vcpo
from bapo_cli.algos.losses import AGGREGATIONS, policy_loss
from bapo_cli.rollout.base import Sample
from bapo_cli.rollout.scoring import collate
from bapo_cli.trainer.off_policy import tis_weights
from tests.algos.test_losses import LOSS_METRICS, loss_and_grad
from tests.algos.test_rivals import KINDS, check, reduce, rival_batch, verl_clip_cov

# ----------------------------------------------------------------------------------------- ESS


def direct_ess(weights: list[float]) -> float:
    """(sum w)^2 / (N sum w^2), written out on Python floats."""
    n = len(weights)
    return sum(weights) ** 2 / (n * sum(w * w for w in weights))


def test_ess_is_the_normalised_effective_sample_size_of_sequence_weights():
    log_prob, old, _, mask = rival_batch(3, stale=0.3)
    log_w = ess.sequence_log_weights(log_prob, old, mask)
    rows = mask.any(-1)
    assert bool(torch.isnan(log_w[~rows]).all())  # the empty row has no weight
    want = [math.exp(float((log_prob[i] - old[i])[mask[i]].sum())) for i in range(9) if rows[i]]
    assert ess.ess_ratio(log_w) == pytest.approx(direct_ess(want), rel=1e-12)
    assert 1 / len(want) <= ess.ess_ratio(log_w) < 1.0


def test_ess_is_one_on_policy_and_guards_every_non_finite_case():
    log_prob, _, _, mask = rival_batch(4)
    assert ess.ess_ratio(ess.sequence_log_weights(log_prob, log_prob, mask)) == 1.0
    # far weights do not overflow: 40 tokens at log-ratio 20 is e^800 (inf as a float)
    big = torch.tensor([800.0, 799.0, 10.0], dtype=torch.float64)
    w = [1.0, math.exp(-1.0), math.exp(-790.0)]
    assert ess.ess_ratio(big) == pytest.approx(direct_ess(w), rel=1e-12)
    # one infinite weight: 1/N, not NaN (VCPO's code gives NaN and then takes the full step)
    assert ess.ess_ratio(torch.tensor([0.0, 1.0, math.inf, -2.0])) == 0.25
    assert ess.ess_ratio(torch.tensor([math.inf, math.inf])) == 0.5
    # every weight 0: 0; no sequence: 1; NaN entries (empty rows) are not counted
    assert ess.ess_ratio(torch.tensor([-math.inf, -math.inf])) == 0.0
    assert ess.ess_ratio(torch.tensor([math.nan])) == 1.0
    assert ess.ess_ratio(torch.tensor([0.5, math.nan, 0.5])) == 1.0
    # a token whose log-ratio is NaN is left out of its sequence's sum
    lp = torch.tensor([[-1.0, math.nan, -2.0]], dtype=torch.float64)
    got = ess.sequence_log_weights(lp, torch.zeros_like(lp), torch.ones_like(lp, dtype=torch.bool))
    assert got.item() == -3.0
    # a token the behaviour policy gave probability 0: an infinite weight, ESS = 1/N
    lp = torch.tensor([[-1.0, -1.0], [-1.0, -1.0]], dtype=torch.float64)
    behav = torch.tensor([[-1.0, -math.inf], [-1.0, -1.0]], dtype=torch.float64)
    log_w = ess.sequence_log_weights(lp, behav, torch.ones(2, 2, dtype=torch.bool))
    assert ess.ess_ratio(log_w) == 0.5


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    log_w=st.lists(st.floats(-50, 50), min_size=1, max_size=20),
    shift=st.floats(-500, 500),
)
def test_ess_property_bounds_and_scale_invariance(log_w, shift):
    x = torch.tensor(log_w, dtype=torch.float64)
    value = ess.ess_ratio(x)
    assert 1.0 / len(log_w) - 1e-12 <= value <= 1.0
    assert ess.ess_ratio(x + shift) == pytest.approx(value, rel=1e-9, abs=1e-12)


def test_ess_sums_add_up_over_ranks():
    """Summed `weight_sums` of two halves (the all-reduce) give the whole batch's ESS."""
    x = torch.tensor([0.3, -1.2, 2.0, 0.0, -0.5], dtype=torch.float64)
    top = float(x.max())
    parts = ess.weight_sums(x[:2], top) + ess.weight_sums(x[2:], top)
    assert ess.ess_from_sums(*parts.tolist()) == pytest.approx(ess.ess_ratio(x), rel=1e-12)


# ---------------------------------------------------------------------------- A-3PO loglinear


def areal_loglinear(old_logp, logprobs, versions, current_version):
    """AReaL's compute_prox_logp_approximations(method="loglinear"), restated."""
    v_proximal = current_version - 1
    v_behave = versions.float()
    v_theta = float(current_version)
    generated = versions >= 0
    version_diff = v_theta - v_behave
    version_gap = v_proximal - v_behave
    alpha = torch.where(
        (version_diff > 0) & generated, version_gap / version_diff, torch.zeros_like(v_behave)
    )
    alpha = torch.clamp(alpha, 0.0, 1.0)
    return old_logp + alpha * (logprobs - old_logp)


def test_loglinear_prox_is_areals_interpolation():
    g = torch.Generator().manual_seed(5)
    behav = -torch.rand(6, 7, generator=g, dtype=torch.float64) * 3
    current = behav + torch.randn(6, 7, generator=g, dtype=torch.float64) * 0.3
    versions = torch.randint(0, 10, (6, 7), generator=g)
    version = 10
    got = proximal.loglinear_prox(behav, current, version - versions)
    torch.testing.assert_close(got, areal_loglinear(behav, current, versions, version))
    alpha = proximal.loglinear_alpha(torch.tensor([0, 1, 2, 4, 8]))
    assert alpha.tolist() == [0.0, 0.0, 0.5, 0.75, 0.875]  # 1 - 1/k, 0 fresh and one-step stale
    # fresh and one-step-stale tokens keep their behaviour log-prob exactly
    stale = torch.tensor([[0, 1, 3]])
    b = torch.tensor([[-1.0, -2.0, -3.0]], dtype=torch.float64)
    c = torch.tensor([[-1.5, -2.5, -1.0]], dtype=torch.float64)
    got = proximal.loglinear_prox(b, c, stale)
    assert got[0, :2].tolist() == [-1.0, -2.0]
    assert got[0, 2].item() == pytest.approx(-3.0 + 2 / 3 * 2.0, rel=1e-15)


# ---------------------------------------------------------------------------- prime_default


def prime_default_reference(trainer, inference, advantages, loss_mask, *, low, high, kl_tau):
    """prime-rl's default_loss_fn per sequence (packed 1-D tensors), summed and divided by the
    global loss-token count (rl_loss_scale), restated."""
    total = 0.0
    scale = int(loss_mask.sum())
    for t_logp, i_logp, adv, mask in zip(trainer, inference, advantages, loss_mask, strict=True):
        log_importance_ratio = t_logp - i_logp
        importance_ratio = torch.exp(log_importance_ratio)
        probs_diff = torch.exp(t_logp) - torch.exp(i_logp)
        invalid_high = probs_diff > high
        invalid_low = probs_diff < -low
        invalid = torch.where(adv > 0, invalid_high, invalid_low)
        keep = mask & ~invalid
        pg = keep * adv * importance_ratio
        kl = mask * log_importance_ratio**2
        total = total + (-pg + kl_tau * kl).sum() / max(scale, 1)
    return total


@pytest.mark.parametrize("kind", KINDS)
def test_prime_default_matches_prime_rl(kind):
    low, high, tau = 0.15, 0.2, 0.01
    params = {"delta_low": low, "delta_high": high, "kl_tau": tau}

    def ref(lp, old, adv, mask):
        return prime_default_reference(lp, old, adv, mask, low=low, high=high, kl_tau=tau)

    log_prob, old, adv, mask, grad, m = check(
        "prime_default", params, ref, kind, "token-mean", seed=81, stale=0.6
    )
    p, q = log_prob.exp(), old.exp()
    a = adv[:, None].expand_as(mask)
    masked = mask & torch.where(a > 0, p - q > high, p - q < -low)
    assert bool(masked.any())
    # a masked token still has the penalty's gradient: 2 tau log r / n, pulling it back
    n = mask.sum()
    torch.testing.assert_close(grad[masked], (2 * tau * (log_prob - old) / n)[masked])
    assert m["clipfrac_low"].item() + m["clipfrac_high"].item() > 0
    assert (m["c_low"].item(), m["c_high"].item()) == (1 - low, pytest.approx(1 + high))


def test_prime_default_without_penalty_is_unclipped_dppo_tv_with_an_undetached_ratio():
    log_prob, old, adv, mask = rival_batch(82, stale=0.5)
    _, grad, _ = loss_and_grad("prime_default", log_prob, old, adv, mask, kl_tau=0.0)
    a = adv[:, None].expand_as(mask)
    p, q = log_prob.exp(), old.exp()
    keep = mask & ~torch.where(a > 0, p - q > 0.2, p - q < -0.2)
    want = torch.where(keep, -a * torch.exp(log_prob - old), 0.0) / mask.sum()
    torch.testing.assert_close(grad, want, rtol=1e-12, atol=0)


# ------------------------------------------------------------------------------------ MinPRO


def minpro_reference(log_prob, old, advantages, mask, *, eps_low, eps_high, dual, agg):
    """MinPRO from its definition, token by token: m_t = min of the valid ratios before t in
    the sequence (1 if none), times GRPO's clipped surrogate with the dual clip."""
    ratio = torch.exp(log_prob - old)
    rows = []
    for i in range(log_prob.shape[0]):
        row, seen = [], []
        for t in range(log_prob.shape[1]):
            m_t = min(seen) if seen else 1.0
            a, r = advantages[i, t], ratio[i, t]
            surrogate = torch.max(-a * r, -a * torch.clamp(r, 1 - eps_low, 1 + eps_high))
            if a < 0 and dual is not None:
                surrogate = torch.min(surrogate, -a * dual)
            row.append(m_t * surrogate)
            if mask[i, t]:
                seen.append(float(r.detach()))
        rows.append(torch.stack(row))
    return reduce(torch.stack(rows), mask, agg)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("agg", AGGREGATIONS)
def test_minpro_matches_its_definition(agg, kind):
    params = {"eps_low": 0.2, "eps_high": 0.25, "dual_clip": 3.0}

    def ref(lp, old, adv, mask):
        return minpro_reference(lp, old, adv, mask, eps_low=0.2, eps_high=0.25, dual=3.0, agg=agg)

    log_prob, old, adv, mask, grad, m = check("minpro", params, ref, kind, agg, seed=91, stale=0.5)
    # the first token of a sequence has an empty prefix: its gradient is GRPO's
    _, ppo_grad, _ = loss_and_grad(
        "clip_higher", log_prob, old, adv, mask, agg=agg, eps_low=0.2, eps_high=0.25
    )
    torch.testing.assert_close(grad[:, 0], ppo_grad[:, 0], rtol=1e-12, atol=0)
    assert not torch.allclose(grad[:, 1:], ppo_grad[:, 1:])


def test_minpro_prefix_weight_by_hand():
    from bapo_cli.algos.minpro import prefix_min_weight

    r = torch.tensor([[2.0, 0.5, 3.0, 0.25, 1.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True, False, True, True]])
    m = prefix_min_weight(r.log(), torch.zeros_like(r), mask)
    # the masked token (r = 3) is no part of any prefix
    assert m.tolist() == [[1.0, 2.0, 0.5, 0.5, 0.25]]
    with pytest.raises(ValueError, match=r"minpro needs \[B, T\]"):
        policy_loss("minpro", r.flatten(), r.flatten(), r.flatten(), mask.flatten())


# -------------------------------------------------------------------------------------- VCPO


def vcpo_reference(log_prob, old, advantages, mask, *, cap, agg):
    """Sequence-level truncated IS: -sg(min(w_i, C)) A_i grad log pi, w_i = prod_t r_it."""
    log_w = torch.where(mask, log_prob - old, 0.0).sum(-1, keepdim=True)
    weight = torch.exp(log_w).clamp(max=cap).detach()
    return reduce(-weight * advantages * torch.exp(log_prob - log_prob.detach()), mask, agg)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("agg", AGGREGATIONS)
def test_vcpo_loss_is_sequence_level_truncated_is(agg, kind):
    def ref(lp, old, adv, mask):
        return vcpo_reference(lp, old, adv, mask, cap=1.5, agg=agg)

    log_prob, old, adv, mask, grad, m = check(
        "vcpo", {"is_cap": 1.5}, ref, kind, agg, seed=90, stale=1.2
    )
    w = torch.exp(torch.where(mask, log_prob - old, 0.0).sum(-1))
    assert bool((w[mask.any(-1)] > 1.5).any()) and bool((w[mask.any(-1)] < 1.5).any())
    assert m["clipfrac_high"].item() > 0 and m["c_high"].item() == 1.5


def test_vcpo_on_policy_is_the_policy_gradient():
    log_prob, _, adv, mask = rival_batch(96)
    _, grad, _ = loss_and_grad("vcpo", log_prob, log_prob, adv, mask)
    _, ppo, _ = loss_and_grad("ppo", log_prob, log_prob, adv, mask, agg="seq-mean-token-mean")
    torch.testing.assert_close(grad, ppo, rtol=1e-12, atol=0)


def test_vcpo_baseline_is_the_min_variance_baseline_on_rewards():
    """Re-centring GRPO's advantages on their ||g||^2 w^2-weighted mean is (R - b) / std with
    VCPO's baseline b = sum v R / sum v, group by group."""
    g = torch.Generator().manual_seed(7)
    rewards = torch.rand(12, generator=g, dtype=torch.float64).round()
    rewards[:4] = torch.tensor([1.0, 0.0, 0.0, 1.0], dtype=torch.float64)
    groups = torch.arange(12) // 4
    grad_sq = torch.rand(12, generator=g, dtype=torch.float64) + 0.1
    log_w = torch.randn(12, generator=g, dtype=torch.float64)
    mean = torch.stack([rewards[groups == k].mean() for k in groups])
    std = torch.stack([rewards[groups == k].std() for k in groups])
    grpo = torch.where(std > 0, (rewards - mean) / (std + 1e-6), 0.0)
    v = vcpo.baseline_weights(grad_sq, log_w, groups)
    got = vcpo.opob_recentre(grpo, groups, v)
    for k in range(3):
        rows = groups == k
        if float(std[rows][0]) == 0:
            assert torch.equal(got[rows], torch.zeros(4, dtype=torch.float64))
            continue
        vv = grad_sq[rows] * torch.exp(2 * log_w[rows])
        b = (vv * rewards[rows]).sum() / vv.sum()
        torch.testing.assert_close(got[rows], (rewards[rows] - b) / (std[rows] + 1e-6))
    # equal weights leave GRPO's advantages as they are (they are centred already)
    same = vcpo.opob_recentre(grpo, groups, torch.ones(12, dtype=torch.float64))
    torch.testing.assert_close(same, grpo)
    # an infinite weight in a group: only those sequences count; huge ones do not overflow
    inf_w = vcpo.baseline_weights(grad_sq, torch.tensor([math.inf] + [0.0] * 11), groups)
    assert inf_w[1:4].tolist() == [0.0, 0.0, 0.0] and inf_w[0] == grad_sq[0]
    big = vcpo.baseline_weights(grad_sq, log_w + 900.0, groups)
    torch.testing.assert_close(vcpo.opob_recentre(grpo, groups, big), got)


def test_vcpo_step_scale():
    assert vcpo.step_scale(0.25, 1.0, "sqrt") == 0.5
    assert vcpo.step_scale(0.25, 0.5, "linear") == 0.5
    assert vcpo.step_scale(0.9, 0.5, "sqrt") == 1.0  # min(1, .)
    assert vcpo.step_scale(math.nan, 1.0, "sqrt") == 0.0  # never the full step on NaN
    assert vcpo.step_scale(0.01, 1.0, "none") == 1.0
    assert vcpo.VCPOParams().lr_scale(0.04) == pytest.approx(0.2)


# ------------------------------------------------------------- Clip-Cov's [0, 2], TIS two-sided


@pytest.mark.parametrize("kind", KINDS)
def test_clip_cov_takes_the_recipes_ratio_clip(kind):
    """eps_low = eps_high = 1: the Entropy-Mechanism recipe's clip [0, 2]."""
    params = {"clip_ratio": 0.1, "cov_lb": 0.02, "cov_ub": 5.0, "eps_low": 1.0, "eps_high": 1.0}

    def ref(*args):
        return verl_clip_cov(*args, ratio_=0.1, lb=0.02, ub=5.0, eps=1.0, agg="token-mean")[0]

    _, _, _, _, _, m = check(
        "clip_cov", {**params, "dual_clip": None}, ref, kind, "token-mean", seed=53, stale=0.8
    )
    assert (m["c_low"].item(), m["c_high"].item()) == (0.0, 2.0)
    with pytest.raises(ValueError, match=r"^eps_low=1.2: must be within \(0, 1\]"):
        policy_loss("clip_cov", *rival_batch(0), eps_low=1.2)


def test_two_sided_tis_rejection_drops_weights_below_one_over_the_cap():
    def sample(trainer, engine):
        n = len(trainer)
        return Sample([1, 5], 0, None, list(range(10, 10 + n)), trainer, engine, [0] * n)

    a = sample([-1.0, -2.0, -0.5], [-1.0, -3.0, 0.5])  # ratios 1, e, e^-1
    mb = collate([a], pad_id=0, device=torch.device("cpu"))
    one_sided = tis_weights(mb, cap=2.0, mode="mask")
    two_sided = tis_weights(mb, cap=2.0, mode="mask_two_sided")
    torch.testing.assert_close(one_sided, torch.tensor([[1.0, 0.0, math.exp(-1.0)]]))
    torch.testing.assert_close(two_sided, torch.tensor([[1.0, 0.0, 0.0]]))  # e^-1 < 1/2
    seq = tis_weights(mb, cap=2.0, level="sequence", mode="mask_two_sided")  # product e^0 = 1
    torch.testing.assert_close(seq, torch.ones(1, 3))


def test_every_new_loss_reports_the_shared_metrics():
    log_prob, old, adv, mask = rival_batch(97)
    for name in ("minpro", "prime_default", "vcpo"):
        _, _, m = loss_and_grad(name, log_prob, old, adv, mask)
        assert set(m) == LOSS_METRICS, name


def test_no_loss_parameter_shadows_a_shared_algo_option():
    """A loss's params field named like a shared `algo` option is one config key for two things:
    KL-Cov's `kl_coef` (its |log r| weight, 1) also switched on algo.kl_coef, the k3 KL to the
    initial policy, at 1, in every kl_cov run (issue 34). Its field is `kl_cov_coef` now."""
    import dataclasses

    from bapo_cli.algos import losses
    from bapo_cli.config.preflight import preflight
    from bapo_cli.config.schema import AlgoConfig
    from bapo_cli.trainer.update import loss_spec

    shared = {f.name for f in dataclasses.fields(AlgoConfig)}
    for name in losses.REGISTRY.names():
        fields = dataclasses.fields(losses.REGISTRY.get(name).params)
        own = {f.name for f in fields if not f.metadata.get("shared")}
        assert not own & shared, (name, own & shared)
        # a field marked shared is the algo option it names (dual_clip), read from there
        assert {f.name for f in fields if f.metadata.get("shared")} <= shared, name
    spec = loss_spec(preflight("train", ["algo=kl_cov"]).config.algo)
    assert spec.kl_coef == 0.0 and spec.params.kl_cov_coef == 1.0

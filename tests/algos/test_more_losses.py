"""GSPO, CISPO and SAPO: values and gradients against their papers' formulas written out here,
the properties each is for, and one-line errors for bad parameters."""

from __future__ import annotations

import math

import pytest
import torch

from bapo_cli.algos.losses import AGGREGATIONS, SAPOParams, policy_loss
from tests.algos.test_losses import LOSS_METRICS, loss_and_grad, make_batch


def agg_weights(mask: torch.Tensor, agg: str) -> torch.Tensor:
    """Per-token weight of each aggregation mode (as `aggregate`), [B, T]."""
    dt = torch.float64
    n_seqs = max(int(mask.any(-1).sum()), 1)
    if agg == "token-mean":
        return torch.full(mask.shape, 1.0 / max(int(mask.sum()), 1), dtype=dt)
    if agg == "seq-mean-token-sum":
        return torch.full(mask.shape, 1.0 / n_seqs, dtype=dt)
    if agg == "seq-mean-token-mean":
        per_seq = 1.0 / (n_seqs * mask.sum(-1).clamp(min=1).to(dt))
        return per_seq[:, None].expand(mask.shape)
    return torch.full(mask.shape, 1.0 / (n_seqs * mask.shape[-1]), dtype=dt)


# ------------------------------------------------------------------------------------- GSPO


def gspo_reference(log_prob, old, adv, mask, c_low, c_high, dual=3.0):
    """GSPO's objective at the sequence level (paper Eq. 5-7), differentiated by autograd:
    loss = mean over sequences of -min(s_i A_i, clip(s_i) A_i), s_i = exp(mean_t log r_it),
    with verl's dual clip min(., -A_i dual) for A_i < 0."""
    lp = log_prob.clone().requires_grad_()
    n = mask.sum(-1).clamp(min=1)
    s = torch.exp(torch.where(mask, lp - old, 0.0).sum(-1) / n)  # [B]
    clipped = s.clamp(c_low, c_high)
    surrogate = torch.minimum(s * adv, clipped * adv)
    if dual is not None:
        surrogate = torch.where(adv < 0, torch.maximum(surrogate, adv * dual), surrogate)
    has_tokens = mask.any(-1)
    loss = -(torch.where(has_tokens, surrogate, 0.0)).sum() / has_tokens.sum()
    loss.backward()
    return loss.detach(), lp.grad, s.detach()


@pytest.mark.parametrize("dual", [3.0, None])
def test_gspo_is_the_sequence_level_objective(dual):
    log_prob, old, adv, mask = make_batch(21, b=10, t=8, stale=0.15)
    c_low, c_high = 0.95, 1.04
    want_loss, want_grad, s = gspo_reference(log_prob, old, adv, mask, c_low, c_high, dual)
    loss, grad, m = loss_and_grad(
        "gspo",
        log_prob,
        old,
        adv,
        mask,
        eps_low=0.05,
        eps_high=0.04,
        agg="seq-mean-token-mean",
        dual_clip=dual,
    )
    assert loss.item() == pytest.approx(want_loss.item(), rel=1e-12)
    torch.testing.assert_close(grad, want_grad, rtol=1e-10, atol=1e-14)
    # the batch has sequences clipped on both sides and sequences that train
    has = mask.any(-1)
    assert bool((has & (adv > 0) & (s >= c_high)).any()) and bool(
        (has & (adv < 0) & (s <= c_low)).any()
    )
    assert bool((grad != 0).any())
    clipped = has & (((adv > 0) & (s >= c_high)) | ((adv < 0) & (s <= c_low)))
    assert bool((grad[clipped] == 0).all())  # a clipped sequence: no gradient on any token
    assert set(m) == LOSS_METRICS
    assert (m["c_low"].item(), m["c_high"].item()) == (c_low, pytest.approx(c_high))


@pytest.mark.parametrize("agg", AGGREGATIONS)
def test_gspo_token_form_value_and_gradient(agg):
    # every token carries its sequence's value -A_i clip-or-not(s_i) and gradient -A_i s_i
    log_prob, old, adv, mask = make_batch(22, b=8, t=7, stale=0.1)
    loss, grad, m = loss_and_grad("gspo", log_prob, old, adv, mask, agg=agg)
    n = mask.sum(-1).clamp(min=1)
    s = torch.exp(torch.where(mask, log_prob - old, 0.0).sum(-1) / n)[:, None].expand_as(mask)
    a = adv[:, None].expand_as(mask)
    lo, hi = 1 - 3e-4, 1 + 4e-4  # the paper's defaults
    active = mask & (((a > 0) & (s < hi)) | ((a < 0) & (s > lo)))
    value = torch.where(a > 0, s.clamp(max=hi), s.clamp(min=lo, max=3.0))
    value = torch.where(active, s, value)
    w = agg_weights(mask, agg)
    assert loss.item() == pytest.approx((torch.where(mask, -a * value, 0.0) * w).sum().item())
    torch.testing.assert_close(grad, torch.where(active, -a * s, 0.0) * w, rtol=1e-12, atol=0)
    assert m["ratio_max"].item() == pytest.approx(s[mask].max().item())


def test_gspo_needs_sequences():
    log_prob, old, adv, mask = make_batch(0)
    full = adv[:, None].expand_as(log_prob)
    with pytest.raises(ValueError, match="gspo needs \\[B, T\\] tensors"):
        policy_loss(
            "gspo",
            log_prob.flatten(),
            old.flatten(),
            full.flatten(),
            mask.flatten(),
            agg="token-mean",
        )


# ------------------------------------------------------------------------------------ CISPO


@pytest.mark.parametrize("agg", AGGREGATIONS)
def test_cispo_value_and_gradient(agg):
    log_prob, old, adv, mask = make_batch(23, stale=0.8)
    loss, grad, m = loss_and_grad(
        "cispo", log_prob, old, adv, mask, eps_low=0.3, eps_high=0.25, agg=agg
    )
    r = torch.exp(log_prob - old)
    a = adv[:, None].expand_as(r)
    weight = r.clamp(0.7, 1.25)  # sg(clip(r, 1 - eps_low, 1 + eps_high))
    w = agg_weights(mask, agg)
    want = (torch.where(mask, -a * weight * log_prob, 0.0) * w).sum()
    assert loss.item() == pytest.approx(want.item(), rel=1e-12)
    torch.testing.assert_close(grad, torch.where(mask, -a * weight, 0.0) * w, rtol=1e-12, atol=0)
    signed = mask & (a != 0)
    assert m["active_tokens"].item() == signed.sum().item()  # every token trains
    assert m["clipfrac_high"].item() == pytest.approx(
        (signed & (r >= 1.25)).sum().item() / mask.sum().item()
    )
    pos = (weight * a.abs())[signed & (a > 0)].sum()
    neg = (weight * a.abs())[signed & (a < 0)].sum()
    assert m["rho"].item() == pytest.approx((pos / (pos + neg)).item(), rel=1e-12)
    assert set(m) == LOSS_METRICS


def test_cispo_keeps_the_gradient_of_tokens_ppo_clips():
    # a low-probability positive token whose ratio rose to 2 and a negative one that fell to 0.3
    old = torch.log(torch.tensor([[0.01, 0.2]], dtype=torch.float64))
    log_prob = old + torch.log(torch.tensor([[2.0, 0.3]], dtype=torch.float64))
    adv = torch.tensor([[1.0, -1.0]], dtype=torch.float64)
    mask = torch.ones_like(adv, dtype=torch.bool)
    _, ppo_grad, _ = loss_and_grad("ppo", log_prob, old, adv, mask)
    assert bool((ppo_grad == 0).all())  # both clipped: PPO learns nothing from them
    _, grad, m = loss_and_grad("cispo", log_prob, old, adv, mask)  # defaults: no lower bound
    # d loss / d log pi = -A w / n: w = min(2, 1.28) and 0.3 (no lower bound)
    torch.testing.assert_close(grad, torch.tensor([[-1.28 / 2, 0.3 / 2]], dtype=torch.float64))
    assert (m["c_low"].item(), m["c_high"].item()) == (0.0, 1.28)
    assert (m["clipfrac_low"].item(), m["clipfrac_high"].item()) == (0.0, 0.5)


# ------------------------------------------------------------------------------------- SAPO


@pytest.mark.parametrize("agg", AGGREGATIONS)
def test_sapo_value_and_gradient(agg):
    log_prob, old, adv, mask = make_batch(24, stale=0.9)
    loss, grad, m = loss_and_grad(
        "sapo", log_prob, old, adv, mask, tau_pos=1.0, tau_neg=1.05, agg=agg
    )
    r = torch.exp(log_prob - old)
    a = adv[:, None].expand_as(r)
    tau = torch.where(a > 0, 1.0, 1.05).to(r.dtype)
    sig = torch.sigmoid(tau * (r - 1))
    w = agg_weights(mask, agg)
    # f(r) = 4/tau sigmoid(tau (r - 1)); d f / d log pi = 4 sig (1 - sig) r
    want = (torch.where(mask, -a * 4 / tau * sig, 0.0) * w).sum()
    assert loss.item() == pytest.approx(want.item(), rel=1e-12)
    gate = 4 * sig * (1 - sig)
    torch.testing.assert_close(
        grad, torch.where(mask, -a * gate * r, 0.0) * w, rtol=1e-10, atol=1e-15
    )
    signed = mask & (a != 0)
    assert m["active_tokens"].item() == signed.sum().item()
    pos = (gate * r * a.abs())[signed & (a > 0)].sum()
    neg = (gate * r * a.abs())[signed & (a < 0)].sum()
    assert m["rho"].item() == pytest.approx((pos / (pos + neg)).item(), rel=1e-12)
    assert set(m) == LOSS_METRICS


def test_sapo_gate_is_one_on_policy_and_halves_at_the_reported_bounds():
    params = SAPOParams(tau_pos=2.0, tau_neg=4.0)
    c_low, c_high = params.half_bounds()
    ratios = torch.tensor([[1.0, c_high, 1.0, c_low]], dtype=torch.float64)
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]], dtype=torch.float64)
    old = torch.zeros_like(ratios)
    mask = torch.ones_like(adv, dtype=torch.bool)
    _, grad, m = loss_and_grad("sapo", ratios.log(), old, adv, mask, tau_pos=2.0, tau_neg=4.0)
    # gradient / (-A r / n): the gate, 1 on-policy and 1/2 at the reported bounds
    gate = grad * 4 / (-adv * ratios)
    torch.testing.assert_close(gate, torch.tensor([[1.0, 0.5, 1.0, 0.5]], dtype=torch.float64))
    assert (m["c_low"].item(), m["c_high"].item()) == pytest.approx((c_low, c_high))
    assert c_high == pytest.approx(1 + 2 * math.log(1 + math.sqrt(2)) / 2.0)


# ------------------------------------------------------------------------------ bad params

BAD = [
    ("gspo", dict(eps_low=1.0), "eps_low"),
    ("gspo", dict(eps_high=0.0), "eps_high"),
    ("cispo", dict(eps_low=-1.0), "eps_low"),
    ("cispo", dict(eps_high=math.inf), "eps_high"),
    ("sapo", dict(tau_pos=0.0), "tau_pos"),
    ("sapo", dict(tau_neg="soft"), "tau_neg"),
    ("sapo", dict(agg="mean"), "agg"),
]


@pytest.mark.parametrize("name, params, word", BAD, ids=[f"{n}-{w}" for n, _, w in BAD])
def test_bad_parameters_name_themselves(name, params, word):
    with pytest.raises(ValueError, match=word) as info:
        policy_loss(name, *make_batch(0), **params)
    assert "\n" not in str(info.value)

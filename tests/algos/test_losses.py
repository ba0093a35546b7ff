"""Policy losses: values and gradients against a reference written from the formulas, every
aggregation mode, gradient accumulation, dual clip, BAPO's search/loss agreement, bad input."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bapo_cli.algos import losses
from bapo_cli.algos.bounds import BapoBounds, BoundAccumulator, adaptive_bounds
from bapo_cli.algos.losses import AGGREGATIONS, policy_loss, search_inputs
from bapo_cli.algos.registry import Registry

BASE_METRICS = {
    "clipfrac_low",
    "clipfrac_high",
    "ppo_kl",
    "ratio_mean",
    "ratio_max",
    "pos_mass",
    "neg_mass",
    "active_tokens",
    "nonfinite_tokens",
}
# every loss reports the bounds it used and the positive share of the active mass at them, with
# the sums that share is of (so a trainer can weight it by mass)
RHO_SUMS = {"rho_pos", "rho_neg", "rho_pos_before", "rho_neg_before"}
LOSS_METRICS = BASE_METRICS | RHO_SUMS | {"c_low", "c_high", "rho_before", "rho", "search_steps"}


def make_batch(seed, b=6, t=9, dtype=torch.float64, stale=0.5, p_pos=0.4):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, t, generator=g, dtype=dtype) * 3
    log_prob = old + torch.randn(b, t, generator=g, dtype=dtype) * stale
    sign = torch.where(torch.rand(b, generator=g) < p_pos, 1.0, -1.0).to(dtype)
    adv = sign * (0.1 + torch.rand(b, generator=g, dtype=dtype))
    adv[0] = 0.0  # one zero-advantage sequence
    lengths = torch.randint(0, t + 1, (b,), generator=g)
    lengths[min(1, b - 1)] = t
    mask = torch.arange(t)[None, :] < lengths[:, None]
    return log_prob, old, adv, mask


def bounds_of(name, params):
    if name == "ppo":
        eps = params.get("eps", 0.2)
        return 1 - eps, 1 + eps
    if name == "clip_higher":
        return 1 - params.get("eps_low", 0.2), 1 + params.get("eps_high", 0.28)
    b = params["bounds"]
    return b.c_low, b.c_high


def reference(log_prob, old, adv, mask, c_low, c_high, dual, agg, norm_len=None):
    """(loss, d loss / d log_prob) from the formulas, with explicit per-token weights."""
    dt = log_prob.dtype
    r = torch.exp(log_prob - old)
    adv = adv[:, None].expand_as(r) if adv.dim() == 1 else adv
    lo, hi = torch.tensor(c_low, dtype=dt), torch.tensor(c_high, dtype=dt)
    up = torch.tensor(math.inf if dual is None else dual, dtype=dt)
    pos, neg = (adv > 0) & mask, (adv < 0) & mask
    active = (pos & (r < hi)) | (neg & (r > lo) & (r < up))
    value = torch.where(adv > 0, torch.minimum(r, hi), torch.minimum(torch.maximum(r, lo), up))
    tok_loss = torch.where(mask, -adv * value, 0.0)
    tok_grad = torch.where(active, -adv * r, 0.0)
    n_seqs = max(int(mask.any(-1).sum()), 1)
    if agg == "token-mean":
        w = torch.full_like(r, 1.0 / max(int(mask.sum()), 1))
    elif agg == "seq-mean-token-sum":
        w = torch.full_like(r, 1.0 / n_seqs)
    elif agg == "seq-mean-token-mean":
        w = (1.0 / (n_seqs * mask.sum(-1).clamp(min=1).to(dt)))[:, None].expand_as(r)
    else:
        w = torch.full_like(r, 1.0 / (n_seqs * (norm_len or r.shape[-1])))
    return (tok_loss * w).sum(), tok_grad * w, active


def loss_and_grad(name, log_prob, old, adv, mask, **params):
    lp = log_prob.clone().requires_grad_()
    loss, metrics = policy_loss(name, lp, old, adv, mask, **params)
    loss.backward()
    return loss.detach(), lp.grad, metrics


PARAMS = {
    "ppo": {"eps": 0.2},
    "clip_higher": {"eps_low": 0.15, "eps_high": 0.3},
    "bapo": {"bounds": BapoBounds(0.7, 1.45, 0.2, 0.4, 7)},
    "gspo": {"eps_low": 0.05, "eps_high": 0.08},
    "cispo": {"eps_low": 0.3, "eps_high": 0.25},
    "sapo": {"tau_pos": 1.0, "tau_neg": 1.05},
    "dppo_tv": {"delta_low": 0.1, "delta_high": 0.12},
    "dppo_kl": {"delta_low": 0.04, "delta_high": 0.05},
    "m2po": {"m2_threshold": 0.04},
    "clip_cov": {"clip_ratio": 0.05, "cov_lb": 0.05, "cov_ub": 5.0},
    "kl_cov": {"kl_cov_ratio": 0.05},
    "ce_gppo": {"beta1": 0.5, "beta2": 1.0},
    "minpro": {"eps_low": 0.2, "eps_high": 0.25},
    "prime_default": {"delta_low": 0.15, "delta_high": 0.2, "kl_tau": 0.01},
    "vcpo": {"is_cap": 3.0, "agg": "token-mean"},
    "topr": {"ratio": "trajectory"},
    "dcpo": {"eps_low": 0.2, "eps_high": 0.28},
    "vespo": {"k_pos": 2.0, "lambda_pos": 3.0},
    "luspo": {"eps_low": 0.05, "eps_high": 0.08},
}
# losses whose token selection is made per loss call over that call's tokens, as their
# references do (M2PO's second moment, Clip-Cov's and KL-Cov's covariance): split into
# micro-batches they select differently, so gradient accumulation is not the full-batch loss
PER_CALL = {"m2po", "clip_cov", "kl_cov"}
# the losses on the per-token clipped surrogate, checked against `reference` here; the others
# (gspo, cispo, sapo) against their own formulas in tests/algos/test_more_losses.py
CLIPPED = ["bapo", "clip_higher", "ppo"]


@pytest.mark.parametrize("agg", AGGREGATIONS)
@pytest.mark.parametrize("name", CLIPPED)
@pytest.mark.parametrize("dual", [3.0, None])
def test_value_and_gradient_match_the_formulas(name, agg, dual):
    log_prob, old, adv, mask = make_batch(0, stale=0.8)
    params = dict(PARAMS[name], agg=agg, dual_clip=dual)
    loss, grad, metrics = loss_and_grad(name, log_prob, old, adv, mask, **params)
    want_loss, want_grad, active = reference(
        log_prob, old, adv, mask, *bounds_of(name, params), dual, agg
    )
    assert loss.item() == pytest.approx(want_loss.item(), rel=1e-12)
    torch.testing.assert_close(grad, want_grad, rtol=1e-12, atol=0)
    assert bool((grad[~active] == 0).all())  # clipped tokens: exactly zero gradient
    assert bool((grad[active & (adv[:, None] != 0)] != 0).all())
    assert set(metrics) == LOSS_METRICS
    assert (float(metrics["c_low"]), float(metrics["c_high"])) == bounds_of(name, params)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(
    seed=st.integers(0, 10_000),
    name=st.sampled_from(["ppo", "clip_higher", "bapo"]),
    agg=st.sampled_from(AGGREGATIONS),
    dtype=st.sampled_from([torch.float32, torch.float64]),
    b=st.integers(1, 5),
    t=st.integers(1, 7),
)
def test_gradient_property(seed, name, agg, dtype, b, t):
    log_prob, old, adv, mask = make_batch(seed, b, t, dtype, stale=0.6)
    params = dict(PARAMS[name], agg=agg)
    loss, grad, _ = loss_and_grad(name, log_prob, old, adv, mask, **params)
    want_loss, want_grad, active = reference(
        log_prob, old, adv, mask, *bounds_of(name, params), 3.0, agg
    )
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    assert loss.item() == pytest.approx(want_loss.item(), rel=tol, abs=tol)
    torch.testing.assert_close(grad, want_grad, rtol=tol, atol=tol)
    assert bool((grad[~active] == 0).all())


def test_hand_computed_ppo_example():
    ratio = torch.tensor([[0.5, 1.0, 1.5, 0.5, 1.0, 4.0]], dtype=torch.float64)
    adv = torch.tensor([[1.0, 1.0, 1.0, -1.0, -1.0, -1.0]], dtype=torch.float64)
    old = torch.zeros_like(ratio)
    loss, grad, m = loss_and_grad("ppo", ratio.log(), old, adv, torch.ones_like(ratio).bool())
    # per-token loss: -0.5, -1, -1.2 (clipped high), +0.8 (clipped low), +1, +3 (dual clip)
    assert loss.item() == pytest.approx((-0.5 - 1.0 - 1.2 + 0.8 + 1.0 + 3.0) / 6)
    want = torch.tensor([[-0.5, -1.0, 0, 0, 1.0, 0]], dtype=torch.float64) / 6.0
    torch.testing.assert_close(grad, want)
    assert m["clipfrac_high"].item() == pytest.approx(1 / 6)
    assert m["clipfrac_low"].item() == pytest.approx(1 / 6)
    assert m["ratio_max"].item() == 4.0
    assert m["ratio_mean"].item() == pytest.approx(8.5 / 6)
    assert m["pos_mass"].item() == pytest.approx(1.5 / 6)  # active positives: 0.5 + 1.0
    assert m["neg_mass"].item() == pytest.approx(1.0 / 6)  # active negative: r = 1.0
    assert m["ppo_kl"].item() == pytest.approx(-ratio.log().mean().item())
    assert all(v.dim() == 0 and not v.requires_grad for v in m.values())


@pytest.mark.parametrize("agg", AGGREGATIONS)
@pytest.mark.parametrize("name", sorted(set(losses.REGISTRY.names()) - PER_CALL))
def test_gradient_accumulation_with_global_normalisers(name, agg):
    log_prob, old, adv, mask = make_batch(3, b=8, t=5)
    params = dict(PARAMS[name], agg=agg)
    full_loss, full_grad, _ = loss_and_grad(name, log_prob, old, adv, mask, **params)
    glob = dict(global_tokens=mask.sum(), global_seqs=int(mask.any(-1).sum()))
    total, grads = 0.0, []
    for rows in (slice(0, 3), slice(3, 8)):
        loss, grad, _ = loss_and_grad(
            name, log_prob[rows], old[rows], adv[rows], mask[rows], **params, **glob
        )
        total += loss.item()
        grads.append(grad)
    assert total == pytest.approx(full_loss.item(), rel=1e-12)
    torch.testing.assert_close(torch.cat(grads), full_grad, rtol=1e-12, atol=1e-15)


def test_norm_len_sets_the_dr_grpo_constant():
    log_prob, old, adv, mask = make_batch(4)
    a, _, _ = loss_and_grad("ppo", log_prob, old, adv, mask, agg="seq-mean-token-sum-norm")
    b, _, _ = loss_and_grad(
        "ppo", log_prob, old, adv, mask, agg="seq-mean-token-sum-norm", norm_len=90
    )
    assert a.item() == pytest.approx(b.item() * 10)


def test_flat_tokens_and_per_sequence_advantages():
    log_prob, old, adv, mask = make_batch(5)
    full = adv[:, None].expand_as(log_prob)
    a, ga, _ = loss_and_grad("bapo", log_prob, old, adv, mask)
    b, gb, _ = loss_and_grad("bapo", log_prob, old, full.clone(), mask)
    c, gc, _ = loss_and_grad(
        "bapo", log_prob.flatten(), old.flatten(), full.flatten(), mask.flatten()
    )
    assert a.item() == b.item() == pytest.approx(c.item(), rel=1e-12)
    torch.testing.assert_close(ga, gb)
    torch.testing.assert_close(gc.view_as(ga), ga)
    with pytest.raises(ValueError, match="agg"):
        policy_loss(
            "ppo",
            log_prob.flatten(),
            old.flatten(),
            full.flatten(),
            mask.flatten(),
            agg="seq-mean-token-mean",
        )


@pytest.mark.parametrize("name", ["ppo", "clip_higher"])
def test_fixed_bound_losses_report_the_positive_share_at_their_bounds(name):
    log_prob, old, adv, mask = make_batch(14, b=30, t=10, stale=0.5, p_pos=0.4)
    _, grad, m = loss_and_grad(name, log_prob, old, adv, mask, **PARAMS[name])
    mass = torch.exp(log_prob - old) * adv[:, None].abs()
    trained = grad != 0  # the active tokens
    pos = mass[trained & (adv[:, None] > 0)].sum()
    neg = mass[trained & (adv[:, None] < 0)].sum()
    assert 0.0 < m["rho"].item() < 1.0
    assert m["rho"].item() == pytest.approx((pos / (pos + neg)).item(), rel=1e-12)
    assert m["rho_before"].item() == m["rho"].item() and m["search_steps"].item() == 0.0
    # on-policy data with fixed bounds: every token active, rho = share of all mass
    _, _, on = loss_and_grad(name, log_prob, log_prob, adv, mask, **PARAMS[name])
    r_adv = adv[:, None].expand_as(mask)
    share = r_adv[mask & (r_adv > 0)].sum() / r_adv[mask].abs().sum()
    assert on["rho"].item() == pytest.approx(share.item(), rel=1e-12)
    # nothing carries mass: rho = 1 as the search's convention
    _, _, empty = loss_and_grad(name, log_prob, old, adv, torch.zeros_like(mask), **PARAMS[name])
    assert empty["rho"].item() == 1.0


def test_ppo_is_clip_higher_with_equal_eps_and_bapo_with_fixed_bounds():
    log_prob, old, adv, mask = make_batch(6)
    a, ga, _ = loss_and_grad("ppo", log_prob, old, adv, mask, eps=0.25)
    b, gb, _ = loss_and_grad("clip_higher", log_prob, old, adv, mask, eps_low=0.25, eps_high=0.25)
    fixed = BapoBounds(0.75, 1.25, 0.0, 0.0, 0)
    c, gc, _ = loss_and_grad("bapo", log_prob, old, adv, mask, bounds=fixed)
    assert a.item() == b.item() == c.item()
    assert torch.equal(ga, gb) and torch.equal(ga, gc)


# ------------------------------------------------------------------------------------------
# BAPO: search and loss agree
# ------------------------------------------------------------------------------------------


def exact_log_ratio(target: float, dtype) -> torch.Tensor | None:
    """A log ratio x in `dtype` with exp(x) == target rounded to dtype, if one exists nearby."""
    want = torch.tensor(target, dtype=dtype)
    x = torch.log(want)
    for _ in range(64):
        got = torch.exp(x)
        if got == want:
            return x
        x = torch.nextafter(x, torch.tensor(9.0 if got < want else -9.0, dtype=dtype))
    return None  # exp jumps over the target (3.0 in float64 and bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_search_counts_exactly_the_tokens_the_loss_trains(dtype):
    # Ratios exactly on path points (ties): the loss's active set must give the search's rho.
    points = [1.2, 1.25, 1.3, 1.5, 2.0, 3.0, 0.6, 0.62, 0.7, 0.9]
    exact = [x for x in (exact_log_ratio(p, dtype) for p in points) if x is not None]
    assert len(exact) >= 9
    log_r = torch.stack(exact * 6)
    g = torch.Generator().manual_seed(7)
    log_r = torch.cat([log_r, (torch.randn(200, generator=g) * 0.4).to(dtype)])
    n = log_r.numel()
    adv = torch.where(torch.rand(n, generator=g) < 0.3, 1.0, -1.0).to(dtype)
    old = torch.zeros(n, dtype=dtype)
    mask = torch.ones(n, dtype=torch.bool)
    for rho0 in (0.3, 0.45, 0.6):
        lp = log_r.clone().requires_grad_()
        loss, m = policy_loss("bapo", lp, old, adv, mask, rho0=rho0)
        loss.backward()
        trained = lp.grad != 0
        r = torch.exp(log_r).double()
        mass = r * adv.double().abs()
        pos = mass[trained & (adv > 0)].sum()
        neg = mass[trained & (adv < 0)].sum()
        assert m["rho"] == pytest.approx((pos / (pos + neg)).item(), rel=1e-6)
        assert m["search_steps"] > 0


def test_dual_clipped_negatives_are_left_out_of_the_search():
    log_prob, old, adv, mask = make_batch(8, b=40, t=20, stale=1.0, p_pos=0.3)
    _, _, m = loss_and_grad("bapo", log_prob, old, adv, mask)
    r = torch.exp(log_prob - old)
    adv_t = adv[:, None].expand_as(r)
    keep = mask & ~((adv_t < 0) & (r >= 3.0))
    assert bool((mask & ~keep).any())
    b = adaptive_bounds(r, adv_t, keep)
    assert (m["c_low"], m["c_high"], m["rho"]) == (b.c_low, b.c_high, pytest.approx(b.rho))
    _, _, no_dual = loss_and_grad("bapo", log_prob, old, adv, mask, dual_clip=None)
    assert no_dual["rho_before"] < m["rho_before"]


def test_rollout_prob_weighting_is_paper_eq_8():
    log_prob, old, adv, mask = make_batch(9, b=30, t=10, stale=0.5, p_pos=0.3)
    _, _, m = loss_and_grad("bapo", log_prob, old, adv, mask, weighting="rollout_prob")
    r = torch.exp(log_prob - old)
    adv_t = adv[:, None].expand_as(r)
    keep = mask & ~((adv_t < 0) & (r >= 3.0))
    b = adaptive_bounds(r, adv_t, keep, weights=old.exp())
    assert (m["c_low"], m["c_high"], m["search_steps"]) == (b.c_low, b.c_high, b.steps)
    assert m["rho"] == pytest.approx(b.rho)


def test_per_step_bounds_over_micro_batches_equal_the_whole_mini_batch():
    log_prob, old, adv, mask = make_batch(10, b=24, t=12, stale=0.5, p_pos=0.35)
    _, full_grad, full = loss_and_grad("bapo", log_prob, old, adv, mask, agg="seq-mean-token-sum")
    acc = BoundAccumulator()
    chunks = [slice(0, 7), slice(7, 15), slice(15, 24)]
    for rows in chunks:  # e.g. a no-grad forward pass over the micro-batches
        acc.add(**search_inputs(log_prob[rows], old[rows], adv[rows], mask[rows]))
    bounds = acc.solve(0.4)
    assert (bounds.c_low, bounds.c_high) == (full["c_low"], full["c_high"])
    n_seqs = int(mask.any(-1).sum())
    grads = []
    for rows in chunks:
        _, grad, _ = loss_and_grad(
            "bapo",
            log_prob[rows],
            old[rows],
            adv[rows],
            mask[rows],
            bounds=bounds,
            agg="seq-mean-token-sum",
            global_seqs=n_seqs,
        )
        grads.append(grad)
    torch.testing.assert_close(torch.cat(grads), full_grad, rtol=1e-12, atol=1e-15)


def test_on_policy_bapo_is_ppo_with_the_start_bounds():
    log_prob, _, adv, mask = make_batch(11)
    _, grad, m = loss_and_grad("bapo", log_prob, log_prob, adv, mask)
    assert m["search_steps"] == 0.0 and (m["c_low"], m["c_high"]) == (0.6, 1.2)
    _, want, _ = loss_and_grad(
        "clip_higher", log_prob, log_prob, adv, mask, eps_low=0.4, eps_high=0.2
    )
    torch.testing.assert_close(grad, want)


# ------------------------------------------------------------------------------------------
# Non-finite tokens
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", losses.REGISTRY.names())
def test_non_finite_tokens_are_masked_and_counted(name):
    log_prob, old, adv, mask = make_batch(12, b=6, t=8)
    mask[:] = True
    bad_lp, bad_old, bad_adv = log_prob.clone(), old.clone(), adv.clone()
    bad_lp[2, 0] = float("nan")
    bad_lp[2, 1] = float("inf")  # r = inf
    bad_old[3, 2] = float("nan")
    bad_lp[3, 3] = 500.0  # a huge but finite ratio is a valid (clipped) token
    bad_adv[4] = float("inf")  # a whole sequence
    clean_mask = mask.clone()
    clean_mask[2, 0] = clean_mask[2, 1] = clean_mask[3, 2] = False
    clean_mask[4] = False
    params = dict(PARAMS[name])
    torch.manual_seed(0)  # clip_cov draws its tokens from torch's generator: the same draw
    loss, grad, m = loss_and_grad(name, bad_lp, bad_old, bad_adv, mask, **params)
    assert m["nonfinite_tokens"].item() == 3 + 8
    assert torch.isfinite(loss) and bool(torch.isfinite(grad).all())
    assert bool((grad[~clean_mask] == 0).all())
    fixed_adv = torch.where(torch.isfinite(bad_adv), bad_adv, 0.0)
    fixed_lp = torch.where(torch.isfinite(bad_lp), bad_lp, 0.0)
    fixed_old = torch.where(torch.isfinite(bad_old), bad_old, 0.0)
    torch.manual_seed(0)
    want, want_grad, _ = loss_and_grad(name, fixed_lp, fixed_old, fixed_adv, clean_mask, **params)
    assert loss.item() == pytest.approx(want.item(), rel=1e-12)
    torch.testing.assert_close(grad, want_grad)


def test_non_finite_in_the_bapo_search():
    log_prob, old, adv, mask = make_batch(13, b=20, t=10, p_pos=0.3)
    bad = log_prob.clone()
    bad[5, :3] = float("nan")
    clean = mask.clone()
    clean[5, :3] = False
    _, _, m = loss_and_grad("bapo", bad, old, adv, mask)
    _, _, want = loss_and_grad("bapo", log_prob, old, adv, clean)
    assert {k: m[k] for k in ("c_low", "c_high", "rho")} == {
        k: want[k] for k in ("c_low", "c_high", "rho")
    }


# ------------------------------------------------------------------------------------------
# Registry and bad input
# ------------------------------------------------------------------------------------------


def test_registry_names_and_errors():
    names = [
        "bapo",
        "ce_gppo",
        "cispo",
        "clip_cov",
        "clip_higher",
        "dcpo",
        "dppo_kl",
        "dppo_tv",
        "gspo",
        "kl_cov",
        "luspo",
        "m2po",
        "minpro",
        "ppo",
        "prime_default",
        "sapo",
        "topr",
        "vcpo",
        "vespo",
    ]
    assert losses.REGISTRY.names() == names
    with pytest.raises(ValueError, match=r"unknown loss 'foo'; valid: " + ", ".join(names)):
        policy_loss("foo", *make_batch(0))
    reg = Registry("thing")
    reg.register("a")(len)
    with pytest.raises(ValueError, match="already registered"):
        reg.register("a")(len)
    assert "a" in reg and list(reg) == ["a"] and reg["a"] is len


BAD = [
    ("ppo", dict(eps=0.0), "eps"),
    ("ppo", dict(eps=1.0), "eps"),
    ("clip_higher", dict(eps_low=1.2), "eps_low"),
    ("clip_higher", dict(eps_high=-0.1), "eps_high"),
    ("ppo", dict(dual_clip=0.9), "dual_clip"),
    ("ppo", dict(dual_clip=math.nan), "dual_clip"),
    ("bapo", dict(dual_clip=0.85), "dual_clip"),
    ("ppo", dict(agg="mean"), "agg"),
    ("bapo", dict(weighting="prob"), "weighting"),
    ("bapo", dict(bounds=(0.8, 1.2)), "bounds"),
    ("bapo", dict(rho0=1.5), "rho0"),
    ("bapo", dict(low_range=(0.9, 0.6)), "low_range"),
    ("bapo", dict(high_step=0), "high_step"),
    ("ppo", dict(global_tokens=0), "global_tokens"),
    ("ppo", dict(agg="seq-mean-token-sum", global_seqs=-1), "global_seqs"),
    ("ppo", dict(agg="seq-mean-token-sum-norm", norm_len=0), "norm_len"),
    ("ppo", dict(eps="wide"), "eps"),
    ("ppo", dict(dual_clip=math.inf), "dual_clip"),
    ("bapo", dict(rho0="half"), "rho0"),
    ("bapo", dict(low_step="fast"), "low_step"),
    ("bapo", dict(dual_clip="x"), "dual_clip"),
]


@pytest.mark.parametrize("name, params, word", BAD, ids=[f"{n}-{w}" for n, _, w in BAD])
def test_bad_parameters_name_themselves(name, params, word):
    with pytest.raises(ValueError, match=word):
        policy_loss(name, *make_batch(0), **params)


@pytest.mark.parametrize("which", ["old_log_prob", "advantages", "mask", "log_prob"])
def test_shape_mismatches_name_the_tensor(which):
    args = dict(zip(["log_prob", "old_log_prob", "advantages", "mask"], make_batch(0), strict=True))
    if which == "log_prob":
        args = {k: v[None] for k, v in args.items()}  # 3-D
    else:
        args[which] = args[which][:, :3] if args[which].dim() == 2 else args[which][:2]
    with pytest.raises(ValueError, match=which):
        policy_loss("bapo", **args)


def test_every_loss_reports_the_sums_of_rho_in_the_searchs_units():
    ratio = torch.tensor([[0.5, 1.0, 1.5, 0.5, 1.0, 4.0]], dtype=torch.float64)
    adv = torch.tensor([[1.0, 1.0, 1.0, -1.0, -1.0, -1.0]], dtype=torch.float64)
    old, mask = torch.zeros_like(ratio), torch.ones_like(ratio).bool()
    _, _, m = loss_and_grad("ppo", ratio.log(), old, adv, mask)
    # active: positives r = 0.5, 1.0 (P = 1.5), the negative r = 1.0 (N = 1.0); sums, not means
    assert (m["rho_pos"].item(), m["rho_neg"].item(), m["active_tokens"].item()) == (1.5, 1, 3)
    assert (m["rho_pos_before"].item(), m["rho_neg_before"].item()) == (1.5, 1.0)
    assert m["rho"].item() == 1.5 / 2.5
    # BAPO reports its search's P and N, which are exactly what a BoundAccumulator sums
    _, _, b = loss_and_grad("bapo", ratio.log(), old, adv, mask, rho0=0.7)
    want = adaptive_bounds(ratio, adv, mask, rho0=0.7, dual_clip=3.0)
    assert (b["rho_pos"], b["rho_neg"]) == (want.pos, want.neg) == (3.0, 1.0)  # 1.5 enters
    assert (b["rho_pos_before"], b["rho_neg_before"]) == (1.5, 1.0)
    assert b["active_tokens"].item() == 4
    # nothing active (every advantage 0): no tokens carry gradient, the sums are 0
    _, grad, z = loss_and_grad("ppo", ratio.log(), old, torch.zeros_like(adv), mask)
    assert z["active_tokens"].item() == 0 and z["rho_pos"].item() + z["rho_neg"].item() == 0
    assert bool((grad == 0).all())

"""DPPO (TV, KL), M2PO, Clip-Cov, KL-Cov and CE-GPPO against their reference code, restated here
line by line (verl's `core_algos.py`, AReaL's M2PO mask, the CE-GPPO authors' published loss) and
differentiated by autograd: value and gradient on random batches with empty rows, ragged
lengths, and batches whose advantages are all positive or all negative; then what each method is
for, and one-line errors for bad parameters."""

from __future__ import annotations

import math

import pytest
import torch

from bapo_cli.algos.losses import AGGREGATIONS, policy_loss
from tests.algos.test_losses import LOSS_METRICS, loss_and_grad
from tests.algos.test_more_losses import agg_weights

KINDS = ("mixed", "all_positive", "all_negative")


def rival_batch(seed, kind="mixed", b=9, t=8, stale=0.6, dtype=torch.float64):
    """[b, t] log-probs, behaviour log-probs, per-sequence advantages and a ragged mask with an
    empty row (row 2) and a full one (row 1); `kind` sets the advantages' signs."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, t, generator=g, dtype=dtype) * 3  # behaviour probabilities 0.05..1
    log_prob = (old + torch.randn(b, t, generator=g, dtype=dtype) * stale).clamp(max=-1e-3)
    size = 0.1 + torch.rand(b, generator=g, dtype=dtype)
    sign = {
        "mixed": torch.where(torch.rand(b, generator=g) < 0.5, 1.0, -1.0).to(dtype),
        "all_positive": torch.ones(b, dtype=dtype),
        "all_negative": -torch.ones(b, dtype=dtype),
    }[kind]
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    lengths[1], lengths[2] = t, 0
    mask = torch.arange(t)[None, :] < lengths[:, None]
    return log_prob, old, sign * size, mask


def reduce(pg, mask, agg):
    """The project's aggregation of a per-token loss matrix (the weights `aggregate` uses)."""
    return (torch.where(mask, pg, 0.0) * agg_weights(mask, agg)).sum()


def ref_value_and_grad(fn, log_prob, *args, **kw):
    lp = log_prob.clone().requires_grad_()
    loss = fn(lp, *args, **kw)
    loss.backward()
    return loss.detach(), lp.grad


def check(name, params, ref, kind, agg, seed, **batch):
    log_prob, old, adv, mask = rival_batch(seed, kind, **batch)
    torch.manual_seed(seed)  # clip_cov draws from torch's generator: the same draw for both
    loss, grad, m = loss_and_grad(name, log_prob, old, adv, mask, agg=agg, **params)
    torch.manual_seed(seed)
    want, want_grad = ref_value_and_grad(ref, log_prob, old, adv[:, None].expand_as(mask), mask)
    assert loss.item() == pytest.approx(want.item(), rel=1e-12, abs=1e-15)
    torch.testing.assert_close(grad, torch.where(mask, want_grad, 0.0), rtol=1e-10, atol=1e-14)
    assert set(m) == LOSS_METRICS
    assert bool((grad[~mask] == 0).all())
    return log_prob, old, adv, mask, grad, m


# ---------------------------------------------------------------------------------------- DPPO


def verl_dppo(log_prob, old_log_prob, advantages, mask, *, variant, low, high, cap, agg):
    """verl's compute_policy_loss_dppo_tv / _dppo_kl, restated."""
    negative_approx_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    truncated_ratio = torch.clamp(ratio, max=cap).detach()
    prob, old_prob = torch.exp(log_prob), torch.exp(old_log_prob)
    if variant == "tv":
        valid_positive = (prob - old_prob) <= high
        valid_negative = (prob - old_prob) >= -low
    else:
        binary_kl = old_prob * (old_log_prob - log_prob) + (1 - old_prob) * torch.log(
            (1.0 - old_prob + 1e-8) / (1.0 - prob + 1e-8)
        )
        valid_positive = (binary_kl <= high) | (prob <= old_prob)
        valid_negative = (binary_kl <= low) | (prob >= old_prob)
    valid = torch.where(advantages > 0, valid_positive, valid_negative).detach().float()
    pg_losses = -advantages * truncated_ratio * log_prob * valid
    return reduce(pg_losses, mask, agg)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("agg", AGGREGATIONS)
@pytest.mark.parametrize("variant", ["tv", "kl"])
def test_dppo_matches_verl(variant, agg, kind):
    low, high, cap = (0.1, 0.12, 1.7) if variant == "tv" else (0.04, 0.05, 1.7)
    params = {"delta_low": low, "delta_high": high, "ratio_cap": cap}

    def ref(*args):
        return verl_dppo(*args, variant=variant, low=low, high=high, cap=cap, agg=agg)

    log_prob, old, adv, mask, grad, m = check(f"dppo_{variant}", params, ref, kind, agg, seed=31)
    # the batch has masked tokens and kept ones, and ratios above the IS cap
    r = torch.exp(log_prob - old)
    masked = m["clipfrac_low"] + m["clipfrac_high"]
    assert 0 < masked.item() < 1
    assert bool((mask & (r > cap)).any())
    assert (m["c_low"].item(), m["c_high"].item()) == (1 - low, pytest.approx(1 + high))


def test_dppo_trusts_a_rare_token_with_a_large_ratio_and_not_a_likely_one_that_moved():
    # rare: 0.01 -> 0.05 (r = 5, moved 0.04); likely: 0.7 -> 0.9 (r = 1.29, moved 0.2)
    old = torch.tensor([[0.01, 0.7]]).log().double()
    log_prob = torch.tensor([[0.05, 0.9]]).log().double()
    adv, mask = torch.tensor([1.0]).double(), torch.ones(1, 2, dtype=torch.bool)
    _, grad, m = loss_and_grad("dppo_tv", log_prob, old, adv, mask)
    assert grad[0, 0] != 0 and grad[0, 1] == 0  # PPO (c_high 1.2) would clip both
    assert m["clipfrac_high"].item() == 0.5
    _, ppo_grad, _ = loss_and_grad("ppo", log_prob, old, adv, mask)
    assert bool((ppo_grad == 0).all())
    # moving back into the region is never masked: the likely token going down, A > 0
    _, back, _ = loss_and_grad("dppo_tv", old, log_prob, adv, mask)
    assert bool((back != 0).all())


# ---------------------------------------------------------------------------------------- M2PO


def areal_m2po_mask(sorted_m2, m2_threshold):
    """AReaL's get_m2po_loss_mask, restated."""
    n = sorted_m2.numel()
    if n == 0:
        return torch.ones_like(sorted_m2, dtype=torch.bool)
    suffix_sums = sorted_m2.flip(0).cumsum(0).flip(0)
    counts = torch.arange(n, 0, -1, dtype=sorted_m2.dtype)
    avg_m2_suffix = suffix_sums / counts
    below = torch.where(avg_m2_suffix < m2_threshold)[0]
    num_to_mask = below[0].item() if len(below) > 0 else n - 1
    loss_mask = torch.ones_like(sorted_m2, dtype=torch.bool)
    if num_to_mask > 0:
        loss_mask[:num_to_mask] = False
    return loss_mask


def areal_m2po(log_prob, old_logp, advantages, loss_mask, *, m2_threshold, eps, c_clip, agg):
    """AReaL's actor loss with m2_threshold set (prox_logp = the current weights' log-probs)."""
    prox_logp = log_prob.detach()
    delta = old_logp - prox_logp
    m2 = delta * delta
    mask_flat = loss_mask.view(-1)
    m2_selected = m2.view(-1)[mask_flat]
    sorted_m2, indices = torch.sort(m2_selected, descending=True)
    restored_indices = torch.argsort(indices)
    m2_selected_mask = areal_m2po_mask(sorted_m2, m2_threshold)[restored_indices]
    m2_full_flat = torch.zeros_like(mask_flat, dtype=torch.bool)
    m2_full_flat[mask_flat] = m2_selected_mask
    loss_mask = m2_full_flat.view_as(loss_mask)
    # ppo_actor_loss_fn
    ratio = torch.exp(log_prob - old_logp)
    pg_loss1 = -advantages * ratio
    pg_loss = pg_loss1  # eps None: the paper's objective, no ratio clip
    if eps is not None:
        pg_loss2 = -advantages * torch.clamp(ratio, 1.0 - eps, 1.0 + eps)
        pg_loss = torch.max(pg_loss1, pg_loss2)
    if c_clip is not None:
        pg_loss3 = torch.sign(advantages) * c_clip * advantages
        pg_loss = torch.min(pg_loss, pg_loss3)
    return reduce(pg_loss, loss_mask, agg), loss_mask


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("agg", AGGREGATIONS)
@pytest.mark.parametrize(("eps", "dual"), [(None, None), (0.2, 3.0), (0.2, None)])
def test_m2po_matches_areal(eps, dual, agg, kind):
    params = {"m2_threshold": 0.04, "eps_low": eps, "eps_high": eps, "dual_clip": dual}

    def ref(*args):
        return areal_m2po(*args, m2_threshold=0.04, eps=eps, c_clip=dual, agg=agg)[0]

    log_prob, old, adv, mask, grad, m = check("m2po", params, ref, kind, agg, seed=41, stale=0.4)
    _, kept = areal_m2po(
        log_prob,
        old,
        adv[:, None].expand_as(mask),
        mask,
        m2_threshold=0.04,
        eps=eps,
        c_clip=dual,
        agg=agg,
    )
    dropped = mask & ~kept
    assert bool(dropped.any()) and bool(kept.any())
    assert bool((grad[dropped] == 0).all())
    # what is left has a second moment under the threshold
    assert ((log_prob - old)[kept] ** 2).mean().item() < 0.04
    # the masked tokens count as clipped on their side
    sign = adv[:, None].expand_as(mask)
    assert m["clipfrac_low"].item() >= dropped[sign < 0].sum().item() / mask.sum().item()
    assert m["clipfrac_high"].item() >= dropped[sign > 0].sum().item() / mask.sum().item()
    if eps is None:  # no clip: every kept token trains, and c_high is the largest kept ratio
        assert bool((grad[kept & (sign != 0)] != 0).all())
        r = torch.exp(log_prob - old)
        assert m["c_low"].item() == 0.0
        assert m["c_high"].item() == pytest.approx(max(r[kept].max().item(), 1.0))


def test_m2po_masks_nothing_on_policy_and_keeps_one_token_at_worst():
    log_prob, old, adv, mask = rival_batch(5)
    a, ga, ma = loss_and_grad("m2po", log_prob, log_prob.clone(), adv, mask, dual_clip=None)
    b, gb, _ = loss_and_grad("ppo", log_prob, log_prob.clone(), adv, mask, dual_clip=None)
    assert a.item() == b.item() and torch.equal(ga, gb)
    assert ma["clipfrac_low"].item() == ma["clipfrac_high"].item() == 0.0
    far = log_prob + 5.0  # every (log r)^2 = 25: all but one token masked
    _, grad, m = loss_and_grad("m2po", far, log_prob, adv, mask, m2_threshold=0.04)
    assert m["active_tokens"].item() <= 1


def test_m2po_masked_tokens_leave_the_normaliser_the_trainer_passes():
    """Issue 45, item 2, the minimal case: log r = (0, 0, 2), A = 1, tau = 0.04. M2PO masks the
    third token; AReaL's loss is the kept tokens' mean, -1, each with gradient -1/2. The trainer
    passes the mini-batch's token count (here its one micro-batch: 3): until issue 45 that
    counted the masked token, loss -2/3 and gradient -1/3 per kept token."""
    old = torch.zeros(1, 3, dtype=torch.float64)
    log_prob = torch.tensor([[0.0, 0.0, 2.0]], dtype=torch.float64)
    adv, mask = torch.tensor([1.0], dtype=torch.float64), torch.ones(1, 3, dtype=torch.bool)
    for count in (None, 3, torch.tensor(3.0, dtype=torch.float64)):
        loss, grad, m = loss_and_grad(
            "m2po", log_prob, old, adv, mask, m2_threshold=0.04, global_tokens=count
        )
        assert loss.item() == -1.0, count
        assert grad[0].tolist() == [-0.5, -0.5, 0.0], count
        assert m["clipfrac_high"].item() == pytest.approx(1 / 3)  # the masked token, A > 0


@pytest.mark.parametrize("kind", KINDS)
def test_m2po_under_gradient_accumulation_is_areals_per_micro_batch_loss(kind):
    """With several micro-batches AReaL's loss of each is its kept tokens' mean (the mask and the
    count are the micro-batch's), weighted by the micro-batch's share of the mini-batch's tokens
    (`loss_weight_fn`: its loss mask before M2PO, over all micro-batches). The project's calls,
    each given the mini-batch's token count as the trainer gives it, add up to that."""
    log_prob, old, adv, mask = rival_batch(42, kind, stale=0.4)
    full = adv[:, None].expand_as(mask)
    total = mask.sum()
    want_loss, want_grad = 0.0, []
    got_loss, got_grad = 0.0, []
    for rows in (slice(0, 4), slice(4, 9)):
        part = (log_prob[rows], old[rows], full[rows], mask[rows])

        def areal(lp, o, a, mk):
            loss, kept = areal_m2po(
                lp, o, a, mk, m2_threshold=0.04, eps=None, c_clip=None, agg="token-mean"
            )
            assert bool((mk & ~kept).any())  # each micro-batch masks some token
            return loss * mk.sum() / total

        value, grad = ref_value_and_grad(areal, *part)
        want_loss += value.item()
        want_grad.append(grad)
        loss, grad, _ = loss_and_grad(
            "m2po",
            *part[:2],
            adv[rows],
            part[3],
            m2_threshold=0.04,
            dual_clip=None,
            global_tokens=total,
        )
        got_loss += loss.item()
        got_grad.append(grad)
    assert got_loss == pytest.approx(want_loss, rel=1e-12)
    torch.testing.assert_close(torch.cat(got_grad), torch.where(mask, torch.cat(want_grad), 0.0))


# ------------------------------------------------------------------------------------ Clip-Cov


def verl_clip_cov(log_prob, old_log_prob, advantages, response_mask, *, ratio_, lb, ub, eps, agg):
    """verl's compute_policy_loss_clip_cov, restated (torch's global generator draws)."""

    def masked_mean(x, m):
        return (x * m).sum() / m.sum()

    negative_approx_kl = log_prob - old_log_prob
    ratio = torch.exp(negative_approx_kl)
    pg_losses1 = -advantages * ratio
    corr = torch.ones_like(advantages)
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - eps, 1 + eps)
    clip_by_origin = (pg_losses2 > pg_losses1) & (response_mask > 0)
    cov_all = (advantages - masked_mean(advantages, response_mask)) * (
        log_prob - masked_mean(log_prob.detach(), response_mask)
    )
    cov_all = cov_all.detach().clone()
    cov_all[response_mask == 0] = -torch.inf
    cov_all[clip_by_origin] = -torch.inf
    clip_num = max(int(ratio_ * response_mask.sum().item()), 1)
    top_k_idx = (cov_all < ub) & (cov_all > lb) & (response_mask > 0)
    top_k_idx = torch.nonzero(top_k_idx)
    if len(top_k_idx) > 0:
        perm = torch.randperm(len(top_k_idx))
        top_k_idx = top_k_idx[perm[: min(clip_num, len(top_k_idx))]]
    else:
        top_k_idx = torch.empty((0, 2), dtype=torch.long)
    corr[top_k_idx[:, 0], top_k_idx[:, 1]] = 0
    pg_losses = torch.maximum(pg_losses1, pg_losses2) * corr
    return reduce(pg_losses, response_mask, agg), corr


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("agg", AGGREGATIONS)
def test_clip_cov_matches_verl(agg, kind):
    params = {
        "clip_ratio": 0.1,
        "cov_lb": 0.02,
        "cov_ub": 5.0,
        "eps_low": 0.2,
        "eps_high": 0.2,
        "dual_clip": None,
    }

    def ref(*args):
        return verl_clip_cov(*args, ratio_=0.1, lb=0.02, ub=5.0, eps=0.2, agg=agg)[0]

    log_prob, old, adv, mask, grad, m = check("clip_cov", params, ref, kind, agg, seed=51)
    torch.manual_seed(51)
    _, corr = verl_clip_cov(
        log_prob,
        old,
        adv[:, None].expand_as(mask),
        mask,
        ratio_=0.1,
        lb=0.02,
        ub=5.0,
        eps=0.2,
        agg=agg,
    )
    detached = corr == 0
    assert 0 < int(detached.sum()) <= max(int(0.1 * mask.sum()), 1)
    assert bool((grad[detached] == 0).all())


def test_clip_cov_detaches_only_high_covariance_tokens_the_clip_kept():
    log_prob, old, adv, mask = rival_batch(52, stale=0.3)
    _, grad, m = loss_and_grad(
        "clip_cov",
        log_prob,
        old,
        adv,
        mask,
        clip_ratio=1.0,
        cov_lb=0.0,
        cov_ub=100.0,
        dual_clip=None,
    )
    _, ppo_grad, _ = loss_and_grad("ppo", log_prob, old, adv, mask, dual_clip=None)
    a = adv[:, None].expand_as(mask)
    logp = torch.where(mask, log_prob, 0.0)
    n = mask.sum()
    cov = (a - (a * mask).sum() / n) * (logp - logp.sum() / n)
    changed = (grad != ppo_grad) & mask
    assert bool(changed.any())
    assert bool((grad[changed] == 0).all()) and bool((cov[changed] > 0).all())
    assert bool((ppo_grad[changed] != 0).all())  # the clip had left them active


# ------------------------------------------------------------------------------------- KL-Cov


def verl_kl_cov(log_prob, old_log_prob, advantages, response_mask, *, kl_cov_ratio, coef, agg):
    """verl's compute_policy_loss_kl_cov, restated."""
    negative_approx_kl = log_prob - old_log_prob
    abs_kl = negative_approx_kl.abs()
    ratio = torch.exp(negative_approx_kl)
    pg_losses1 = -advantages * ratio
    pg_losses_kl = -advantages * ratio + coef * abs_kl
    pg_losses = pg_losses1.clone()
    all_valid = response_mask > 0
    all_valid_idx = torch.nonzero(all_valid.reshape(-1), as_tuple=True)[0]
    all_valid_adv = advantages[all_valid].detach().reshape(-1)
    all_valid_logp = log_prob[all_valid].detach().reshape(-1)
    cov_lst_all = (all_valid_adv - all_valid_adv.mean()) * (all_valid_logp - all_valid_logp.mean())
    k_percent_nums = max(1, int(len(cov_lst_all) * kl_cov_ratio))
    large_cov_idxs = torch.topk(cov_lst_all, k_percent_nums, largest=True).indices
    large_cov_idxs = all_valid_idx[large_cov_idxs]
    rows, cols = large_cov_idxs // advantages.shape[1], large_cov_idxs % advantages.shape[1]
    pg_losses[rows, cols] = pg_losses_kl[rows, cols]
    return reduce(pg_losses, response_mask, agg)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("agg", AGGREGATIONS)
def test_kl_cov_matches_verl(agg, kind):
    params = {"kl_cov_ratio": 0.1, "kl_cov_coef": 0.7}

    def ref(*args):
        return verl_kl_cov(*args, kl_cov_ratio=0.1, coef=0.7, agg=agg)

    log_prob, old, adv, mask, grad, m = check("kl_cov", params, ref, kind, agg, seed=61)
    penalised = m["clipfrac_low"] + m["clipfrac_high"]
    assert penalised.item() * mask.sum().item() == pytest.approx(max(int(0.1 * mask.sum()), 1))
    assert m["c_low"].item() == 0.0
    assert m["c_high"].item() == pytest.approx(torch.exp(log_prob - old)[mask].max().item())


def test_kl_cov_without_penalty_is_the_unclipped_policy_gradient():
    log_prob, old, adv, mask = rival_batch(62, stale=1.0)
    _, grad, _ = loss_and_grad("kl_cov", log_prob, old, adv, mask, kl_cov_coef=0.0)
    a = adv[:, None].expand_as(mask)
    want = torch.where(mask, -a * torch.exp(log_prob - old), 0.0) / mask.sum()
    torch.testing.assert_close(grad, want, rtol=1e-12, atol=0)


# ------------------------------------------------------------------------------------ CE-GPPO


def ce_gppo_reference(
    old_log_prob,
    log_prob,
    advantages,
    response_mask,
    *,
    cliprange_low,
    cliprange_high,
    clip_ratio_c,
    beta1,
    beta2,
    agg,
):
    """compute_gppo_loss_general_beta as the CE-GPPO authors publish it, restated."""
    negative_approx_kl = log_prob - old_log_prob
    ratio = torch.exp(negative_approx_kl)
    ratio_detached = ratio.detach()
    low_mask = (ratio < (1 - cliprange_low)) & (advantages < 0)
    high_mask = (ratio > (1 + cliprange_high)) & (advantages > 0)
    other_mask = ~(low_mask | high_mask)
    clip_pg_losses1 = torch.zeros_like(advantages)
    clip_pg_losses1[low_mask] = (
        -beta1
        * (1 - cliprange_low)
        / ratio_detached[low_mask]
        * ratio[low_mask]
        * advantages[low_mask]
    )
    clip_pg_losses1[high_mask] = (
        -beta2
        * (1 + cliprange_high)
        / ratio_detached[high_mask]
        * ratio[high_mask]
        * advantages[high_mask]
    )
    clip_pg_losses1[other_mask] = -ratio[other_mask] * advantages[other_mask]
    pg_losses3 = -advantages * clip_ratio_c
    clip_pg_losses2 = torch.min(pg_losses3, clip_pg_losses1)
    pg_losses = torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1)
    return reduce(pg_losses, response_mask, agg)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("agg", AGGREGATIONS)
@pytest.mark.parametrize("betas", [(0.75, 1.0), (0.5, 0.3)])
def test_ce_gppo_matches_the_authors_loss(betas, agg, kind):
    beta1, beta2 = betas
    params = {"eps_low": 0.2, "eps_high": 0.25, "beta1": beta1, "beta2": beta2, "dual_clip": 2.0}

    def ref(lp, old, adv, mask):
        return ce_gppo_reference(
            old,
            lp,
            adv,
            mask,
            cliprange_low=0.2,
            cliprange_high=0.25,
            clip_ratio_c=2.0,
            beta1=beta1,
            beta2=beta2,
            agg=agg,
        )

    log_prob, old, adv, mask, grad, m = check("ce_gppo", params, ref, kind, agg, seed=71, stale=0.8)
    r = torch.exp(log_prob - old)
    a = adv[:, None].expand_as(mask)
    clipped = mask & (((a < 0) & (r < 0.8)) | ((a > 0) & (r > 1.25)))
    if kind != "all_positive":
        assert bool((mask & (a < 0) & (r < 0.8)).any())
    if kind != "all_negative":
        assert bool((mask & (a > 0) & (r > 1.25)).any())
    assert bool((grad[clipped] != 0).all())  # PPO gives these no gradient


def test_ce_gppo_with_zero_betas_has_ppos_gradient():
    # the value differs (a clipped token is worth beta * c * -A, here 0), the gradient does not
    log_prob, old, adv, mask = rival_batch(72, stale=0.8)
    _, ga, ma = loss_and_grad("ce_gppo", log_prob, old, adv, mask, beta1=0.0, beta2=0.0)
    _, gb, mb = loss_and_grad("ppo", log_prob, old, adv, mask)
    torch.testing.assert_close(ga, gb, rtol=1e-12, atol=0)
    assert ma["active_tokens"].item() == mb["active_tokens"].item()
    assert ma["rho"].item() == pytest.approx(mb["rho"].item())


# ------------------------------------------------------------------------------- bad parameters

BAD = [
    ("dppo_tv", {"delta_low": 0.0}, "delta_low"),
    ("dppo_kl", {"ratio_cap": 0.5}, "ratio_cap"),
    ("m2po", {"m2_threshold": -1}, "m2_threshold"),
    ("m2po", {"eps_low": 1.5, "eps_high": 0.2}, "eps_low"),
    ("m2po", {"eps_low": 0.2}, "eps_high"),
    ("clip_cov", {"clip_ratio": 2.0}, "clip_ratio"),
    ("clip_cov", {"cov_lb": 5.0, "cov_ub": 1.0}, "cov_ub"),
    ("kl_cov", {"kl_cov_ratio": 0.0}, "kl_cov_ratio"),
    ("kl_cov", {"kl_cov_coef": math.inf}, "kl_cov_coef"),
    ("ce_gppo", {"beta1": -0.1}, "beta1"),
]


@pytest.mark.parametrize("name, params, word", BAD, ids=[f"{n}-{w}" for n, _, w in BAD])
def test_bad_parameters_name_themselves(name, params, word):
    with pytest.raises(ValueError, match=rf"^{word}="):
        policy_loss(name, *rival_batch(0), **params)


# ----------------------------------------------------- M2PO under decoupled PPO (issue 34, fix 2)


def areal_m2po_decoupled(log_prob, behav, prox, advantages, loss_mask, *, m2_threshold, eps, agg):
    """AReaL's grpo_loss_fn with use_decoupled_loss (prox_logp recomputed), m2_threshold set and
    no weight cap, restated: the M2PO mask from (log pi_behav - log pi_prox)^2
    (`_apply_m2po_masking(old_logp, prox_logp, ...)`), then ppo_actor_loss_fn's ratio against
    pi_prox times the behaviour weight pi_prox / pi_behav."""
    delta = behav - prox
    m2 = delta * delta
    mask_flat = loss_mask.reshape(-1)
    sorted_m2, indices = torch.sort(m2.reshape(-1)[mask_flat], descending=True)
    kept_sorted = areal_m2po_mask(sorted_m2, m2_threshold)[torch.argsort(indices)]
    full = torch.zeros_like(mask_flat)
    full[mask_flat] = kept_sorted
    kept = full.view_as(loss_mask)
    ratio = torch.exp(log_prob - prox)
    pg_loss = -advantages * ratio
    if eps is not None:
        pg_loss = torch.max(pg_loss, -advantages * torch.clamp(ratio, 1.0 - eps, 1.0 + eps))
    pg_loss = pg_loss * torch.exp(prox - behav)  # behave_imp_weight, no cap
    return reduce(pg_loss, kept, agg), kept


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("agg", AGGREGATIONS)
@pytest.mark.parametrize("eps", [None, 0.2])
def test_m2po_under_recompute_masks_what_areal_masks(eps, agg, kind):
    """Under trainer.old_logprob=recompute the loss divides by pi_prox, and at the first update on
    a batch pi_theta = pi_prox: the second moment against pi_prox is 0 and masked nothing (the
    bug). AReaL takes it between the behaviour and the proximal policy."""
    log_prob, behav, adv, mask = rival_batch(43, kind, stale=0.4)
    prox = log_prob.clone()  # the first update on the batch: the current weights are pi_prox
    weight = torch.exp(prox - behav)  # what the trainer multiplies the advantages by (cap: off)
    params = {"m2_threshold": 0.04, "eps_low": eps, "eps_high": eps, "dual_clip": None}
    lp = log_prob.clone().requires_grad_()
    loss, m = policy_loss(
        "m2po", lp, prox, adv[:, None] * weight, mask, agg=agg, behav_log_prob=behav, **params
    )
    loss.backward()
    want, want_grad = ref_value_and_grad(
        lambda x, *a: areal_m2po_decoupled(x, *a, m2_threshold=0.04, eps=eps, agg=agg)[0],
        log_prob,
        behav,
        prox,
        adv[:, None].expand_as(mask),
        mask,
    )
    assert loss.item() == pytest.approx(want.item(), rel=1e-12, abs=1e-15)
    torch.testing.assert_close(lp.grad, torch.where(mask, want_grad, 0.0), rtol=1e-10, atol=1e-14)
    _, kept = areal_m2po_decoupled(
        log_prob,
        behav,
        prox,
        adv[:, None].expand_as(mask),
        mask,
        m2_threshold=0.04,
        eps=eps,
        agg=agg,
    )
    dropped = mask & ~kept
    assert bool(dropped.any())  # AReaL masks here; against pi_prox nothing would be
    assert m["clipfrac_low"].item() + m["clipfrac_high"].item() > 0
    # without the behaviour log-probs (old_log_prob = pi_theta) the second moment is 0
    _, _, none = loss_and_grad("m2po", log_prob, prox, adv, mask, **params)
    assert none["clipfrac_low"].item() == none["clipfrac_high"].item() == 0.0

"""Issue 45's losses against their references restated here and differentiated by autograd: TOPR
(the paper's Eq. 8; verl PR 6986's and Trinity-RFT's variants), DCPO (lime-RL/DCPO's
`compute_policy_loss_dcpo` with `get_clip_low_high`), VESPO (TRL's `get_gamma_weights` and its
vespo loss) and LUSPO (TRL's luspo branch). Value and gradient on random batches with an empty
row and ragged lengths, every aggregation, all-positive and all-negative advantages; the issue's
worked examples; non-finite and overflowing weights; and the presets' agreement with their
references' settings."""

from __future__ import annotations

import math

import pytest
import torch

from bapo_cli.algos import dcpo as dcpo_module
from bapo_cli.algos.losses import AGGREGATIONS, policy_loss
from tests.algos.test_losses import LOSS_METRICS, loss_and_grad
from tests.algos.test_rivals import KINDS, check, reduce, rival_batch

# ---------------------------------------------------------------------------------------- TOPR


def paper_topr(log_prob, old, advantages, mask, *, agg):
    """TOPR's Eq. (8), written out: a sequence of A >= 0 is REINFORCE on log pi(tau); one of
    A < 0 carries [pi(tau) / mu(tau)]_0^1 = min(prod_t r_t, 1), detached."""
    log_w = torch.where(mask, log_prob - old, 0.0).sum(-1, keepdim=True).detach()
    alpha = torch.where(advantages < 0, torch.clamp(torch.exp(log_w), 0.0, 1.0), 1.0)
    return reduce(-alpha * advantages * log_prob, mask, agg)


def verl_pr_topr(log_prob, old, advantages, mask, *, agg):
    """verl PR 6986 (unmerged), from its description: A < 0 sequences weighted by the
    length-normalised sequence ratio exp(mean_t log r_t) tapered to [0, 1], stop-gradient."""
    n = mask.sum(-1, keepdim=True).clamp(min=1)
    log_w = (torch.where(mask, log_prob - old, 0.0).sum(-1, keepdim=True) / n).detach()
    alpha = torch.where(advantages < 0, torch.clamp(torch.exp(log_w), 0.0, 1.0), 1.0)
    return reduce(-alpha * advantages * log_prob, mask, agg)


def trinity_topr(log_prob, old_logprob, advantages, mask, *, agg, advantage_threshold=0.0):
    """Trinity-RFT's TOPRPolicyLossFn.__call__ (trinity/algorithm/policy_loss_fn/
    topr_policy_loss.py), restated: alpha = clamp(r_t, 0, 1) if A <= threshold else 1."""
    rewards = advantages
    ratio = torch.exp(log_prob - old_logprob)
    ratio_clamped = torch.clamp(ratio, min=0.0, max=1.0)
    alpha = torch.where(rewards <= advantage_threshold, ratio_clamped, torch.ones_like(ratio))
    topr_loss = -alpha.detach() * rewards * log_prob
    return reduce(topr_loss, mask, agg)


TOPR_REFS = {"trajectory": paper_topr, "geometric": verl_pr_topr, "token": trinity_topr}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("agg", AGGREGATIONS)
@pytest.mark.parametrize("ratio", list(TOPR_REFS))
def test_topr_matches_its_references(ratio, agg, kind):
    def ref(*args):
        return TOPR_REFS[ratio](*args, agg=agg)

    log_prob, old, adv, mask, grad, m = check("topr", {"ratio": ratio}, ref, kind, agg, seed=53)
    log_r = torch.where(mask, log_prob - old, 0.0)
    if ratio == "token":
        below = log_r < 0
    else:
        seq = log_r.sum(-1, keepdim=True)
        below = (seq < 0).expand_as(mask)
    tapered = mask & (adv < 0)[:, None] & below
    assert m["clipfrac_low"].item() == pytest.approx(tapered.sum().item() / mask.sum().item())
    if kind != "all_positive":  # some negative tokens were tapered, some were not
        assert bool(tapered.any()) and bool((mask & (adv < 0)[:, None] & ~below).any())
        assert bool((grad[mask & (adv < 0)[:, None]] != 0).all())  # tapered, never zeroed
    assert m["clipfrac_high"].item() == 0.0 and m["c_low"].item() == 0.0


# the issue's example: one negative sequence (A = -1) whose two tokens have ratios 2 and 0.25
EXAMPLE = {
    "trajectory": ("seq-mean-token-sum", [0.5, 0.5]),  # the paper: W = 0.5 on log pi(tau)
    "geometric": ("seq-mean-token-mean", [math.sqrt(0.5) / 2] * 2),  # verl PR: 0.354 each
    "token": ("token-mean", [0.5, 0.125]),  # Trinity: (min(2, 1), 0.25) / 2
}


@pytest.mark.parametrize("ratio", list(EXAMPLE))
def test_topr_the_issues_example_per_variant(ratio):
    old = torch.tensor([[-1.0, -1.0]], dtype=torch.float64)
    log_prob = old + torch.tensor([[2.0, 0.25]], dtype=torch.float64).log()
    adv, mask = torch.tensor([-1.0], dtype=torch.float64), torch.ones(1, 2, dtype=torch.bool)
    agg, want = EXAMPLE[ratio]
    _, grad, _ = loss_and_grad("topr", log_prob, old, adv, mask, ratio=ratio, agg=agg)
    torch.testing.assert_close(grad[0], torch.tensor(want, dtype=torch.float64))
    # the preset's form is the paper's: its default ratio and its loss's default aggregation
    _, preset, _ = loss_and_grad("topr", log_prob, old, adv, mask)
    assert preset[0].tolist() == pytest.approx([0.5, 0.5], rel=1e-12)
    # a sign slip would pull the negative sequence up: its gradient pushes log pi down
    assert bool((grad > 0).all())


def test_topr_is_reinforce_on_policy_and_for_positives_however_stale():
    log_prob, old, adv, mask = rival_batch(52, stale=2.0)
    for ratio in TOPR_REFS:
        _, on, _ = loss_and_grad("topr", log_prob, log_prob.clone(), adv, mask, ratio=ratio)
        want = torch.where(mask, -adv[:, None] / mask.any(-1).sum(), 0.0)  # -A / n_seqs
        torch.testing.assert_close(on, want)
    pos = adv > 0
    _, stale, _ = loss_and_grad("topr", log_prob, old, adv, mask)
    torch.testing.assert_close(stale[pos], on[pos])  # no importance weight on positives


# ---------------------------------------------------------------------------------------- DCPO


def dcpo_get_clip_low_high(ref_logprob, low_clip=0.1, high_clip=0.2, clip_ratio_c=math.inf):
    """lime-RL/DCPO@01787b0 `get_clip_low_high`, restated."""
    ref_prob = torch.exp(ref_logprob)
    low_c_ref = torch.where(ref_prob != 0, 4 * low_clip / ref_prob, 0)
    low_c_ref = 1 - low_c_ref
    low_c_ref = low_c_ref * (low_c_ref >= 0)
    high_c_ref = torch.where(ref_prob != 0, 1 + 4 * high_clip / ref_prob, float("inf"))
    low = (1 + torch.sqrt(low_c_ref)) / 2
    high = (1 + torch.sqrt(high_c_ref)) / 2
    clip_ratio_c = max(clip_ratio_c, 10)
    return low, torch.clamp(high, 0, clip_ratio_c)


def dcpo_policy_loss(old_log_prob, log_prob, advantages, mask, *, low, high, c, agg):
    """`compute_policy_loss_dcpo` with clip_type="dynamic", restated (its agg_loss replaced by
    the project's aggregation, `reduce`)."""
    negative_approx_kl = log_prob - old_log_prob
    ratio = torch.exp(negative_approx_kl)
    pg_losses1 = -advantages * ratio
    cliprange_low, cliprange_high = dcpo_get_clip_low_high(old_log_prob, low, high, c)
    pg_losses2 = -advantages * torch.clamp(ratio, cliprange_low, cliprange_high)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    pg_losses3 = -advantages * c
    clip_pg_losses2 = torch.min(pg_losses3, clip_pg_losses1)
    pg_losses = torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1)
    return reduce(pg_losses, mask, agg)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("agg", AGGREGATIONS)
@pytest.mark.parametrize(("low", "high"), [(0.2, 0.28), (0.16, 0.2)])
def test_dcpo_matches_the_authors_loss(low, high, agg, kind):
    params = {"eps_low": low, "eps_high": high, "bound_cap": 10.0, "dual_clip": 10.0}

    def ref(log_prob, old, adv, mask):
        return dcpo_policy_loss(old, log_prob, adv, mask, low=low, high=high, c=10.0, agg=agg)

    log_prob, old, adv, mask, grad, m = check("dcpo", params, ref, kind, agg, seed=61, stale=1.2)
    lo, hi = dcpo_get_clip_low_high(old, low, high, 10.0)
    r = torch.exp(log_prob - old)
    sign = adv[:, None].expand_as(mask)
    clipped = mask & (((sign > 0) & (r >= hi)) | ((sign < 0) & (r <= lo)))
    assert bool(clipped.any()) and bool((grad[clipped] == 0).all())
    assert m["c_low"].item() == pytest.approx(lo[mask].mean().item())
    assert m["c_high"].item() == pytest.approx(hi[mask].mean().item())


def test_dcpo_bounds_are_the_readmes_table():
    """README of lime-RL/DCPO: eps 0.16 / 0.2; at q = 0.9 the new probability may go to 0.69 /
    min(1.06, 1), at q = 0.01 to 0.005 / 0.05; PPO's [0.8, 1.2] would give 0.008 / 0.012."""
    q = torch.tensor([0.9, 0.01], dtype=torch.float64)
    lo, hi = dcpo_module.dynamic_bounds(q.log(), 0.16, 0.2, cap=10.0)
    assert (q * lo).tolist() == pytest.approx([0.692, 0.005], abs=5e-4)
    assert (q * hi).tolist() == pytest.approx([1.068, 0.05], abs=5e-3)
    # a likely token keeps about PPO's range, a rare one a much wider one, up to the cap
    lo, hi = dcpo_module.dynamic_bounds(torch.tensor([0.0, -20.0]), 0.2, 0.28, cap=10.0)
    assert lo.tolist() == pytest.approx([(1 + math.sqrt(0.2)) / 2, 0.5])
    assert hi.tolist() == pytest.approx([(1 + math.sqrt(2.12)) / 2, 10.0])
    # q = 0 (exp underflows): c_low 1 and c_high the cap, as the reference
    lo, hi = dcpo_module.dynamic_bounds(torch.tensor([-math.inf]), 0.2, 0.28, cap=10.0)
    assert (lo.item(), hi.item()) == (1.0, 10.0)


def test_dcpo_otm_as_the_recipe_runs_it_is_seq_mean_token_mean():
    """run_dcpo.sh: loss_agg_mode=only-token-mean (at 01787b0 `masked_mean(loss_mat, mask)`
    over a micro-batch; the masked *sum* before commit 2778707), dynamic batches of about one
    response, each micro-batch's loss times its sequences / the mini-batch's (dp_actor.py,
    use_dynamic_bsz): a mean over sequences of token means."""
    log_prob, old, adv, mask = rival_batch(62, stale=0.8)
    rows = [i for i in range(mask.shape[0]) if mask[i].any()]
    pg = torch.where(mask, -adv[:, None] * torch.exp(log_prob - old), 0.0)
    otm = sum(pg[i][mask[i]].mean() * (1 / len(rows)) for i in rows)  # masked_mean per response
    assert otm.item() == pytest.approx(reduce(pg, mask, "seq-mean-token-mean").item(), rel=1e-12)
    otm_sum = sum(pg[i][mask[i]].sum() * (1 / len(rows)) for i in rows)  # the masked-sum version
    assert otm_sum.item() == pytest.approx(reduce(pg, mask, "seq-mean-token-sum").item())


# --------------------------------------------------------------------------------------- VESPO


def trl_gamma_weights(advantages, log_ratio_per_token, mask, k_pos, lambda_pos, k_neg, lambda_neg):
    """TRL's GRPOTrainer.get_gamma_weights (huggingface/trl@f2cd577), restated, without vLLM's
    importance_sampling_ratio; [B, 1], no gradient."""
    with torch.no_grad():
        lower_clamp = math.log(1e-8)
        log_ratio_clamped = torch.clamp(log_ratio_per_token, -20.0, 20.0)
        seq_log_ratio = torch.sum(log_ratio_clamped * mask, dim=-1, keepdim=True)
        log_w_seq = torch.clamp(seq_log_ratio, lower_clamp, 20.0)
        w_seq = torch.exp(log_w_seq)
        is_nonneg_adv = advantages >= 0
        k_seq = torch.where(is_nonneg_adv, k_pos, k_neg)
        lambda_seq = torch.where(is_nonneg_adv, lambda_pos, lambda_neg).clamp(min=1e-4)
        log_phi = lambda_seq + k_seq * log_w_seq - lambda_seq * w_seq
        return torch.exp(log_phi).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def trl_vespo(log_prob, old, advantages, mask, *, agg, k=(2.0, 3.0, 3.0, 2.0)):
    """TRL's vespo loss: -phi(w) * A * log pi per token (advantages [B, 1] there, one per
    sequence: here the row's first one), reduced by the project's aggregation."""
    adv = advantages[:, :1]
    phi = trl_gamma_weights(adv, log_prob - old, mask.double(), *k)
    return reduce(-phi * adv * log_prob, mask, agg)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("agg", AGGREGATIONS)
@pytest.mark.parametrize("stale", [0.3, 1.5])
def test_vespo_matches_trl(stale, agg, kind):
    def ref(*args):
        return trl_vespo(*args, agg=agg)

    log_prob, old, adv, mask, grad, m = check("vespo", {}, ref, kind, agg, seed=71, stale=stale)
    signed = mask & (adv != 0)[:, None]
    assert bool((grad[signed] != 0).all()) or stale > 1  # no clip: every token trains ...
    assert m["clipfrac_low"].item() == m["clipfrac_high"].item() == 0.0


def test_vespo_phi_is_one_on_policy_and_its_asymmetry():
    log_prob, _, adv, mask = rival_batch(72)
    _, on, _ = loss_and_grad("vespo", log_prob, log_prob.clone(), adv, mask, agg="token-mean")
    want = torch.where(mask, -adv[:, None] / mask.sum(), 0.0)  # phi(1) = 1: REINFORCE
    torch.testing.assert_close(on, want)
    # one token, log w = log 2: phi_pos(2) = e^3 2^2 e^-6 = 0.199, phi_neg(2) = e^2 2^3 e^-4
    old = torch.zeros(2, 1, dtype=torch.float64)
    lp = torch.full((2, 1), math.log(2.0), dtype=torch.float64)
    adv2, one = torch.tensor([1.0, -1.0], dtype=torch.float64), torch.ones(2, 1, dtype=torch.bool)
    _, grad, m = loss_and_grad("vespo", lp, old, adv2, one, agg="seq-mean-token-sum")
    phi_pos, phi_neg = math.exp(3 - 6) * 4, math.exp(2 - 4) * 8
    assert grad[:, 0].tolist() == pytest.approx([-phi_pos / 2, phi_neg / 2])
    assert m["c_high"].item() == pytest.approx(2.0)  # the largest sequence weight


def test_vespo_weights_never_overflow():
    """log w far out in both directions: phi is 0 (w -> 0 or huge), never inf or NaN; a token
    the policy gives probability 0 (log pi = -inf) carries nothing, not 0 * inf."""
    old = torch.zeros(4, 3, dtype=torch.float64)
    lp = torch.tensor(
        [[300.0, 300.0, 300.0], [-300.0, -1.0, 0.0], [1e4, -1e4, 0.5], [-math.inf, 0.1, 0.2]],
        dtype=torch.float64,
    )
    adv, mask = torch.tensor([1.0, -1.0, 1.0, -1.0], dtype=torch.float64), old == 0
    loss, grad, m = loss_and_grad("vespo", lp, old, adv, mask)
    assert torch.isfinite(loss) and bool(torch.isfinite(grad).all())
    assert grad[0].abs().max().item() == 0.0  # log w = 20: phi underflows to 0
    assert grad[3, 0].item() == 0.0  # pi = 0: no 0 * inf
    assert m["nonfinite_tokens"].item() == 1.0  # r = e^10000 = inf: out of the mask and of w
    want = trl_vespo(lp[:3], old[:3], adv[:3, None].expand(3, 3), mask[:3], agg="token-mean")
    assert math.isfinite(want.item())


# --------------------------------------------------------------------------------------- LUSPO


def trl_luspo(log_prob, old, advantages, mask, *, eps_low, eps_high):
    """TRL's luspo branch (importance_sampling_level="sequence"), restated: coef_1 is the
    length-normalised sequence ratio, with gradient; (per_token_loss * |y_i|).mean() over B."""
    log_ratio = log_prob - old
    m = mask.double()
    log_importance_weights = (log_ratio * m).sum(-1) / m.sum(-1).clamp(min=1.0)
    coef_1 = torch.exp(log_importance_weights.unsqueeze(-1))
    coef_2 = torch.clamp(coef_1, 1 - eps_low, 1 + eps_high)
    adv = advantages[:, :1]
    per_token_loss = -torch.min(coef_1 * adv, coef_2 * adv)  # (B, 1)
    return (per_token_loss * m.sum(1, keepdim=True)).mean()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("eps_low", "eps_high"), [(2e-3, 2.5e-3), (0.05, 0.08)])
def test_luspo_matches_trl(eps_low, eps_high, kind):
    params = {"eps_low": eps_low, "eps_high": eps_high}
    rows = rival_batch(81, kind, stale=0.05)[3].any(-1)

    def ref(*args):  # TRL's .mean() counts every row; the project's mean, rows with a token
        return trl_luspo(*args, eps_low=eps_low, eps_high=eps_high) * len(rows) / rows.sum()

    log_prob, old, adv, mask, grad, m = check(
        "luspo", params, ref, kind, "seq-mean-token-sum", seed=81, stale=0.05
    )
    s = torch.exp(torch.where(mask, log_prob - old, 0.0).sum(-1) / mask.sum(-1).clamp(min=1))
    sign = adv[:, None].expand_as(mask)
    clipped = mask & (
        ((sign > 0) & (s[:, None] >= 1 + eps_high)) | ((sign < 0) & (s[:, None] <= 1 - eps_low))
    )
    if eps_low < 0.01:
        assert bool(clipped.any()) and bool((grad[clipped] == 0).all())


def test_luspo_is_gspo_times_each_sequences_length():
    log_prob, old, adv, mask = rival_batch(82, stale=0.02)
    params = dict(eps_low=0.05, eps_high=0.05, dual_clip=None)
    _, g_luspo, _ = loss_and_grad("luspo", log_prob, old, adv, mask, **params)
    _, g_gspo, _ = loss_and_grad("gspo", log_prob, old, adv, mask, **params)  # token means
    lengths = mask.sum(-1, keepdim=True).double()
    torch.testing.assert_close(g_luspo, g_gspo * lengths)


@pytest.mark.parametrize("name", ["topr", "dcpo", "vespo", "luspo"])
def test_empty_batches_and_flat_tokens(name):
    log_prob, old, adv, mask = rival_batch(91)
    loss, grad, m = loss_and_grad(name, log_prob, old, adv, torch.zeros_like(mask))
    assert loss.item() == 0.0 and bool((grad == 0).all()) and set(m) == LOSS_METRICS
    flat = dict(log_prob=log_prob.flatten(), old_log_prob=old.flatten(), mask=mask.flatten())
    flat["advantages"] = adv[:, None].expand_as(mask).flatten()
    if name in ("topr", "dcpo"):  # per token (TOPR's per-token ratio): flat tensors allowed
        extra = {"ratio": "token"} if name == "topr" else {}
        policy_loss(name, **flat, **extra, agg="token-mean")
    else:
        with pytest.raises(ValueError, match=r"\[B, T\]"):
            policy_loss(name, **flat)


BAD = [
    ("topr", dict(ratio="sequence"), "ratio"),
    ("dcpo", dict(eps_low=0.0), "eps_low"),
    ("dcpo", dict(eps_high=-1.0), "eps_high"),
    ("dcpo", dict(bound_cap=1.0), "bound_cap"),
    ("dcpo", dict(dual_clip=0.5), "dual_clip"),
    ("vespo", dict(lambda_pos=0.0), "lambda_pos"),
    ("vespo", dict(k_neg=-1.0), "k_neg"),
    ("luspo", dict(eps_low=1.5), "eps_low"),
]


@pytest.mark.parametrize("name, params, word", BAD, ids=[f"{n}-{w}" for n, _, w in BAD])
def test_bad_parameters_name_themselves(name, params, word):
    with pytest.raises(ValueError, match=word):
        policy_loss(name, *rival_batch(0), **params)

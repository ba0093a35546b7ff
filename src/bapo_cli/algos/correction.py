"""Off-policy masking, beside TIS/MIS (`rollout.seq_mask`): a whole response, or a token, stops
training when it comes from a policy too far from the one being trained. Pure functions on
tensors; the trainer (`trainer/off_policy.py`) gives them the per-token log-ratio (or log-probs)
the rule reads and multiplies the advantages by the 0/1 result.

    geo    (verl rollout_corr's geometric rejection, TRL's geometric mask): keep sequence i iff
           1 / threshold <= exp(mean_t log(pi_trainer(y_t) / pi_engine(y_t))) <= threshold;
           the engine/trainer mismatch TIS corrects, judged per sequence by its geometric mean.
    opsm   (DeepSeek-V3.2's off-policy sequence masking; TRL's off_policy_mask_threshold): drop
           sequence i iff A_i < 0 and mean_t log(pi_old(y_t) / pi_theta(y_t)) > threshold, the
           mean token KL estimate between the policy that sampled it and the current one. Only
           negative sequences: a positive one far off-policy still says what to do more of,
           while a negative one mostly pushes down tokens the current policy no longer makes.
           With per-token (TIS-weighted) advantages the sign is read per token, as TRL does.
    icepop (IcePop, Ring-1T's arXiv 2510.18855): keep token t iff
           low <= pi_trainer(y_t) / pi_engine(y_t) <= threshold (IcePop's band: [0.5, 5]): the
           same mismatch as geo, judged per token, asymmetric.
    kpop   (AReaL's KPop, `rejection_sampling.metric=binary_kl`): drop token t iff the larger of
           KL(Ber(p) || Ber(q)) and KL(Ber(q) || Ber(p)) exceeds threshold (KPop: 2.0), with
           p = pi_prox(y_t), q = pi_behav(y_t), the token's probability as a Bernoulli (it or
           another one): AReaL's rejection sampling compares the proximal policy with the
           behaviour one. A rare token whose ratio is 10 (0.001 -> 0.01, KL 0.014) is kept, a
           likely one that collapsed (0.95 -> 0.01, KL 4.2) is dropped.

A rejected sequence or token keeps its place in the loss's normaliser at weight 0, as this
project's masked TIS does (`rollout.tis_mode=mask`); verl's rejection takes them out of the
denominator instead. AReaL's rejection sampling keeps them in (its loss divides by the loss mask
counted before rejection), and so does IcePop's objective (its mask multiplies the token's term
inside the 1/|y| sums). docs/algorithms.md says why.
"""

from __future__ import annotations

import math

import torch

Tensor = torch.Tensor

# rollout.seq_mask values; "none" = off
SEQ_MASKS = ("none", "geo", "opsm", "icepop", "kpop")
TOKEN_MASKS = ("icepop", "kpop")  # decided per token, whatever the advantages' shape


def mean_log_ratio(log_ratio: Tensor, mask: Tensor) -> Tensor:
    """Per sequence [B]: the mean of `log_ratio` over its tokens in `mask` (0 for an empty row)."""
    n = mask.sum(dim=-1).clamp(min=1).to(log_ratio.dtype)
    return torch.where(mask, log_ratio, 0.0).sum(dim=-1) / n


def geo_keep(log_ratio: Tensor, mask: Tensor, threshold: float) -> Tensor:
    """Bool [B]: sequences whose geometric-mean ratio lies within [1/threshold, threshold]
    (compared in log space: |mean log ratio| <= log threshold)."""
    bound = math.log(float(threshold))
    mean = mean_log_ratio(log_ratio, mask)
    return (mean >= -bound) & (mean <= bound)


def opsm_keep(log_ratio: Tensor, advantages: Tensor, mask: Tensor, threshold: float) -> Tensor:
    """DeepSeek-V3.2's rule, TRL's `get_off_policy_mask`; log_ratio = log pi_old - log pi_theta
    per token. Advantages per sequence [B] give a bool [B] (drop sequence i iff A_i < 0 and its
    mean log ratio > threshold). Advantages per token [B, T] give a bool [B, T], decided per
    token as TRL does with a per-token advantage: drop token t of sequence i iff A_it < 0 and
    sequence i's mean log ratio > threshold.

    Per token, not from one token of the row: after masked TIS (`rollout.tis_mode=mask`) a token
    over the cap has weighted advantage 0, so the sign of one chosen token (the first valid one,
    as this function read it before) can say "not negative" while the row's other tokens are
    negative: the far-off-policy negative sequence then escaped the mask. A per-sequence
    advantage times positive per-token weights has that advantage's sign on every token whose
    weight is not 0, so per token is the sequence's sign before weighting wherever it matters."""
    far = mean_log_ratio(log_ratio, mask) > float(threshold)  # [B]
    if advantages.dim() == 1:
        return ~((advantages < 0) & far)
    return ~((advantages < 0) & far[:, None])


def icepop_keep(log_ratio: Tensor, low: float, high: float) -> Tensor:
    """Bool, log_ratio's shape: tokens whose ratio lies within [low, high] (compared in log
    space; a NaN log-ratio is outside)."""
    return (log_ratio >= math.log(float(low))) & (log_ratio <= math.log(float(high)))


def bernoulli_kl(log_p: Tensor, log_q: Tensor) -> Tensor:
    """KL(Ber(p) || Ber(q)) per element from log-probabilities, in float64:
    p log(p / q) + (1 - p) log((1 - p) / (1 - q)), with 0 log 0 = 0; +inf where q gives 0 (or
    1 - q gives 0) to what p does not, NaN for a log-probability above 0 or NaN."""
    lp, lq = log_p.double(), log_q.double()
    p, one_minus_p = torch.exp(lp), -torch.expm1(lp)
    log1m_p, log1m_q = torch.log(one_minus_p), torch.log(-torch.expm1(lq))
    first = torch.where(p == 0, 0.0, p * (lp - lq))
    second = torch.where(one_minus_p == 0, 0.0, one_minus_p * (log1m_p - log1m_q))
    return first + second


def kpop_keep(log_p: Tensor, log_q: Tensor, threshold: float) -> Tensor:
    """Bool, log_p's shape: tokens whose Bernoulli KL, the larger of both directions, is at most
    `threshold` (a NaN or infinite KL is dropped)."""
    worst = torch.maximum(bernoulli_kl(log_p, log_q), bernoulli_kl(log_q, log_p))
    return (worst <= float(threshold)).to(log_p.device)


def sequence_keep(
    kind: str,
    threshold: float,
    advantages: Tensor,
    mask: Tensor,
    log_ratio: Tensor,
    *,
    low: float | None = None,
    log_q: Tensor | None = None,
) -> Tensor:
    """Bool: what the rule keeps, [B] per sequence, or [B, T] per token (opsm with per-token
    advantages, `opsm_keep`; icepop and kpop always). kind: "geo", "opsm", "icepop" (low: the
    ratio's lower bound, default 1 / threshold) or "kpop" (log_ratio = log p - log q and log_q
    the log-probs q)."""
    if kind == "geo":
        return geo_keep(log_ratio, mask, threshold)
    if kind == "opsm":
        return opsm_keep(log_ratio, advantages, mask, threshold)
    if kind == "icepop":
        return icepop_keep(log_ratio, 1.0 / float(threshold) if low is None else low, threshold)
    if kind == "kpop":
        if log_q is None:
            raise ValueError("seq_mask kpop needs log_q, the log-probs the log-ratio divides by")
        return kpop_keep(log_q + log_ratio, log_q, threshold)
    raise ValueError(f"unknown seq_mask {kind!r}; valid: {', '.join(SEQ_MASKS[1:])}")


def apply_keep(advantages: Tensor, keep: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """(advantages with what `keep` rejects at 0, the sequences kept [B] bool: a sequence counts
    as kept iff no valid token of it was dropped). `advantages` [B] or [B, T] keeps its shape,
    except that a per-token `keep` makes [B] advantages [B, T]."""
    if keep.dim() == 2:  # per token: zero the dropped tokens, report per sequence
        if advantages.dim() == 1:  # one advantage per sequence: now one per token
            advantages = advantages[:, None].expand(keep.shape)
        masked = torch.where(keep, advantages, torch.zeros_like(advantages))
        return masked, ~(~keep & mask).any(dim=-1)
    weight = keep.to(advantages.dtype)
    return advantages * (weight if advantages.dim() == 1 else weight[:, None]), keep


def mask_sequences(
    kind: str, threshold: float, advantages: Tensor, mask: Tensor, log_ratio: Tensor
) -> tuple[Tensor, Tensor]:
    """(advantages with rejected sequences at 0, keep [B] bool). `advantages` is [B] or [B, T]
    (already TIS-weighted); the result has the same shape (`sequence_keep`, `apply_keep`)."""
    return apply_keep(advantages, sequence_keep(kind, threshold, advantages, mask, log_ratio), mask)

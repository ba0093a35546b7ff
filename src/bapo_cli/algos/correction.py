"""Off-policy sequence masking, beside TIS/MIS (`rollout.seq_mask`): a whole response stops
training when its tokens, on average, come from a policy too far from the one being trained.
Pure functions on tensors; the trainer (`trainer/off_policy.py`) gives them the per-token
log-ratio the rule reads and multiplies the advantages by the 0/1 result.

    geo   (verl rollout_corr's geometric rejection, TRL's geometric mask): keep sequence i iff
          1 / threshold <= exp(mean_t log(pi_trainer(y_t) / pi_engine(y_t))) <= threshold;
          the engine/trainer mismatch TIS corrects, judged per sequence by its geometric mean.
    opsm  (DeepSeek-V3.2's off-policy sequence masking; TRL's off_policy_mask_threshold): drop
          sequence i iff A_i < 0 and mean_t log(pi_old(y_t) / pi_theta(y_t)) > threshold, the
          mean token KL estimate between the policy that sampled it and the current one. Only
          negative sequences: a positive one far off-policy still says what to do more of,
          while a negative one mostly pushes down tokens the current policy no longer makes.
          With per-token (TIS-weighted) advantages the sign is read per token, as TRL does.

A rejected sequence keeps its tokens in the loss's normaliser at weight 0, as this project's
masked TIS does (`rollout.tis_mode=mask`); verl's rejection takes them out of the denominator
instead. docs/algorithms.md says why.
"""

from __future__ import annotations

import math

import torch

Tensor = torch.Tensor

# rollout.seq_mask values; "none" = off
SEQ_MASKS = ("none", "geo", "opsm")


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


def sequence_keep(
    kind: str, threshold: float, advantages: Tensor, mask: Tensor, log_ratio: Tensor
) -> Tensor:
    """Bool: what the rule keeps, [B] per sequence, or [B, T] per token (opsm with per-token
    advantages, `opsm_keep`). kind: "geo" or "opsm"."""
    if kind == "geo":
        return geo_keep(log_ratio, mask, threshold)
    if kind == "opsm":
        return opsm_keep(log_ratio, advantages, mask, threshold)
    raise ValueError(f"unknown seq_mask {kind!r}; valid: {', '.join(SEQ_MASKS[1:])}")


def apply_keep(advantages: Tensor, keep: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """(advantages with what `keep` rejects at 0, the sequences kept [B] bool: a sequence counts
    as kept iff no valid token of it was dropped). `advantages` [B] or [B, T] keeps its shape."""
    if keep.dim() == 2:  # opsm per token: zero the dropped tokens, report per sequence
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

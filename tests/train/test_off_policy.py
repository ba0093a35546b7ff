"""`ratio_inputs` as a table: every `trainer.old_logprob` mode and the engine denominator, times
every correction (TIS / MIS per token and per sequence, the geo and opsm sequence masks, the
icepop and kpop token masks, decoupled PPO's behaviour weight, and their combinations), gives
per token the denominator and the weight that trainer/off_policy.py documents. The reference
below is written per token in plain Python from those rules, not from the module's tensor
code."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from bapo_cli.rollout.base import Sample
from bapo_cli.rollout.scoring import collate
from bapo_cli.trainer.off_policy import EngineLogProbs, OffPolicy, Prepared, ratio_inputs

VERSION = 2
# three responses: (trainer log-probs, engine log-probs, token versions, advantage); the third has
# no engine log-prob (a token without one weighs 1 and keeps the behaviour denominator)
ROWS = [
    ([-1.0, -2.0, -0.5], [-1.2, -1.5, -0.5], [0, 0, 1], 1.0),
    ([-0.3, -3.0], [-0.1, -3.2], [1, 1], -0.5),
    ([-2.0], [], [0], -2.0),
]
LOGP = [[-0.9, -2.2, -0.4], [-0.2, -2.5, 0.0], [-1.5, 0.0, 0.0]]  # this update's forward
PROX = [[-0.95, -2.1, -0.45], [-0.25, -2.8, 0.0], [-1.8, 0.0, 0.0]]  # recompute's forward
CURRENT = [[-0.8, -2.3, -0.5], [-0.5, -3.1, 0.0], [-2.0, 0.0, 0.0]]  # opsm's forward


def _batch():
    samples = [
        Sample([1, 2], i, None, [5 + j for j in range(len(lp))], list(lp), list(eng), list(v))
        for i, (lp, eng, v, _) in enumerate(ROWS)
    ]
    for s, row in zip(samples, ROWS, strict=True):
        s.advantage = row[3]
    return collate(samples, 0, torch.device("cpu"), torch.float64)


def _t(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64)


def _prepared(mode: OffPolicy, *, deferred=False, reused=False) -> Prepared:
    mb = _batch()
    return Prepared(
        mb,
        mb.advantages,
        None if deferred else mb.old_log_prob,
        deferred=deferred,
        proximal=_t(PROX) if mode.old_logprob == "recompute" else None,
        current=_t(CURRENT) if mode.seq_mask == "opsm" and not deferred else None,
        engine=EngineLogProbs.of(mb) if mode.reads_engine else None,
        reused=reused,
    )


def _tokens():
    """(row, column) of every response token."""
    return [(i, t) for i, row in enumerate(ROWS) for t in range(len(row[0]))]


def _reference(mode: OffPolicy, deferred=False, reused=False):
    """(denominator, behaviour or None, weight) per token, from the documented rules."""
    behav = {(i, t): (LOGP if deferred else [r[0] for r in ROWS])[i][t] for i, t in _tokens()}
    old, weight = {}, dict.fromkeys(_tokens(), 1.0)
    for i, t in _tokens():
        trainer, engine, versions, _ = ROWS[i]
        if mode.ratio_against == "inference":
            old[i, t] = engine[t] if t < len(engine) else behav[i, t]
        elif mode.old_logprob == "recompute":
            old[i, t] = PROX[i][t]
        elif mode.old_logprob == "loglinear":
            k = VERSION - versions[t]
            alpha = 1.0 - 1.0 / k if k > 0 else 0.0
            old[i, t] = behav[i, t] + alpha * (LOGP[i][t] - behav[i, t])
        else:
            old[i, t] = behav[i, t]
    if mode.tis_cap is not None:
        weight = _tis(mode)
    if mode.seq_mask != "none":
        for (i, t), keep in _seq_keep(mode, weight, behav, deferred, reused).items():
            weight[i, t] *= float(keep)
    proximal = mode.old_logprob in ("recompute", "loglinear") and mode.ratio_against == "old"
    if mode.behav_cap is not None and proximal:
        for key in _tokens():
            w = math.exp(old[key] - behav[key])
            weight[key] *= w if w <= mode.behav_cap else 0.0
    return old, (behav if proximal else None), weight


def _log_ratio(i: int, t: int) -> float:
    """log pi_trainer - log pi_engine of a token with both, else 0."""
    trainer, engine, _, _ = ROWS[i]
    return trainer[t] - engine[t] if t < len(engine) else 0.0


def _tis(mode: OffPolicy):
    cap, out = mode.tis_cap, {}
    for i, t in _tokens():
        if mode.tis_level == "sequence":
            r = math.exp(sum(_log_ratio(i, s) for s in range(len(ROWS[i][0]))))
        else:
            r = math.exp(_log_ratio(i, t))
        if mode.tis_mode == "truncate":
            out[i, t] = min(r, cap)
        elif mode.tis_mode == "mask":
            out[i, t] = r if r <= cap else 0.0
        else:
            out[i, t] = r if 1.0 / cap <= r <= cap else 0.0
    return out


def _seq_keep(mode: OffPolicy, weight, behav, deferred, reused):
    """Per token: geo keeps a sequence whose mean engine log-ratio is within +-log t; opsm drops
    a token whose advantage (times its weight so far) is negative in a sequence whose mean of
    log pi_old - log pi_theta exceeds t (pi_old: the proximal policy once a previous update
    recomputed it, else the behaviour policy; 0 when scoring was deferred)."""
    keep = {}
    for i, t in _tokens():
        n = len(ROWS[i][0])
        if mode.seq_mask == "geo":
            mean = sum(_log_ratio(i, s) for s in range(n)) / n
            keep[i, t] = abs(mean) <= math.log(mode.seq_mask_threshold)
            continue
        if mode.seq_mask == "icepop":  # this token's pi_trainer / pi_engine within the band
            low = mode.seq_mask_low or 1.0 / mode.seq_mask_threshold
            keep[i, t] = low <= math.exp(_log_ratio(i, t)) <= mode.seq_mask_threshold
            continue
        if mode.seq_mask == "kpop":  # pi_prox against pi_behav, Bernoulli KL both ways
            p, q = math.exp(PROX[i][t]), math.exp(behav[i, t])
            worst = max(_bernoulli_kl(p, q), _bernoulli_kl(q, p))
            keep[i, t] = worst <= mode.seq_mask_threshold
            continue
        ref = PROX if mode.old_logprob == "recompute" and reused else None
        diffs = [
            0.0 if deferred else (ref[i][s] if ref else behav[i, s]) - CURRENT[i][s]
            for s in range(n)
        ]
        negative = ROWS[i][3] * weight[i, t] < 0
        keep[i, t] = not (negative and sum(diffs) / n > mode.seq_mask_threshold)
    return keep


def _bernoulli_kl(p: float, q: float) -> float:
    return p * math.log(p / q) + (1.0 - p) * math.log((1.0 - p) / (1.0 - q))


TIS = dict(tis_cap=1.1)
GEO = dict(seq_mask="geo", seq_mask_threshold=1.105)
OPSM = dict(seq_mask="opsm", seq_mask_threshold=0.05)
CAP = dict(behav_cap=1.02)
ICEPOP = dict(seq_mask="icepop", seq_mask_threshold=1.2, seq_mask_low=0.7)
KPOP = dict(seq_mask="kpop", seq_mask_threshold=1e-3, old_logprob="recompute")
CASES = {
    "behaviour": dict(),
    "recompute": dict(old_logprob="recompute"),
    "loglinear": dict(old_logprob="loglinear"),
    "inference": dict(ratio_against="inference"),
    "tis-token-truncate": TIS,
    "tis-token-mask": dict(TIS, tis_mode="mask"),
    "tis-token-two-sided": dict(TIS, tis_mode="mask_two_sided"),
    "tis-sequence-truncate": dict(TIS, tis_level="sequence"),
    "tis-sequence-mask": dict(TIS, tis_level="sequence", tis_mode="mask"),
    "tis-sequence-two-sided": dict(TIS, tis_level="sequence", tis_mode="mask_two_sided"),
    "geo": GEO,
    "opsm": OPSM,
    "opsm-recompute": dict(OPSM, old_logprob="recompute"),
    "opsm-loglinear": dict(OPSM, old_logprob="loglinear"),
    "opsm-after-tis-mask": dict(OPSM, **TIS, tis_mode="mask"),
    "behav-cap-recompute": dict(CAP, old_logprob="recompute"),
    "behav-cap-loglinear": dict(CAP, old_logprob="loglinear"),
    "behav-cap-behaviour": dict(CAP),  # no proximal policy: no behaviour weight
    "tis-opsm-behav-cap-recompute": dict(TIS, **OPSM, **CAP, old_logprob="recompute"),
    "inference-tis-geo": dict(TIS, **GEO, ratio_against="inference"),
    "icepop": ICEPOP,
    "icepop-symmetric": dict(ICEPOP, seq_mask_low=None),
    "icepop-tis-loglinear": dict(ICEPOP, **TIS, old_logprob="loglinear"),
    "kpop": KPOP,
    "kpop-tis-behav-cap": dict(KPOP, **TIS, **CAP),
}


@pytest.mark.parametrize("deferred, reused", [(False, False), (True, False), (False, True)])
@pytest.mark.parametrize("case", list(CASES))
def test_every_mode_and_correction_gives_the_documented_ratio_and_weight(case, deferred, reused):
    mode = OffPolicy(**CASES[case])
    if deferred and mode.old_logprob == "recompute":
        pytest.skip("scoring is never deferred under recompute (BatchLayout.score)")
    p = _prepared(mode, deferred=deferred, reused=reused)
    inputs = ratio_inputs(p, mode, _t(LOGP).requires_grad_(), VERSION)
    old, behav, weight = _reference(mode, deferred, reused)
    mask = p.mb.mask
    assert inputs.mask is mask
    for i, t in _tokens():
        assert inputs.old_log_prob[i, t].item() == pytest.approx(old[i, t], abs=1e-12), (i, t)
        if behav is None:
            assert inputs.behav_log_prob is None
        else:
            assert inputs.behav_log_prob[i, t].item() == pytest.approx(behav[i, t], abs=1e-12)
        w = 1.0 if inputs.weights is None else inputs.weights[i, t].item()
        assert w == pytest.approx(weight[i, t], rel=1e-12), (i, t)
        adv = inputs.advantages[i] if inputs.advantages.dim() == 1 else inputs.advantages[i, t]
        assert adv.item() == pytest.approx(ROWS[i][3] * weight[i, t], rel=1e-12), (i, t)
    if inputs.weights is None:  # no correction: one advantage per sequence, as collated
        assert inputs.advantages is p.advantages
    else:  # a weight of 1 off the mask; the denominator needs no gradient
        assert bool((inputs.weights[~mask] == 1.0).all())
    assert not inputs.old_log_prob.requires_grad


def test_the_table_reaches_every_kind_of_weight():
    """The cases above are not all 1: each correction drops, caps or scales some token."""
    seen = set()
    for case, kwargs in CASES.items():
        _, _, weight = _reference(OffPolicy(**kwargs))
        seen |= {(case.split("-")[0], w == 0.0, w == 1.0) for w in weight.values()}
    for kind in ("tis", "geo", "opsm", "behav", "icepop", "kpop"):
        assert (kind, True, False) in seen, kind  # some token dropped
    assert ("tis", False, False) in seen and ("behav", False, False) in seen  # some scaled


def test_the_micro_batch_is_never_changed_after_collate():
    mb = _batch()
    with pytest.raises(dataclasses.FrozenInstanceError):
        mb.advantages = torch.zeros(3)  # type: ignore[misc]
    assert mb.advantages.tolist() == [row[3] for row in ROWS]  # collate read Sample.advantage
    before = {f.name: getattr(mb, f.name) for f in dataclasses.fields(mb)}
    mode = OffPolicy(**CASES["tis-opsm-behav-cap-recompute"])
    p = dataclasses.replace(_prepared(mode), mb=mb)
    ratio_inputs(p, mode, _t(LOGP), VERSION)
    for name, value in before.items():
        assert getattr(mb, name) is value, name

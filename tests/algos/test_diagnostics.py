"""Entropy-Clip Rule on a tabular softmax policy, and the quadrant table.

Tolerance: for a step of size eta the first-order prediction is off by O(eta^2) while the change
itself is O(eta), so the relative error is O(eta). We allow 2% relative error (observed: 0.12% for
the spec's tabular update with eta = 1e-4, 0.25% for a surrogate gradient step with eta = 1e-2).
"""

from __future__ import annotations

import pytest
import torch

from bapo_cli.algos.diagnostics import (
    ENTROPY_EFFECT,
    QUADRANT_KEYS,
    entropy_clip_prediction,
    predicted_entropy_change,
    quadrant_table,
    softmax_entropy,
)
from bapo_cli.algos.losses import policy_loss

V = 50
RTOL = 2e-2


def logits(seed, scale=2.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(V, generator=g, dtype=torch.float64) * scale


@pytest.mark.parametrize("seed", range(5))
def test_spec_form_predicts_the_tabular_update(seed):
    z = logits(seed)
    g = torch.Generator().manual_seed(100 + seed)
    adv = torch.randn(V, generator=g, dtype=torch.float64)
    active = torch.rand(V, generator=g) < 0.7
    eta = 1e-4
    predicted = entropy_clip_prediction(z, adv, active, eta)
    actual = softmax_entropy(z + eta * adv * active) - softmax_entropy(z)
    assert predicted.item() == pytest.approx(actual.item(), rel=RTOL)
    # a constant C added to A(y)X(y) does not change the prediction
    shifted = predicted_entropy_change(z, eta * (adv * active + 3.0))
    assert shifted.item() == pytest.approx(predicted.item(), rel=1e-9)


def surrogate_step(z, z_old, tokens, adv, name="bapo", eta=1e-3, **params):
    """One gradient step of the clipped surrogate on a tabular softmax policy; returns
    (delta logits, predicted dH, actual dH, loss metrics)."""
    z = z.clone().requires_grad_()
    log_prob = torch.log_softmax(z, -1)[tokens]
    old = torch.log_softmax(z_old, -1)[tokens]
    loss, metrics = policy_loss(
        name,
        log_prob[None],
        old[None],
        adv[None],
        torch.ones(1, len(tokens), dtype=torch.bool),
        **params,
    )
    loss.backward()
    delta = -eta * z.grad
    with torch.no_grad():
        predicted = predicted_entropy_change(z, delta)
        actual = softmax_entropy(z + delta) - softmax_entropy(z)
    return delta, predicted.item(), actual.item(), metrics


@pytest.mark.parametrize("seed", range(4))
def test_one_small_step_on_the_surrogate(seed):
    z_old = logits(seed)
    g = torch.Generator().manual_seed(200 + seed)
    z = z_old + torch.randn(V, generator=g, dtype=torch.float64) * 0.4  # a stale policy
    tokens = torch.multinomial(torch.softmax(z_old, -1), 400, replacement=True, generator=g)
    adv = torch.randn(400, generator=g, dtype=torch.float64)
    delta, predicted, actual, metrics = surrogate_step(z, z_old, tokens, adv, eta=1e-2)
    assert metrics["clipfrac_low"] + metrics["clipfrac_high"] > 0  # some tokens are clipped
    assert predicted == pytest.approx(actual, rel=RTOL)


@pytest.mark.parametrize("quadrant", sorted(ENTROPY_EFFECT))
def test_sign_table_of_the_four_quadrants(quadrant):
    prob, sign = quadrant.split("_")
    z = logits(9)
    y = int(z.argmax() if prob == "high" else z.argmin())
    tokens = torch.tensor([y])
    adv = torch.tensor([1.0 if sign == "pos" else -1.0], dtype=torch.float64)
    # on-policy: r = 1, every token active
    _, predicted, actual, _ = surrogate_step(z, z, tokens, adv, name="ppo")
    assert torch.sign(torch.tensor(actual)).item() == ENTROPY_EFFECT[quadrant]
    assert torch.sign(torch.tensor(predicted)).item() == ENTROPY_EFFECT[quadrant]
    # the quadrant table files the token under that quadrant
    lp = torch.log_softmax(z, -1)
    table = quadrant_table(
        lp[tokens][None],
        lp[tokens][None],
        adv[None],
        torch.ones(1, 1, dtype=torch.bool),
        bounds=(0.8, 1.2),
        threshold_log_prob=(lp.exp() * lp).sum(),
    )
    assert table[f"{quadrant}_active"].item() == 1.0
    assert table[f"{quadrant}_active_mass"].item() == 1.0


def test_clipped_tokens_do_not_move_entropy():
    z = logits(3)
    y = int(z.argmin())
    z_old = z.clone()
    z_old[y] -= 1.0  # r = pi / pi_old > e: a positive token far above c_high
    _, predicted, actual, m = surrogate_step(
        z, z_old, torch.tensor([y]), torch.tensor([1.0]).double(), name="ppo"
    )
    assert m["clipfrac_high"].item() == 1.0
    assert predicted == 0.0 and actual == 0.0


def test_quadrant_table_adds_up():
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(8, 16, generator=g) * 4
    lp = old + torch.randn(8, 16, generator=g) * 0.4
    adv = torch.randn(8, generator=g)
    mask = torch.rand(8, 16, generator=g) < 0.8
    table = quadrant_table(lp, old, adv, mask, bounds=(0.8, 1.28))
    counts = [table[k] for k in QUADRANT_KEYS]
    shares = [table[f"{k}_mass"] for k in QUADRANT_KEYS]
    assert set(table) == set(QUADRANT_KEYS) | {f"{k}_mass" for k in QUADRANT_KEYS}
    assert sum(counts).item() == mask.sum().item()  # no zero advantages here
    assert sum(shares).item() == pytest.approx(1.0)
    # active counts agree with the loss's clip fractions
    _, m = policy_loss("clip_higher", lp, old, adv, mask)
    clipped_high = table["high_pos_clipped"] + table["low_pos_clipped"]
    assert (clipped_high / mask.sum()).item() == pytest.approx(m["clipfrac_high"].item())

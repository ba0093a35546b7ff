"""Off-policy sequence masking at its call site (`trainer/optimize.py` `_prepare`): the masks the
pure functions compute (tests/algos/test_correction.py) reach the update, and each step says
how many sequences they dropped (`rollout/seq_masked_frac`)."""

from __future__ import annotations

import torch

from tests.train.conftest import run_train

# reuse k=2: the first mini-batch is on-policy, the second one update stale
STALE = ("algo=grpo", "staleness=2", "trainer.max_steps=2", "trainer.seed=3")


def _params(result) -> list[torch.Tensor]:
    from safetensors.torch import load_file

    state = load_file(str(result.checkpoint / "model.safetensors"))
    return [state[k] for k in sorted(state)]


def test_opsm_drops_stale_negative_sequences_and_only_those(tmp_path) -> None:
    plain = run_train(tmp_path, *STALE, name="plain")
    loose = run_train(
        tmp_path, *STALE, "rollout.seq_mask=opsm", "rollout.seq_mask_threshold=50", name="loose"
    )
    tight = run_train(
        tmp_path, *STALE, "rollout.seq_mask=opsm", "rollout.seq_mask_threshold=1e-9", name="tight"
    )
    assert "rollout/seq_masked_frac" not in plain.history[0]
    # a threshold no sequence reaches masks nothing: the same training, bit for bit
    assert [h["rollout/seq_masked_frac"] for h in loose.history] == [0.0, 0.0]
    for a, b in zip(_params(plain), _params(loose), strict=True):
        assert torch.equal(a, b)
    # a threshold of ~0 masks the negative sequences the first update moved away from, never in
    # the first (on-policy, log ratio exactly 0) mini-batch: at most half of each step's uses
    # (a step whose groups all scored alike has no negative advantage to mask)
    fracs = [h["rollout/seq_masked_frac"] for h in tight.history]
    assert all(0.0 <= f <= 0.5 for f in fracs) and max(fracs) > 0.0, fracs
    # 2 steps x 2 updates: until the first masked sequence, the same updates as without masks
    first = 2 * fracs.index(next(f for f in fracs if f > 0)) + 1  # that step's stale update
    assert tight.updates[:first] == plain.updates[:first]
    assert tight.updates[first]["grad_norm"] != plain.updates[first]["grad_norm"]


def test_geo_keeps_everything_on_the_trainers_own_log_probs(tmp_path) -> None:
    """With the transformers engine the behaviour log-probs are the trainer's own, so the
    engine/trainer mismatch geo judges is exactly 0: nothing is masked."""
    geo = run_train(tmp_path, *STALE, "rollout.seq_mask=geo", "rollout.seq_mask_threshold=1.001")
    assert [h["rollout/seq_masked_frac"] for h in geo.history] == [0.0, 0.0]

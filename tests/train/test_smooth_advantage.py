"""DCPO's smooth advantage standardisation in the loop (`algo.advantage=dcpo`, any preset): the
trainer keeps each prompt's reward statistics across steps (`Run.prompt_stats`), the second
time a prompt is drawn its advantages mix in the first step's rewards, and the statistics
survive a checkpoint and resume."""

from __future__ import annotations

import json

import torch

from bapo_cli.algos import advantages
from bapo_cli.trainer import checkpoint
from tests.train.conftest import run_train

# eight prompts, all drawn each step: step 2 draws every prompt of step 1 again
ARGS = ("algo=grpo", "algo.advantage=dcpo", "data.num_prompts=8", "trainer.log_samples=64")


def _table(ids, rewards, groups, prior=None):
    """(advantages, prompt id -> (steps seen, mean, std) after the step), from the estimator."""
    r, g = torch.tensor(rewards, dtype=torch.float64), torch.tensor(groups)
    adv, _ = advantages.dcpo(r, g, prior=prior)
    after = advantages.dcpo_history(r, g, prior=prior).tolist()
    return adv, dict(zip(ids, after, strict=True))


def test_the_second_draw_of_a_prompt_mixes_in_its_first_and_survives_resume(tmp_path) -> None:
    whole = run_train(tmp_path, *ARGS, "trainer.max_steps=2", name="whole")
    rows = [json.loads(line) for line in (whole.run_dir / "samples.jsonl").open()]
    first = [r for r in rows if r["step"] == 1]
    assert len(first) == 32
    _, after_first = _table(
        [r["id"] for r in first], [r["reward"] for r in first], [r["group"] for r in first]
    )
    batch = whole.last_batch
    ids = [s.problem.id for s in batch]
    assert set(ids) == set(after_first)  # every prompt drawn twice
    prior = torch.tensor([after_first[i] for i in ids], dtype=torch.float64)
    want, after_second = _table(ids, [s.reward for s in batch], [s.group for s in batch], prior)
    got = torch.tensor([s.advantage for s in batch], dtype=torch.float64)
    torch.testing.assert_close(got, want.to(got.dtype), rtol=1e-12, atol=1e-12)
    # not GRPO's: some prompt's advantages changed with its first step's rewards
    plain, _ = _table(ids, [s.reward for s in batch], [s.group for s in batch])
    assert not torch.equal(got, plain)
    saved = checkpoint.load_state(whole.checkpoint)["ranks"][0]["prompt_stats"]
    assert saved == after_second and {v[0] for v in saved.values()} == {2.0}
    # stopped after step 1 and resumed: the same second step, from the saved statistics
    run_train(tmp_path, *ARGS, "trainer.max_steps=1", name="resumed")
    resumed = run_train(
        tmp_path, *ARGS, "trainer.max_steps=2", "trainer.resume=true", name="resumed"
    )
    assert [s.advantage for s in resumed.last_batch] == [s.advantage for s in batch]

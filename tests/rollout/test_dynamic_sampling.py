"""DAPO's dynamic sampling: groups whose rewards are all equal are dropped and replaced by new
prompts, within a bounded number of refill rounds, and counted."""

from __future__ import annotations

import itertools

from bapo_cli.rollout.base import FINISH_STOP, Generation, Request, SamplingParams
from bapo_cli.rollout.collect import Collector, DynamicSampling
from bapo_cli.staleness.regimes import RegimeSettings, make_regime


class _Engine:
    """Two tokens for every request (the rewards below depend on the prompt, not the text)."""

    name, version = "fake", 0

    def generate(self, requests: list[Request], params: SamplingParams) -> list[Generation]:
        return [Generation([7, 8], None, FINISH_STOP) for _ in requests]


def _collector(flat, rounds: int | None) -> tuple[Collector, list[int]]:
    """Prompts are 0, 1, 2, ...; a prompt in `flat` scores 0 on every sample, the others 0 and 1
    alternately (so its group of 2 is informative). Returns the collector and the drawn prompts."""
    counter = itertools.count()
    drawn: list[int] = []
    collector = Collector(
        engine=_Engine(),
        tokenizer=type("T", (), {"decode": staticmethod(lambda ids, **_: "x")})(),
        params=SamplingParams(max_tokens=4),
        n=2,
        encode=lambda p: [1, 2],
        reward=lambda text, p: 0.0 if flat(p) else float(next(counter) % 2),
        score=lambda samples: None,
        dynamic=None if rounds is None else DynamicSampling(rounds),
    )
    return collector, drawn


def _draw(drawn: list[int]):
    stream = itertools.count()

    def draw(count: int) -> list[int]:
        out = [next(stream) for _ in range(count)]
        drawn.extend(out)
        return out

    return draw


def _prompts(samples) -> list[int]:
    return list(dict.fromkeys(s.problem for s in samples))


def test_flat_groups_are_replaced_by_new_prompts() -> None:
    collector, drawn = _collector(lambda p: p % 3 == 0, rounds=5)
    batch = collector.collect(_draw(drawn), 4)
    # 0 and 3 are flat: dropped, refilled with 4 and 5 in one round
    assert _prompts(batch) == [1, 2, 4, 5] and len(batch) == 8
    assert drawn == [0, 1, 2, 3, 4, 5]
    assert collector.take_dynamic() == {
        "dynamic/dropped_groups": 2.0,
        "dynamic/resample_rounds": 1.0,
        "dynamic/topped_up_groups": 0.0,
    }
    assert collector.take_dynamic()["dynamic/dropped_groups"] == 0.0  # counted afresh


def test_rounds_are_bounded_and_the_batch_is_topped_up() -> None:
    collector, drawn = _collector(lambda p: True, rounds=2)  # nothing is ever informative
    batch = collector.collect(_draw(drawn), 3)
    assert len(drawn) == 9  # the first draw and two refill rounds of 3
    assert _prompts(batch) == [0, 1, 2]  # topped up with the earliest dropped groups
    assert collector.take_dynamic() == {
        "dynamic/dropped_groups": 6.0,
        "dynamic/resample_rounds": 2.0,
        "dynamic/topped_up_groups": 3.0,
    }


def test_without_dynamic_sampling_the_batch_is_what_was_drawn() -> None:
    collector, drawn = _collector(lambda p: p % 3 == 0, rounds=None)
    batch = collector.collect(_draw(drawn), 4)
    assert _prompts(batch) == [0, 1, 2, 3] and collector.take_dynamic() == {}


def test_the_regimes_train_on_the_refilled_batch() -> None:
    for name, k in (("reuse", 2), ("replay", 1), ("lag", 1)):
        collector, drawn = _collector(lambda p: p % 2 == 0, rounds=10)
        settings = RegimeSettings(name, k=k, epochs=1, prompts_per_step=4)
        regime = make_regime(settings, collector, _draw(drawn))
        batch = regime.next_batch()
        groups = {}
        for s in batch:
            groups.setdefault(s.group, set()).add(s.reward)
        assert len(groups) >= 4 and all(len(r) == 2 for r in groups.values()), name
        assert all(p % 2 for p in _prompts(batch)), name


def test_fill_is_pure_on_given_groups() -> None:
    dyn = DynamicSampling(max_rounds=0)
    collector, drawn = _collector(lambda p: p == 1, rounds=None)
    samples = collector.complete([0, 1, 2])
    out = dyn.fill(samples, lambda k: [], 3)  # no refill round allowed: topped up at once
    assert _prompts(out) == [0, 2, 1]
    assert dyn.take()["dynamic/topped_up_groups"] == 1.0

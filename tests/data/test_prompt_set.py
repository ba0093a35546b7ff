"""PromptSet: built from the data config, seeded order, resumable stream, length filter, rewards."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bapo_cli.config.schema import DataConfig
from bapo_cli.data import datasets
from bapo_cli.data.datasets import build_prompt_set, filter_long
from bapo_cli.data.records import DataError
from bapo_cli.data.tasks import arith_reward


class CharTokenizer:
    """One id per character plus BOS: enough to count prompt tokens."""

    def __call__(self, texts):
        return {"input_ids": [[1, *map(ord, t)] for t in texts]}


def arith(**kw) -> DataConfig:
    return DataConfig(**{"kind": "arith", "template": "{problem}=", "num_prompts": 64, **kw})


def test_arith_prompt_set() -> None:
    ps = build_prompt_set(arith())
    assert len(ps) == 64 and ps.reward_fn is arith_reward
    p = ps.items[0]
    assert ps.render(p) == p.question + "=" and ps.texts()[0] == ps.render(p)
    assert ps.reward_fn(p.answer, p.answer) == 1.0
    assert [q.id for q in build_prompt_set(arith()).items] == [q.id for q in ps.items]
    assert [q.id for q in build_prompt_set(arith(seed=1)).items] != [q.id for q in ps.items]


def test_stream_is_seeded_resumable_and_covers_each_epoch() -> None:
    ps = build_prompt_set(arith(num_prompts=10))
    first = ps.take(0, 25)
    assert ps.take(13, 7) == first[13:20]  # any position directly
    assert sorted(q.id for q in first[:10]) == sorted(q.id for q in ps.items)
    assert first[:10] != first[10:20]  # a fresh order each epoch
    batches = ps.batches(4, start=2)
    assert next(batches) == ps.batch(2, 4) == first[8:12]
    assert next(batches) == first[12:16]
    assert ps.epoch_order(1) == build_prompt_set(arith(num_prompts=10)).epoch_order(1)


def test_filter_long_counts_what_it_drops() -> None:
    kept, dropped = filter_long(["ab", "abcd", "abcdefg"], CharTokenizer(), 5)
    assert (kept, dropped) == (["ab", "abcd"], 1)
    ps = build_prompt_set(arith(num_prompts=200))
    short, n = ps.filter_long(CharTokenizer(), 6, format=lambda text: text)
    assert n > 0 and len(short) + n == 200  # "37+45=" plus BOS is 7 tokens
    assert all(len(short.render(p)) <= 5 for p in short.items)
    wrapped, n_wrapped = ps.filter_long(CharTokenizer(), 12, format=lambda text: "<chat>" + text)
    assert n_wrapped == n and len(wrapped) == len(short)
    with pytest.raises(DataError, match="all 200 prompts are longer than 2 tokens"):
        ps.filter_long(CharTokenizer(), 2)


def test_dataset_prompt_set_from_a_shipped_benchmark() -> None:
    cfg = DataConfig(kind="dataset", path="shipped:aime24", seed=3)
    ps = build_prompt_set(cfg)
    assert len(ps) == 30 and ps.skipped == 0
    assert ps.items[0].id.startswith("2024-")
    assert ps.render(ps.items[0]).endswith("put your final answer within \\boxed{}.")
    assert [p.id for p in build_prompt_set(cfg).items] == [p.id for p in ps.items]


def test_dataset_rows_skipped_and_field_names(tmp_path: Path) -> None:
    rows = [{"q": "What is 1+1?", "a": "2"}, {"q": "no answer"}, {"q": "2+2?", "a": 4}]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = DataConfig(
        kind="dataset", path=str(tmp_path / "p.jsonl"), prompt_field="q", answer_field="a"
    )
    ps = build_prompt_set(cfg)
    assert sorted(p.answer for p in ps.items) == ["2", "4"] and ps.skipped == 1
    cfg.answer_field = "answer"
    with pytest.raises(DataError, match="no usable rows"):
        build_prompt_set(cfg)


def test_dataset_reward_uses_the_math_grader(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "p.jsonl").write_text(json.dumps({"problem": "1+1?", "answer": "2"}) + "\n")
    ps = build_prompt_set(DataConfig(kind="dataset", path=str(tmp_path / "p.jsonl")))
    calls = []

    def fake_grade(response: str, reference: str) -> bool:
        calls.append((response, reference))
        return response.endswith("\\boxed{" + reference + "}")

    monkeypatch.setattr(datasets, "grade", fake_grade)
    assert ps.reward_fn("so \\boxed{2}", "2") == 1.0 and ps.reward_fn("3", "2") == 0.0
    assert calls == [("so \\boxed{2}", "2"), ("3", "2")]


def test_bad_template_fails_when_built() -> None:
    with pytest.raises(DataError, match="data.template="):
        build_prompt_set(arith(template="{problem} and {other}"))

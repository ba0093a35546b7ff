"""verl parquet and OpenAI-style message rows: detection, bad rows, chat templates."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from bapo_cli.config.preflight import PreflightError, preflight
from bapo_cli.data.datasets import build_prompt_set
from bapo_cli.data.records import DataError, load_records
from bapo_cli.models import loading as models

FIELDS = {"id": "id", "problem": "problem", "answer": "answer"}


def verl_row(question: str, answer: str, index: int, source: str = "arith") -> dict:
    """One row as verl's data preprocessing scripts write them (e.g. examples/data_preprocess)."""
    return {
        "data_source": source,
        "prompt": [{"role": "user", "content": question}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": answer},
        "extra_info": {"split": "train", "index": index},
    }


def write_verl(path: Path, rows: list[dict]) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def load(path: Path, fmt: str = "auto"):
    return load_records(path=path, hf_id=None, split="train", fields=FIELDS, format=fmt)


def test_verl_parquet_is_detected_and_read(tmp_path: Path) -> None:
    rows = [verl_row("3+4=", "7", 10), verl_row("2*6=", "12", 11, source="other")]
    rows[1]["prompt"] = [
        {"role": "system", "content": "Answer with a number."},
        {"role": "user", "content": "2*6="},
    ]
    records = load(write_verl(tmp_path / "train.parquet", rows))
    assert records.format == "verl" and records.skipped == 0
    assert [(r["id"], r["problem"], r["answer"]) for r in records.rows] == [
        ("10", "3+4=", "7"),
        ("11", "2*6=", "12"),
    ]
    assert records.rows[1]["messages"] == (
        {"role": "system", "content": "Answer with a number."},
        {"role": "user", "content": "2*6="},
    )
    # the record handed to reward=python is the whole source row
    assert records.originals[1]["data_source"] == "other"
    assert records.originals[1]["reward_model"]["ground_truth"] == "12"


def test_bad_verl_rows_are_skipped_and_named_by_row(tmp_path: Path, caplog) -> None:
    good = verl_row("1+1=", "2", 0)
    no_truth = {**verl_row("1+2=", "3", 1), "reward_model": {"style": "rule", "ground_truth": None}}
    bad_prompt = {**verl_row("x", "1", 2), "prompt": [{"role": "user", "content": None}]}
    ends_with_answer = {
        **verl_row("1+3=", "4", 3),
        "prompt": [{"role": "user", "content": "1+3="}, {"role": "assistant", "content": "4"}],
    }
    path = write_verl(tmp_path / "v.parquet", [good, no_truth, bad_prompt, ends_with_answer, good])
    with caplog.at_level(logging.WARNING, logger="bapo_cli.data.records"):
        records = load(path)
    assert len(records.rows) == 2 and records.skipped == 3
    assert records.lines == {
        "missing 'reward_model.ground_truth' (verl format)": [2],
        "'prompt' is not a list of {role, content} messages": [3],
        "'prompt' ends with an assistant message: the prompt must end with user": [4],
    }
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith(f"{path}: skipped 3 of 5 rows (")
    assert "(row 3)" in line and "verl format: 'prompt' as a list of {role, content}" in line


def test_a_file_with_no_usable_row_fails_in_one_line(tmp_path: Path) -> None:
    path = write_verl(tmp_path / "v.parquet", [{"prompt": ["just text"], "data_source": "x"}] * 2)
    with pytest.raises(DataError) as err:
        load(path)
    text = str(err.value)
    assert text.startswith(f"{path}: no usable rows among 2 (looked for verl format: 'prompt' as")
    assert "'prompt' is not a list of {role, content} messages" in text and "\n" not in text
    with pytest.raises(DataError, match="looked for id='id', problem='problem'"):
        load(path, "plain")  # forced plain: the plain fields are what is missing


def test_message_rows_take_the_reference_from_a_column_or_the_last_answer(tmp_path: Path) -> None:
    path = write_jsonl(
        tmp_path / "m.jsonl",
        [
            {"messages": [{"role": "user", "content": "5+5="}], "answer": 10},
            {
                "messages": [
                    {"role": "user", "content": "9-2="},
                    {"role": "assistant", "content": "7"},
                ]
            },
            {"messages": [{"role": "user", "content": "nothing to compare"}]},
            {"messages": "5+5="},
            "",
            {
                "messages": [{"role": "user", "content": "1+0="}],
                "reward_model": {"ground_truth": "1"},
            },
        ],
    )
    records = load(path)
    assert records.format == "messages"
    assert [(r["problem"], r["answer"]) for r in records.rows] == [
        ("5+5=", "10"),
        ("9-2=", "7"),
        ("1+0=", "1"),
    ]
    assert records.rows[1]["messages"] == ({"role": "user", "content": "9-2="},)
    assert records.lines == {
        "no reference: needs 'answer', 'reward_model.ground_truth' or a final assistant message "
        "(messages format)": [3],
        "'messages' is not a list of {role, content} messages": [4],
    }


def test_chat_prompts_use_the_template_or_join_contents_without_one() -> None:
    from bapo_cli.models.tiny import build_tokenizer

    tokenizer = build_tokenizer()
    messages = ({"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2="})
    assert not getattr(tokenizer, "chat_template", None)
    assert models.format_messages(tokenizer, messages) == "Be brief.\n2+2="
    tokenizer.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    assert models.format_messages(tokenizer, messages) == ("<system>Be brief.<user>2+2=<assistant>")


def test_format_and_path_are_checked_at_config_time(tmp_path: Path) -> None:
    with pytest.raises(PreflightError) as err:
        preflight("train", ["data.kind=dataset", "data.path=x.parquet", "data.format=xml"])
    assert str(err.value) == "data.format=xml: must be one of auto, plain, verl, messages"
    with pytest.raises(PreflightError) as err:
        preflight("train", ["data.path=x.parquet"])
    assert str(err.value).startswith("data.path=x.parquet: read only by data.kind=dataset")


def test_prompt_set_of_a_verl_file_keeps_messages_and_rows(tmp_path: Path) -> None:
    path = write_verl(
        tmp_path / "t.parquet", [verl_row(f"{i}+1=", str(i + 1), i) for i in range(6)]
    )
    cfg = preflight("train", ["data.kind=dataset", f"data.path={path}"]).config
    prompts = build_prompt_set(cfg.data)
    assert len(prompts) == 6
    for problem in prompts.items:
        assert problem.messages == ({"role": "user", "content": problem.question},)
        assert problem.record["data_source"] == "arith"
        # the chat prompt bypasses data.template (its default asks for \\boxed{})
        assert prompts.render(problem) == problem.question

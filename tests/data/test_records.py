"""load_records: local files, field mapping, bad rows, clear errors."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from bapo_cli.data.records import DataError, load_records
from tests.conftest import BENCHMARKS

FIELDS = {"id": "id", "problem": "problem", "answer": "answer"}


def _jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def load(path, fields=FIELDS, **kwargs):
    return load_records(path=path, hf_id=None, split="test", fields=fields, **kwargs)


@pytest.mark.parametrize(
    ("name", "n"),
    [
        ("aime24", 30),
        ("aime25", 30),
        ("amc23", 40),
        ("math500", 500),
        ("minerva_math", 272),
        ("olympiadbench", 675),
    ],
)
def test_shipped_benchmarks_load_whole(name: str, n: int) -> None:
    records = load(f"shipped:{name}")
    assert records.source == f"shipped:{name}"
    assert len(records.rows) == n and records.skipped == 0
    assert len({r["id"] for r in records.rows}) == n
    assert set(records.rows[0]) == {"id", "problem", "answer"}
    assert records.rows == load(BENCHMARKS / f"{name}.jsonl").rows  # the file in the package


def test_field_mapping_and_number_answers(tmp_path: Path) -> None:
    path = _jsonl(
        tmp_path / "q.jsonl",
        [
            {"unique_id": "a", "question": "1+1?", "solution": 2},
            {"question": "x?", "solution": "y"},
        ],
    )
    records = load(path, {"id": "unique_id", "problem": "question", "answer": "solution"})
    assert records.rows == [
        {"id": "a", "problem": "1+1?", "answer": "2"},
        {"id": "1", "problem": "x?", "answer": "y"},  # no id in the row: its index
    ]


def test_ids_default_to_row_index(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "q.jsonl", [{"problem": f"p{i}", "answer": str(i)} for i in range(3)])
    rows = load(path, {"problem": "problem", "answer": "answer"}).rows
    assert [r["id"] for r in rows] == ["0", "1", "2"]


def test_bad_rows_are_skipped_counted_and_warned(tmp_path: Path, caplog) -> None:
    path = _jsonl(
        tmp_path / "q.jsonl",
        [
            {"id": 1, "problem": "ok", "answer": "1"},
            {"id": 2, "problem": "no answer"},
            {"id": 3, "problem": None, "answer": "3"},
            {"id": 4, "problem": ["a list"], "answer": "4"},
            {"id": 5, "problem": "   ", "answer": "5"},
            {"id": 6, "problem": "true", "answer": True},
            "{not json",
            "[1, 2]",
            "",
            {"id": 9, "problem": "also ok", "answer": 2.0},
        ],
    )
    with caplog.at_level(logging.WARNING, logger="bapo_cli.data.records"):
        records = load(path)
    assert [r["id"] for r in records.rows] == ["1", "9"]
    assert records.rows[1]["answer"] == "2"
    assert records.skipped == 7  # the blank line is not a row
    assert records.reasons["missing 'answer'"] == 1 and records.reasons["unparsable row"] == 2
    assert "skipped 7 of 9 rows" in caplog.text


def test_none_usable_names_file_and_fields(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "q.jsonl", [{"question": "a", "solution": "b"}] * 3)
    with pytest.raises(DataError) as err:
        load(path)
    text = str(err.value)
    assert str(path) in text and "no usable rows among 3" in text
    assert "problem='problem'" in text and "columns found: question, solution" in text
    assert "\n" not in text


@pytest.mark.parametrize("name", ["missing.jsonl", "missing.parquet"])
def test_missing_file_is_one_line(tmp_path: Path, name: str) -> None:
    with pytest.raises(DataError, match=r"missing\.\w+: no such file$"):
        load(tmp_path / name)


def test_unsupported_and_unreadable_files(tmp_path: Path) -> None:
    (tmp_path / "q.txt").write_text("hi")
    with pytest.raises(DataError, match="unsupported file type '.txt'"):
        load(tmp_path / "q.txt")
    (tmp_path / "bad.parquet").write_text("not parquet")
    with pytest.raises(DataError, match="bad.parquet: cannot read"):
        load(tmp_path / "bad.parquet")
    (tmp_path / "bad.json").write_text("{oops")
    with pytest.raises(DataError, match="bad.json: not valid JSON"):
        load(tmp_path / "bad.json")
    with pytest.raises(DataError, match="is a directory"):
        load(tmp_path)


def test_parquet(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({"id": ["a", "b", "c"], "problem": ["p", None, "r"], "answer": [1, 2, 3]})
    pq.write_table(table, tmp_path / "q.parquet")
    records = load(tmp_path / "q.parquet")
    assert records.rows == [
        {"id": "a", "problem": "p", "answer": "1"},
        {"id": "c", "problem": "r", "answer": "3"},
    ]
    assert records.skipped == 1


@pytest.mark.parametrize(
    "payload",
    [
        [{"problem": "p", "answer": "a"}, {"problem": "q", "answer": "b"}],
        {"test": [{"problem": "p", "answer": "a"}, {"problem": "q", "answer": "b"}]},
        {"data": [{"problem": "p", "answer": "a"}, {"problem": "q", "answer": "b"}]},
        {"problem": ["p", "q"], "answer": ["a", "b"]},
    ],
)
def test_json_shapes(tmp_path: Path, payload) -> None:
    (tmp_path / "q.json").write_text(json.dumps(payload))
    rows = load(tmp_path / "q.json").rows
    assert [(r["id"], r["problem"], r["answer"]) for r in rows] == [
        ("0", "p", "a"),
        ("1", "q", "b"),
    ]


def test_json_of_another_shape(tmp_path: Path) -> None:
    (tmp_path / "q.json").write_text(json.dumps({"a": 1}))
    with pytest.raises(DataError, match="expected a list of objects"):
        load(tmp_path / "q.json")


def test_csv(tmp_path: Path) -> None:
    (tmp_path / "q.csv").write_text("id,problem,answer\nx,1+1,2\ny,,3\n")
    records = load(tmp_path / "q.csv")
    assert records.rows == [{"id": "x", "problem": "1+1", "answer": "2"}]
    assert records.skipped == 1


def offline(monkeypatch) -> None:
    """No network attempts (and no retries): the flags are read when the modules are imported."""
    import datasets.config
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)


def test_unreachable_hub_dataset_names_the_id(monkeypatch) -> None:
    offline(monkeypatch)
    with pytest.raises(DataError) as err:
        load_records(path=None, hf_id="bapo-nobody/no-dataset", split="train", fields=FIELDS)
    text = str(err.value)
    assert text.startswith("HF dataset bapo-nobody/no-dataset, split 'train': could not be loaded")
    assert "local file" in text and "\n" not in text


def test_no_source() -> None:
    with pytest.raises(DataError, match="no data source"):
        load_records(path=None, hf_id=None, split="train", fields=FIELDS)


def test_an_invalid_byte_costs_its_line_and_the_warning_names_it(tmp_path: Path, caplog) -> None:
    path = tmp_path / "q.jsonl"
    good = [json.dumps({"id": i, "problem": f"p{i}", "answer": str(i)}).encode() for i in (1, 2)]
    bad = b'{"id": 3, "problem": "caf\xe9", "answer": "3"}'  # latin-1 byte: invalid UTF-8
    after = [
        json.dumps({"id": i, "problem": "\u00e9t\u00e9", "answer": str(i)}).encode() for i in (4, 5)
    ]
    path.write_bytes(b"\n".join([*good, bad, *after]) + b"\n")
    with caplog.at_level(logging.WARNING, logger="bapo_cli.data.records"):
        records = load(path)
    assert [r["id"] for r in records.rows] == ["1", "2", "4", "5"]
    assert records.rows[2]["problem"] == "\u00e9t\u00e9"  # real UTF-8 after the bad line
    assert records.reasons == {"invalid UTF-8": 1} and records.lines == {"invalid UTF-8": [3]}
    assert "skipped 1 of 5 rows (invalid UTF-8: 1 (line 3))" in caplog.text


def test_unparsable_jsonl_lines_are_named_by_number(tmp_path: Path, caplog) -> None:
    rows = [{"id": 1, "problem": "a", "answer": "1"}, "{oops", "", "[1]", "\xff"]
    path = _jsonl(tmp_path / "q.jsonl", rows)  # "\xff" is written as valid UTF-8 (ÿ)
    with caplog.at_level(logging.WARNING, logger="bapo_cli.data.records"):
        records = load(path)
    assert records.lines == {"unparsable row": [2, 4, 5]}  # the blank line 3 is not a row
    assert "unparsable row: 3 (lines 2, 4, 5)" in caplog.text


def test_datasets_floor_is_a_release_without_loading_scripts() -> None:
    import tomllib
    from importlib.metadata import version

    from packaging.requirements import Requirement

    from tests.conftest import REPO

    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    (spec,) = [r.specifier for r in map(Requirement, deps) if r.name == "datasets"]
    assert not spec.contains("3.6.0")  # the last release that ran a dataset's loading script
    assert spec.contains("4.0.0") and spec.contains(version("datasets"))  # satisfiable here


def test_a_dataset_script_is_refused_not_run(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    repo = tmp_path / "evil"
    repo.mkdir()
    (repo / "evil.py").write_text(
        "import pathlib\npathlib.Path(__file__).with_name('RAN').write_text('ran')\n"
    )
    with pytest.raises(DataError, match="could not be loaded") as err:
        load_records(path=None, hf_id=str(repo), split="train", fields=FIELDS)
    assert "\n" not in str(err.value)
    assert not (repo / "RAN").exists()

r"""The benchmarks that ship with the package: every preset loads offline from its shipped file,
the files are the pinned ones, and every reference answer, boxed in a response, grades as correct
against itself through the real grader (a reference the grader cannot read would score every
model 0 on that problem, silently)."""

from __future__ import annotations

import hashlib
import re

import pytest

from bapo_cli.config.preflight import preflight
from bapo_cli.data import shipped
from bapo_cli.data.records import DataError, load_records
from bapo_cli.evaluation.evaluate import load_problems
from bapo_cli.rewards import MathGrader
from tests.conftest import REPO

FIELDS = {"id": "id", "problem": "problem", "answer": "answer"}
# preset -> (rows, first id)
PRESETS = {
    "aime24": (30, "2024-I-1"),
    "aime25": (30, "2025-I-1"),
    "amc23": (40, "amc23-0"),
    "math500": (500, "test/precalculus/807.json"),
    "minerva_math": (272, "minerva-0"),
    "olympiadbench": (675, "olympiadbench-1606"),
}
# References that cannot grade as correct against themselves, with why. None today: every
# reference of every shipped file passes (a new entry here must say why it cannot).
UNGRADEABLE: dict[str, str] = {}
# OlympiadBench rows flagged multiple_answers whose reference is not a list of answers, so that
# reordering its comma-separated parts changes what it says.
NOT_A_LIST = {
    "olympiadbench-1965": "one answer with its conditions: f(x)=ax+b, where b is an arbitrary "
    "integer, and a is an arbitrary positive integer with ...",
}


def rows_of(name: str) -> list[dict]:
    return load_records(path=f"shipped:{name}", hf_id=None, split="test", fields=FIELDS).originals


def response(answer: str) -> str:
    """A model-like response whose final answer is `answer`, after an earlier wrong box."""
    return (
        "Let me work through it. A first guess was \\boxed{-1}, which fails the check.\n"
        f"Therefore the final answer is $\\boxed{{{answer}}}$."
    )


@pytest.fixture(scope="module")
def grader():
    with MathGrader(timeout_s=10.0) as g:
        yield g


def test_every_preset_loads_its_shipped_file_offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    presets = sorted(p.stem for p in (REPO / "conf" / "benchmark").glob("*.yaml"))
    assert presets == shipped.names() == sorted(PRESETS)
    for name, (n, first) in PRESETS.items():
        bench = preflight("eval", [f"benchmark={name}"]).config.benchmark
        assert (bench.name, bench.path) == (name, f"shipped:{name}")
        problems, skipped = load_problems(bench)
        assert (len(problems), skipped, problems[0].id) == (n, 0, first), name
        assert len({p.id for p in problems}) == n, f"{name}: ids not unique"
    hub = preflight("eval", ["benchmark=math500", "benchmark.path=null"]).config.benchmark
    assert (hub.path, hub.hf_id) == (None, "HuggingFaceH4/MATH-500")  # the hub stays selectable


def test_sources_md_pins_every_shipped_file() -> None:
    table = re.findall(
        r"^\| `(\w+)\.jsonl` \| (\d+) \| `([0-9a-f]{64})` \|$",
        (shipped.DIR / "SOURCES.md").read_text(encoding="utf-8"),
        re.MULTILINE,
    )
    assert sorted(name for name, _, _ in table) == shipped.names()
    for name, rows, sha in table:
        data = shipped.path_of(f"shipped:{name}").read_bytes()
        assert (data.count(b"\n"), hashlib.sha256(data).hexdigest()) == (int(rows), sha), name


def test_an_unknown_shipped_name_is_a_one_line_error() -> None:
    choices = "shipped: aime24, aime25, amc23, math500, minerva_math, olympiadbench"
    for bad in ("shipped:aime26", "shipped:../benchmarks/aime24"):
        with pytest.raises(DataError) as err:
            load_records(path=bad, hf_id=None, split="test", fields=FIELDS)
        assert str(err.value) == f"{bad}: no such shipped benchmark; {choices}"


def test_every_reference_answer_boxed_grades_as_correct(grader: MathGrader) -> None:
    failed: dict[str, str] = {}
    for name in shipped.names():
        rows = rows_of(name)
        answers = [str(r["answer"]) for r in rows]
        report = grader.grade_batch([response(a) for a in answers], answers)
        assert report.timeouts == 0 and report.over_budget == 0, name
        failed |= {
            str(r["id"]): a
            for r, a, ok in zip(rows, answers, report.verdicts, strict=True)
            if not ok
        }
    assert failed == UNGRADEABLE


def _items(answer: str) -> list[str]:
    """A reference list's top-level items: split at commas outside brackets; `$,$` is a comma."""
    items, depth, current = [], 0, ""
    for ch in answer.replace("$,$", ","):
        depth += (ch in "([{") - (ch in ")]}")
        if ch == "," and depth == 0:
            items.append(current.strip())
            current = ""
        else:
            current += ch
    return [*items, current.strip()]


@pytest.mark.slow  # math-verify in the grader's worker process (about 5 s for the 94 rows)
def test_multi_answer_rows_grade_as_a_set(grader: MathGrader) -> None:
    """A multi-answer OlympiadBench row is right when the response lists all its answers, in
    any order, and wrong when it gives only the first: math-verify compares the lists as sets
    (docs/evaluation.md says so, and what that costs: order and repeats are not checked)."""
    rows = [r for r in rows_of("olympiadbench") if r["multiple_answers"]]
    assert len(rows) == 94
    lists = [r for r in rows if len(_items(r["answer"])) > 1 and r["id"] not in NOT_A_LIST]
    assert len(lists) == 91  # the other two are one tuple each, e.g. (-1/2, 7/2)
    refs = [r["answer"] for r in lists]
    reordered = [response(", ".join(reversed(_items(a)))) for a in refs]
    first_only = [response(_items(a)[0]) for a in refs]
    report = grader.grade_batch(reordered + first_only, refs + refs)
    assert report.timeouts == 0
    n = len(refs)
    wrong_order = [r["id"] for r, ok in zip(lists, report.verdicts[:n], strict=True) if not ok]
    partial = [r["id"] for r, ok in zip(lists, report.verdicts[n:], strict=True) if ok]
    # -2,-2 (a = b = -2) is the set {-2}: its first item alone is the whole answer
    assert (wrong_order, partial) == ([], ["olympiadbench-2532"])

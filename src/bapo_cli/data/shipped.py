"""Benchmarks that ship inside the package, named `shipped:<name>` wherever a data path goes.

Evaluation has to work offline, from a fresh clone and from a wheel install alike, so the usual
math benchmarks travel as package data: `bapo_cli/data/benchmarks/<name>.jsonl`, rows
``{id, problem, answer}`` (olympiadbench adds ``multiple_answers``), with their provenance, row
counts and checksums in SOURCES.md beside them. A config names one by `shipped:<name>`
(`benchmark.path=shipped:aime24`, which the presets in conf/benchmark set, or
`data.path=shipped:math500` to train on it) instead of a file path, so the same config works on
every machine and the MLflow params record no site-packages path. `records.load_records` turns
the name into the file through `path_of`.
"""

from __future__ import annotations

from pathlib import Path

SCHEME = "shipped:"
DIR = Path(__file__).resolve().parent / "benchmarks"
"""Where the shipped benchmark files are in this install (in the source tree or site-packages)."""


def names() -> list[str]:
    """The shipped benchmarks, by name (the file stems)."""
    return sorted(p.stem for p in DIR.glob("*.jsonl"))


def is_shipped(path: str | Path) -> bool:
    """Does this data path name a shipped benchmark (`shipped:<name>`)?"""
    return str(path).startswith(SCHEME)


def path_of(path: str | Path) -> Path:
    """The file of `shipped:<name>` in this install; KeyError naming the choices when unknown."""
    name = str(path).removeprefix(SCHEME)
    file = DIR / f"{name}.jsonl"
    if "/" in name or "\\" in name or not file.is_file():
        raise KeyError(f"{SCHEME}{name}: no such shipped benchmark; shipped: {', '.join(names())}")
    return file

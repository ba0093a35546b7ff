"""scripts/paper45_plot.py: the per-seed table and the picture, on hand-made runs written to the
per-run CSVs that paper45.py exports."""

from __future__ import annotations

import sys
from pathlib import Path

from tests.sweep.conftest import load_script

plot = load_script("paper45_plot")
paper45 = sys.modules["paper45"]
Run = paper45.study_v3.Run


def _run(arm: str, config: str, seed: int, change: float | None) -> Run:
    return Run(arm, paper45.LR, config, seed, {paper45.KEY: change})


def _settings() -> dict[str, list[Run]]:
    a = [
        _run("reuse8", "grpo", 0, -0.10),
        _run("reuse8", "grpo", 1, -0.12),
        _run("reuse8", "bapo0.4", 0, 0.05),
        _run("lag8", "topr", 1, None),  # a run without a value
    ]
    b = [_run("reuse8", "grpo", 0, -0.08), _run("reuse8", "bapo0.4", 1, 0.0)]
    return {"A": a, "B": b}


def test_per_seed_rows_hold_every_run_by_setting_and_seed() -> None:
    lines = plot.per_seed(_settings()).splitlines()
    head = next(line for line in lines if line.startswith("| configuration"))
    assert head == "| configuration | A0 | A1 | B0 | B1 | mean |"
    rows = {line.split(" | ")[0]: line for line in lines if line.startswith("| ")}
    reuse = lines[: lines.index("## study_v3_lag8, lr 0.0006: held-out change per run")]
    reuse_rows = {line.split(" | ")[0]: line for line in reuse if line.startswith("| ")}
    assert reuse_rows["| grpo"] == "| grpo | -0.100 | -0.120 | -0.080 | – | -0.100 |"
    assert reuse_rows["| bapo0.4"] == "| bapo0.4 | +0.050 | – | – | +0.000 | +0.025 |"
    # every configuration of the design has its row, in the design's order, on both arms
    body = [line for line in lines if line.startswith("| ") and line[2:5] not in ("con", "---")]
    assert [line.split(" | ")[0][2:] for line in body] == 2 * list(paper45.CONFIGURATIONS)
    assert rows["| topr"] == "| topr | – | – | – | – | – |"


def test_the_cli_writes_the_png_and_the_table_from_exported_csvs(tmp_path: Path, capsys) -> None:
    sources = []
    for name, runs in _settings().items():
        path = tmp_path / f"{name}.csv"
        paper45.replicate.export_csv(runs, path, paper45.CSV_KEYS)
        sources.append(str(path))
    out = tmp_path / "out"
    assert plot.main([*sources, "--out", str(out)]) == 0
    data = (out / "heldout_change.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    assert (out / "per_seed.md").read_text(encoding="utf-8") == plot.per_seed(
        {k: paper45.pick(v, None) for k, v in _settings().items()}
    )
    assert capsys.readouterr().out.count("wrote ") == 2


def test_a_configuration_outside_the_design_is_one_line(tmp_path: Path, capsys) -> None:
    path = tmp_path / "A.csv"
    paper45.replicate.export_csv([_run("reuse8", "nope", 0, 0.0)], path, paper45.CSV_KEYS)
    assert plot.main([str(path), str(path), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "nope" in err[0] and err[0].startswith("error: ")
    assert not (tmp_path / "o").exists()

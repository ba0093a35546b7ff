"""scripts/stress2_plot.py: the stress runs as pictures; the order, the quadrant counts and the
files, on hand-made runs written to the per-run CSVs that stress2.py exports."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.sweep.conftest import load_script

plot = load_script("stress2_plot")
stress2 = sys.modules["stress2"]
ess = sys.modules["ess_readout"]
Run = stress2.study_v3.Run


def _run(arm: str, algo: str, seed: int, change: float | None, eq: float, final: float) -> Run:
    values = {stress2.KEY: change, ess.EQ_KEY: eq, ess.FINAL_KEY: final}
    return Run(arm, stress2.LR, algo, seed, values)


def _settings() -> dict[str, list[Run]]:
    a = [
        _run("reuse8", "grpo", 0, -0.10, 0.9, 0.10),
        _run("reuse8", "grpo", 1, -0.12, 0.4, 0.01),  # falling, collapse
        _run("reuse8", "gspo", 0, 0.01, 0.95, 0.20),
        _run("reuse8", "cispo", 0, -0.20, 0.2, 0.00),  # falling, collapse
        _run("lag8", "grpo", 0, -0.05, 0.3, 0.15),  # falling, kept
        _run("lag8", "cispo", 0, None, 0.7, 0.02),  # steady, collapse; change missing
    ]
    b = [
        _run("reuse8", "grpo", 0, -0.08, 0.9, 0.12),
        _run("reuse8", "gspo", 0, 0.03, 0.9, 0.22),
        _run("reuse8", "cispo", 0, -0.22, 0.1, 0.00),  # falling, collapse
    ]
    return {"A": a, "B": b}


def test_arm_order_is_by_the_mean_over_both_settings() -> None:
    order = plot.arm_order(_settings(), "reuse8")
    assert [c for c, _ in order] == ["gspo", "grpo", "cispo"]
    means = dict(order)
    assert means["gspo"] == pytest.approx(0.02)
    assert means["grpo"] == pytest.approx(-0.10)  # (-0.10 - 0.12 - 0.08) / 3
    assert means["cispo"] == pytest.approx(-0.21)
    # a configuration whose only run has no value is left out of its arm
    assert plot.arm_order(_settings(), "lag8") == [("grpo", -0.05)]


def test_quadrants_use_the_design_thresholds() -> None:
    counts = plot.quadrants(_settings())
    assert counts == {
        (True, True): 3,
        (True, False): 1,
        (False, True): 1,
        (False, False): 4,
    }
    # on the threshold: E_q = 0.5 is steady, final = 0.05 is kept (strict "<", as ess_readout)
    edge = {"A": [_run("reuse8", "grpo", 0, 0.0, ess.FALLING, ess.COLLAPSE)], "B": []}
    assert plot.quadrants(edge)[(False, False)] == 1


def test_the_cli_draws_both_pngs_from_exported_csvs(tmp_path: Path, capsys) -> None:
    settings = _settings()
    sources = []
    for name, runs in settings.items():
        path = tmp_path / f"{name}.csv"
        stress2.replicate.export_csv(runs, path, stress2.CSV_KEYS)
        sources.append(str(path))
    out = tmp_path / "png"
    assert plot.main([*sources, "--out", str(out)]) == 0
    for name in ("heldout_change.png", "ess_collapse.png"):
        data = (out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    assert capsys.readouterr().out.count("wrote ") == 2


def test_a_configuration_outside_the_design_is_one_line(tmp_path: Path, capsys) -> None:
    path = tmp_path / "A.csv"
    stress2.replicate.export_csv([_run("reuse8", "nope", 0, 0.0, 1.0, 0.2)], path, stress2.CSV_KEYS)
    assert plot.main([str(path), str(path), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "nope" in err[0] and err[0].startswith("error: ")
    assert not (tmp_path / "o").exists()

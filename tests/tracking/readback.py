"""Reading W&B offline runs and TensorBoard event files back the supported ways: W&B's own CLI
(`wandb leet inspect --json`, which prints the records of a run's `.wandb` transaction log) and
TensorBoard's `EventAccumulator`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest


def isolate_wandb(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """W&B's settings, cache and key lookups kept under the test's tmp dir (offline: no key)."""
    home = tmp_path / "wandb-home"
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(var, str(home / var.lower()))
    for var in ("WANDB_API_KEY", "WANDB_DIR", "WANDB_MODE", "WANDB_PROJECT", "WANDB_ENTITY"):
        monkeypatch.delenv(var, raising=False)
    return home


def wandb_run_dir(run_dir: Path) -> Path:
    """The one offline W&B run under `<run_dir>/wandb`."""
    found = sorted((run_dir / "wandb").glob("offline-run-*"))
    assert len(found) == 1, found
    return found[0]


def wandb_records(run_dir: Path) -> list[dict[str, Any]]:
    """Every record of the offline run's transaction log, as W&B's CLI prints them."""
    wandb_cli = Path(sys.executable).with_name("wandb")
    out = subprocess.run(
        [str(wandb_cli), "leet", "inspect", "--json", str(wandb_run_dir(run_dir))],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def wandb_history(records: list[dict[str, Any]]) -> dict[int, dict[str, float]]:
    """{step: {key: value}} of the run's history rows (W&B's own `_` keys left out)."""
    rows: dict[int, dict[str, float]] = {}
    for r in records:
        if r["type"] == "history":
            row = {k: v for k, v in r["history"]["item"].items() if not k.startswith("_")}
            step = int(r["history"]["step"]["num"])
            assert step not in rows, f"step {step} logged twice"
            rows[step] = row
    return rows


def wandb_run(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The run record: id, name, project, tags and the config given at start."""
    return next(r["run"] for r in records if r["type"] == "run")


def wandb_config(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The run's config: the start config, then every update, in order."""
    config: dict[str, Any] = {}
    for r in records:
        if r["type"] == "run":
            config.update(r["run"].get("config", {}).get("update", {}))
        elif r["type"] == "config":
            config.update(r["config"].get("update", {}))
    config.pop("_wandb", None)
    return config


def tb_events(log_dir: Path) -> Any:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    return EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0}).Reload()


def tb_scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """{key: [(step, value), ...]} of every scalar in the event files (float32 values)."""
    events = tb_events(log_dir)
    return {
        key: [(e.step, e.value) for e in events.Scalars(key)] for key in events.Tags()["scalars"]
    }


def tb_texts(log_dir: Path) -> dict[str, str]:
    """{name: text} of the text summaries (params, tags, config.yaml)."""
    events = tb_events(log_dir)
    out = {}
    for tag in events.Tags()["tensors"]:
        (event,) = events.Tensors(tag)
        out[tag.removesuffix("/text_summary")] = event.tensor_proto.string_val[0].decode()
    return out


def tb_table(text: str) -> dict[str, str]:
    """A `| key | value |` markdown table back to a dict."""
    rows = [line.strip("| ").split(" | ", 1) for line in text.splitlines()[2:]]
    return {k: v.replace("&#124;", "|") for k, v in rows}

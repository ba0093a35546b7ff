"""Checkpoints: nothing executable is loaded, leftovers never break resume, re-saves are atomic,
keep_last prunes, a full disk is one line (bapo_cli.trainer.checkpoint)."""

from __future__ import annotations

import contextlib
import io
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from rich.console import Console

from bapo_cli.config.preflight import preflight
from bapo_cli.models import loading as models
from bapo_cli.trainer import checkpoint
from bapo_cli.trainer.train import TrainingError, train
from tests.conftest import tmpfs
from tests.train.conftest import FAST

STATE = {"optimizer": {"state": {}, "param_groups": []}, "step": 2, "rng": None}


@pytest.fixture(scope="module")
def policy() -> tuple[object, object]:
    return models.load_policy(preflight("train", []).config.model)


class Pwn:
    """What a crafted trainer_state.pt holds: unpickling it would create `marker`."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _write(root: Path, step: int, policy, state=None) -> Path:
    model, tokenizer = policy
    return checkpoint.save(root, step, model, tokenizer, state or {**STATE, "step": step})


def _train(tmp_path: Path, *overrides: str) -> tuple[object, str]:
    out = io.StringIO()
    cfg = preflight("train", [*FAST, *overrides]).config
    result = train(cfg, tmp_path / "run", Console(file=out, width=400))
    return result, out.getvalue()


def test_crafted_state_runs_no_code_resume_falls_back_naming_it_keep_last_prunes(
    tmp_path: Path,
) -> None:
    args = ("trainer.max_steps=4", "trainer.save_every=1", "trainer.keep_last=2")
    first, _ = _train(tmp_path, *args)
    root = first.run_dir / "checkpoints"
    assert [p.name for p in checkpoint.complete(root)] == ["step_000003", "step_000004"]
    assert sorted(p.name for p in root.iterdir()) == ["step_000003", "step_000004"]

    marker = tmp_path / "pwned"
    torch.save({"optimizer": Pwn(marker)}, checkpoint.step_dir(root, 4) / checkpoint.STATE_FILE)
    resumed, log = _train(tmp_path, *args, "trainer.resume=true")
    assert not marker.exists()  # the payload never ran
    text = " ".join(log.split())
    assert f"skipping unusable checkpoint: checkpoint {root / 'step_000004'}" in text
    assert "holds a reference to posix.system" in text and "refused" in text
    assert f"resumed from {root / 'step_000003'} at step 3" in text
    same = [{k: v for k, v in h.items() if not k.startswith("perf/")} for h in first.history]
    assert [{k: v for k, v in h.items() if not k.startswith("perf/")} for h in resumed.history] == (
        same
    )  # step 4 recomputed from step 3's state: bit-identical


def test_crafted_state_alone_is_an_error_naming_it_and_runs_nothing(tmp_path, policy) -> None:
    root = tmp_path / "checkpoints"
    bad = _write(root, 4, policy)
    marker = tmp_path / "pwned"
    torch.save({"optimizer": Pwn(marker)}, bad / checkpoint.STATE_FILE)
    with pytest.raises(checkpoint.CheckpointError, match="holds a reference to posix.system"):
        checkpoint.load_state(bad)
    warnings: list[str] = []
    with pytest.raises(checkpoint.CheckpointError, match=r"no usable checkpoint in .*step_000004"):
        checkpoint.latest_usable(root, warnings.append)
    assert not marker.exists()
    assert warnings == [
        f"skipping unusable checkpoint: checkpoint {bad}: trainer_state.pt holds a reference to "
        "posix.system, not only tensors and plain data; refused without loading it (it could "
        "run code)"
    ]


def test_rng_state_round_trips_through_a_weights_only_file(tmp_path: Path) -> None:
    import random

    import numpy as np

    checkpoint.seed_everything(7)
    random.random(), np.random.normal(), torch.rand(3)  # a cached gaussian in numpy's state
    torch.save(checkpoint.rng_state(), tmp_path / "rng.pt")
    expected = (random.random(), np.random.normal(), np.random.rand(), torch.rand(3))
    checkpoint.seed_everything(99)
    checkpoint.set_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True))
    again = (random.random(), np.random.normal(), np.random.rand(), torch.rand(3))
    assert again[:3] == expected[:3] and torch.equal(again[3], expected[3])


def test_leftover_and_foreign_dirs_do_not_break_resume(tmp_path: Path, policy) -> None:
    root = tmp_path / "checkpoints"
    good = _write(root, 2, policy)
    # a kill between writing the marker and the rename (old fixed temp name), a stranger's dirs
    for name in ("step_000004.tmp", "step_foo", "step_12", "step_0000040"):
        shutil.copytree(good, root / name)
    (root / "step_000009").mkdir()  # no marker: incomplete
    assert checkpoint.latest(root) == good
    found = checkpoint.latest_usable(root, print)
    assert found is not None and found[0] == good and found[1]["step"] == 2


def test_temporary_dir_carries_pid_and_random_suffix(tmp_path: Path, policy) -> None:
    model, tokenizer = policy
    seen: list[str] = []

    class Spy:  # the real tokenizer, recording where it is asked to write
        def save_pretrained(self, directory, **kwargs):
            seen.append(Path(directory).name)
            return tokenizer.save_pretrained(directory, **kwargs)

    root = tmp_path / "checkpoints"
    checkpoint.save(root, 2, model, Spy(), STATE)
    checkpoint.save(root, 2, model, Spy(), STATE)
    assert all(re.fullmatch(rf"step_000002\.tmp-{os.getpid()}-[0-9a-f]{{8}}", n) for n in seen)
    assert seen[0] != seen[1]
    assert [p.name for p in root.iterdir()] == ["step_000002"]


KILLED_MID_RESAVE = """
import os, sys
from pathlib import Path
from bapo_cli.trainer import checkpoint
from bapo_cli.models import loading as models
from bapo_cli.config.preflight import preflight

root, crash_at = Path(sys.argv[1]), int(sys.argv[2])
model, tokenizer = models.load_policy(preflight("train", []).config.model)
real_rename, calls = Path.rename, []

def rename(self, target):  # kill -9 right before the crash_at-th rename: no cleanup runs
    calls.append(self.name)
    if len(calls) == crash_at:
        os._exit(9)
    return real_rename(self, target)

Path.rename = rename
checkpoint.save(root, 2, model, tokenizer, {"written": "new"})
"""


@pytest.mark.parametrize("crash_at", [1, 2])
def test_a_kill_during_a_resave_leaves_a_complete_checkpoint(
    tmp_path: Path, policy, crash_at: int
) -> None:
    root = tmp_path / "checkpoints"
    _write(root, 2, policy, {**STATE, "written": "old"})
    killed = subprocess.run(
        [sys.executable, "-c", KILLED_MID_RESAVE, str(root), str(crash_at)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert killed.returncode == 9, killed.stderr[-2000:]
    found = checkpoint.latest_usable(root, print)
    assert found is not None and found[0] == checkpoint.step_dir(root, 2)
    # before the swap: the old one untouched; between the renames: the new one (complete) put back
    assert found[1]["written"] == ("old" if crash_at == 1 else "new")
    _write(root, 2, policy, {**STATE, "written": "newest"})  # the dead writer's leftovers go
    assert [p.name for p in root.iterdir()] == ["step_000002"]
    assert checkpoint.load_state(checkpoint.step_dir(root, 2))["written"] == "newest"


def test_an_interrupted_resave_cleans_up_after_itself(
    tmp_path: Path, policy, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "checkpoints"
    _write(root, 2, policy, {**STATE, "written": "old"})
    real_rename, calls = Path.rename, []

    def rename(self, target):  # Ctrl-C between setting the old one aside and renaming in
        calls.append(self.name)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real_rename(self, target)

    monkeypatch.setattr(Path, "rename", rename)
    with pytest.raises(KeyboardInterrupt):
        _write(root, 2, policy, {**STATE, "written": "new"})
    assert [p.name for p in root.iterdir()] == ["step_000002"]
    assert checkpoint.load_state(checkpoint.step_dir(root, 2))["written"] == "new"


def test_keep_last_keeps_the_newest_complete_checkpoints(tmp_path: Path, policy) -> None:
    root = tmp_path / "checkpoints"
    model, tokenizer = policy
    for step in (1, 2, 3, 4, 10):
        checkpoint.save(root, step, model, tokenizer, STATE, keep_last=3)
    assert sorted(p.name for p in root.iterdir()) == ["step_000003", "step_000004", "step_000010"]
    with pytest.raises(ValueError, match="keep_last=0: must be >= 1"):
        checkpoint.prune(root, 0)


@pytest.fixture
def small_disk(tmp_path: Path):
    """A real 6 MiB filesystem (tmpfs; needs root): room for one tiny-model checkpoint."""
    with tmpfs(tmp_path / "small", "6m") as mount:
        yield mount


def _open_files() -> list[str]:
    out = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the fd that listed the directory, closed since
            out.append(os.readlink(f"/proc/self/fd/{fd}"))
    return out


def test_disk_full_is_one_line_naming_the_dir_and_the_intact_checkpoint(small_disk: Path) -> None:
    with pytest.raises(TrainingError) as caught:
        train(
            preflight("train", [*FAST, "trainer.max_steps=3", "trainer.save_every=1"]).config,
            small_disk / "run",
            Console(file=io.StringIO()),
        )
    root = small_disk / "run" / "checkpoints"
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(f"disk full writing checkpoint step 2 in {root} (")
    assert re.search(r"\(\d+(\.\d)? (B|KiB|MiB) free\)", message)
    assert message.endswith(f"the previous checkpoint {root / 'step_000001'} is intact")
    assert [p.name for p in root.iterdir()] == ["step_000001"]  # the partial write is gone
    assert not [p for p in _open_files() if p.startswith(str(small_disk))]  # its space is free
    found = checkpoint.latest_usable(root, print)
    assert found is not None and found[1]["state"]["step"] == 1


def test_disk_full_simulated_where_no_tmpfs_can_be_mounted(
    tmp_path: Path, policy, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same path with ENOSPC raised by the state write (a full disk cannot be made without
    root): the OSError is recognised, the temporary removed, the message one line."""
    import errno

    root = tmp_path / "checkpoints"
    _write(root, 1, policy)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint.torch, "save", full)
    with pytest.raises(checkpoint.DiskFullError, match="previous checkpoint .*step_000001 is"):
        _write(root, 2, policy)
    assert [p.name for p in root.iterdir()] == ["step_000001"]


@pytest.mark.parametrize("regime", ["replay", "lag", "partial"])
def test_resume_with_samples_in_the_regime_buffers_is_bit_identical(
    tmp_path: Path, regime: str
) -> None:
    """The buffers hold rollout samples (dataclasses): saved as plain dicts, loaded weights_only."""
    from tests.train.conftest import run_train

    args = ("staleness=2", f"staleness.regime={regime}", "rollout.max_tokens=4")
    args += ("trainer.max_steps=4",)
    whole = run_train(tmp_path, *args, "trainer.save_every=1", name="whole")
    root = whole.run_dir / "checkpoints"
    # the first checkpoint with samples in flight (a partial pool empties when all groups finish)
    step = next(
        s
        for s in (1, 2, 3)
        if any(checkpoint.load_state(checkpoint.step_dir(root, s))["ranks"][0]["regime"].values())
    )
    killed = checkpoint.step_dir(tmp_path / "killed" / "checkpoints", step)
    shutil.copytree(checkpoint.step_dir(root, step), killed)
    resumed = run_train(tmp_path, *args, "trainer.resume=true", name="killed")
    plain = [{k: v for k, v in h.items() if not k.startswith("perf/")} for h in whole.history]
    assert [{k: v for k, v in h.items() if not k.startswith("perf/")} for h in resumed.history] == (
        plain
    )

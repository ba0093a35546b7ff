"""`bapo merge-lora CKPT OUT` never deletes what it did not write (issue 33, item 2).

Every case of the audit with real files: OUT = a user's directory, the run dir holding CKPT, the
current directory of a project, CKPT itself, an existing file, a symlink to a directory with
files; `--force` on an allowed non-empty directory (set aside, not deleted) and `--force` on
CKPT, a parent of it and the current directory or a parent of it (still refused). Each refusal
is one `error:` line and exit code 2, and every file under the test's directory is still there
byte for byte (no temporary left either). The refusals come before any weight loads: the base's
weights are made unreadable and the error is still about OUT.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from bapo_cli.cli import app
from bapo_cli.models import loading, lora
from tests.conftest import run_bapo

runner = CliRunner()


def tree(root: Path) -> dict[str, object]:
    """Every entry under `root`, links not followed: file -> bytes, link -> target, dir -> None."""
    found: dict[str, object] = {}
    for here, dirs, files in os.walk(root, followlinks=False):
        for name in dirs + files:
            path = Path(here) / name
            rel = str(path.relative_to(root))
            if path.is_symlink():
                found[rel] = ("link", os.readlink(path))
            elif path.is_dir():
                found[rel] = None
            else:
                found[rel] = path.read_bytes()
    return found


@pytest.fixture()
def world(tmp_path: Path, lora_files: tuple[Path, Path]) -> dict[str, Path]:
    """A user's files: a run dir holding the checkpoint, a project dir, a precious dir, a file,
    a symlink to the precious dir, and a base model whose weights cannot be read."""
    base, adapter = lora_files
    run = tmp_path / "run"
    ckpt = run / "checkpoints" / "step_000002"
    shutil.copytree(adapter, ckpt)
    (ckpt / "trainer_state.pt").write_bytes(b"state of step 2")
    (ckpt / "COMPLETE").write_text("2")
    (run / ".hydra").mkdir()
    (run / ".hydra" / "config.yaml").write_text("trainer:\n  max_steps: 2\n")
    (run / "samples.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    (run / "train.log").write_text("step 1\nstep 2\n")
    project = tmp_path / "project"
    (project / "src" / "pkg").mkdir(parents=True)
    (project / "README.md").write_text("# my project\n")
    (project / "src" / "pkg" / "__init__.py").write_text("VALUE = 1\n")
    precious = tmp_path / "precious"
    (precious / "notes").mkdir(parents=True)
    (precious / "thesis.tex").write_bytes(os.urandom(4096))
    (precious / "notes" / "todo.txt").write_text("everything\n")
    (tmp_path / "report.pdf").write_bytes(os.urandom(1024))
    (tmp_path / "link").symlink_to(precious, target_is_directory=True)
    # the adapter names this base; its weights are garbage, so a check that came after loading
    # would report the load, not OUT
    broken = tmp_path / "broken-base"
    shutil.copytree(base, broken)
    (broken / "model.safetensors").write_bytes(b"not weights")
    config = json.loads((ckpt / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = str(broken)
    (ckpt / "adapter_config.json").write_text(json.dumps(config))
    return {"root": tmp_path, "run": run, "ckpt": ckpt, "project": project, "precious": precious}


def merge_cli(*args: str, cwd: Path) -> tuple[int, str, str]:
    """`bapo merge-lora ARGS` in-process from `cwd`: (exit code, stdout, stderr)."""
    before = Path.cwd()
    os.chdir(cwd)
    try:
        result = runner.invoke(app, ["merge-lora", *args], env={"COLUMNS": "400"})
    finally:
        os.chdir(before)
    return result.exit_code, result.stdout, result.stderr


def assert_refused(world: dict[str, Path], args: list[str], cwd: Path, says: str) -> None:
    before = tree(world["root"])
    code, out, err = merge_cli(*args, cwd=cwd)
    assert code == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert says in lines[0], lines[0]
    assert "not weights" not in err and "could not be loaded" not in err  # checked before loading
    assert tree(world["root"]) == before  # every file byte for byte, no temporary left


@pytest.mark.parametrize("force", [False, True])
def test_the_run_dir_holding_ckpt_is_refused(world, force) -> None:
    args = [str(world["ckpt"]), str(world["run"])] + (["--force"] if force else [])
    assert_refused(world, args, world["root"], "holds the checkpoint")


@pytest.mark.parametrize("force", [False, True])
def test_ckpt_itself_is_refused(world, force) -> None:
    args = [str(world["ckpt"]), str(world["ckpt"])] + (["--force"] if force else [])
    assert_refused(world, args, world["root"], "is the checkpoint")


@pytest.mark.parametrize("out", [".", "./", "src/..", "{project}"])
@pytest.mark.parametrize("force", [False, True])
def test_the_current_directory_is_refused_however_spelled(world, out, force) -> None:
    out = out.format(project=world["project"])
    args = [str(world["ckpt"]), out] + (["--force"] if force else [])
    assert_refused(world, args, world["project"], "is the current directory")


def test_a_parent_of_the_current_directory_is_refused_with_force(world) -> None:
    args = [str(world["ckpt"]), "..", "--force"]
    assert_refused(world, args, world["project"] / "src", "holds the current directory")
    args = [str(world["ckpt"]), str(world["root"]), "--force"]  # also holds CKPT
    assert_refused(world, args, world["project"], "holds")


@pytest.mark.parametrize("force", [False, True])
def test_an_existing_file_is_refused(world, force) -> None:
    args = [str(world["ckpt"]), str(world["root"] / "report.pdf")] + (["--force"] if force else [])
    assert_refused(world, args, world["root"], "is not a directory")


@pytest.mark.parametrize("out", ["link", "link/"])
@pytest.mark.parametrize("force", [False, True])
def test_a_symlink_to_a_directory_is_not_followed(world, out, force) -> None:
    args = [str(world["ckpt"]), out] + (["--force"] if force else [])
    assert_refused(world, args, world["root"], "is a symbolic link")


def test_a_users_non_empty_directory_is_refused_without_force(world) -> None:
    args = [str(world["ckpt"]), str(world["precious"])]
    assert_refused(world, args, world["root"], "exists and is not empty (2 entries)")


def test_a_missing_parent_that_is_a_file_is_refused(world) -> None:
    args = [str(world["ckpt"]), str(world["root"] / "report.pdf" / "merged")]
    assert_refused(world, args, world["root"], "is not a directory")


def test_the_base_model_directory_is_refused(world, lora_files) -> None:
    base, _ = lora_files
    args = [str(world["ckpt"]), str(world["root"] / "broken-base"), "--force"]
    assert_refused(world, args, world["root"], "is the base model")


# ------------------------------------------------------------------------------ what is written


@pytest.fixture()
def good_ckpt(world, lora_files) -> Path:
    """The world's checkpoint pointed back at the readable base."""
    base, _ = lora_files
    path = world["ckpt"] / "adapter_config.json"
    config = json.loads(path.read_text())
    config["base_model_name_or_path"] = str(base)
    path.write_text(json.dumps(config))
    return world["ckpt"]


def _adapted_equals(merged: Path, ckpt: Path) -> None:
    plain, _ = loading.load_checkpoint(merged)
    adapted, _ = loading.load_checkpoint(ckpt)  # the adapter merged on load
    assert not lora.is_lora(plain)
    a, b = dict(plain.named_parameters()), dict(adapted.named_parameters())
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_force_sets_a_non_empty_directory_aside_whole(world, good_ckpt) -> None:
    precious = world["precious"]
    kept = tree(precious)
    others = {k: v for k, v in tree(world["root"]).items() if not k.startswith("precious")}
    code, out, err = merge_cli(str(good_ckpt), str(precious), "--force", cwd=world["root"])
    assert code == 0, err
    aside = [p for p in world["root"].iterdir() if p.name.startswith("precious.replaced-")]
    assert len(aside) == 1 and tree(aside[0]) == kept  # the user's files, byte for byte
    assert f"its previous contents are in {aside[0]}" in " ".join(out.split())
    assert sorted(p.name for p in precious.iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    after = tree(world["root"])
    assert {k: after[k] for k in others} == others  # the run, project, file and link untouched
    assert not [p for p in world["root"].iterdir() if ".merge-" in p.name]  # no temporary
    _adapted_equals(precious, good_ckpt)


def test_a_new_or_empty_directory_needs_no_force(world, good_ckpt) -> None:
    empty = world["root"] / "empty"
    empty.mkdir()
    for out in (empty, world["root"] / "new" / "deeper"):
        code, _, err = merge_cli(str(good_ckpt), str(out), cwd=world["root"])
        assert code == 0, err
        assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
    assert not [p for p in world["root"].iterdir() if "replaced" in p.name or ".merge-" in p.name]
    _adapted_equals(empty, good_ckpt)


def test_the_console_command_refuses_a_users_directory(world) -> None:
    """The real entry point in a subprocess, from the project dir: `bapo merge-lora CKPT .`."""
    before = tree(world["root"])
    done = run_bapo("merge-lora", str(world["ckpt"]), ".", cwd=world["project"], timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.strip().splitlines() == [
        f"error: .: is the current directory ({world['project']}); merge-lora never replaces "
        "it, even with --force: name a new directory for the merged model"
    ]
    assert tree(world["root"]) == before

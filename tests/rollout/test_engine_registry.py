"""The engine registry names its engines and never imports them: `rollout.base.ENGINES` maps each
name to a `module:Class` path that `engine_class` loads by importlib, the engines import `base`
for the records, and nothing imports back (no circle, function-level imports included). vLLM is
imported only when `rollout=vllm` is chosen."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bapo_cli.config import schema
from bapo_cli.rollout import base
from bapo_cli.rollout.hf import HFEngine
from tests.conftest import REPO

ROLLOUT = REPO / "src" / "bapo_cli" / "rollout"


def _imports(path: Path) -> set[str]:
    """Every bapo_cli module `path` imports, at any depth of its code (function bodies too)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("bapo_cli"))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("bapo_cli"):
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)  # `from pkg import mod`
    return out


def test_rollout_imports_form_no_circle() -> None:
    modules = {f"bapo_cli.rollout.{p.stem}": p for p in ROLLOUT.glob("*.py")}
    edges = {name: _imports(path) & modules.keys() for name, path in modules.items()}
    assert edges["bapo_cli.rollout.base"] == set()  # the registry imports no engine
    assert "bapo_cli.rollout.base" in edges["bapo_cli.rollout.hf"]
    assert "bapo_cli.rollout.base" in edges["bapo_cli.rollout.vllm"]
    done: set[str] = set()

    def visit(name: str, path: tuple[str, ...]) -> None:
        assert name not in path, f"import circle: {' -> '.join((*path, name))}"
        if name not in done:
            for other in sorted(edges[name]):
                visit(other, (*path, name))
            done.add(name)

    for name in sorted(modules):
        visit(name, ())


def test_registry_names_every_engine_the_config_allows() -> None:
    assert sorted(base.ENGINES) == sorted(n for n in schema.ENGINES if n != "auto")
    assert base.engine_class("hf") is HFEngine


def test_unknown_engine_is_one_line() -> None:
    with pytest.raises(ValueError, match=r"^unknown rollout engine 'foo'; valid: hf, vllm$"):
        base.engine_class("foo")


def _python(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )


def test_choosing_hf_imports_no_vllm() -> None:
    done = _python(
        "import sys\n"
        "from bapo_cli.rollout import base\n"
        "print(base.engine_class('hf').__name__, base.choose('auto', 'cpu').name)\n"
        "print(sorted(m for m in sys.modules if m == 'vllm' or m.startswith('bapo_cli.rollout.')))"
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "HFEngine hf",
        "['bapo_cli.rollout.base', 'bapo_cli.rollout.hf']",
    ]


def test_vllm_that_cannot_import_is_one_line() -> None:
    # `import vllm` really fails here: a None entry in sys.modules is Python's "not importable"
    done = _python(
        "import sys\n"
        "sys.modules['vllm'] = None\n"
        "from bapo_cli.rollout import base\n"
        "try:\n"
        "    base.make_engine('vllm')\n"
        "except ValueError as exc:\n"
        "    print(exc)\n"
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("rollout=vllm: the vLLM engine cannot be loaded (import of vllm")
    assert done.stdout.rstrip().endswith("; use rollout=hf")


@pytest.mark.vllm
@pytest.mark.skipif(not base.vllm_available(), reason="vLLM is not installed")
def test_vllm_loads_by_its_path() -> None:
    done = _python(
        "import sys\n"
        "from bapo_cli.rollout import base\n"
        "assert 'vllm' not in sys.modules\n"
        "cls = base.engine_class('vllm')\n"
        "print(cls.__module__, cls.__name__, cls.name, 'vllm' in sys.modules)"
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "bapo_cli.rollout.vllm VLLMEngine vllm True"

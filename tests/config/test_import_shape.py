"""The shape of `bapo_cli.config`, read from its source with ast (every import, function-level and
TYPE_CHECKING ones included): config sits below models, rollout and staleness and above data,
rewards, algos and tracking (docs/architecture.md), so it imports nothing above it; its modules
import each other one way, at module level; and the registries of higher code it validates
against are loaded by name in one place, `config/registries.py`, not imported."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import bapo_cli.config
from bapo_cli.config import registries, schema
from bapo_cli.models import adapters

CONFIG = Path(bapo_cli.config.__file__).parent
PACKAGE = "bapo_cli.config"
# what config may import besides itself: the layers below it and the ground floor (modules at the
# package root, e.g. bapo_cli.threads)
BELOW = ("bapo_cli.data", "bapo_cli.rewards", "bapo_cli.algos", "bapo_cli.tracking")
SUBPACKAGES = {p.name for p in CONFIG.parent.iterdir() if (p / "__init__.py").is_file()}


def _module(path: Path) -> str:
    parts = path.relative_to(CONFIG.parent.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> dict[str, list[tuple[str, bool]]]:
    """config module -> [(imported bapo_cli name, inside a function?)]."""
    out: dict[str, list[tuple[str, bool]]] = {}
    for path in sorted(CONFIG.rglob("*.py")):
        tree = ast.parse(path.read_text())
        in_function = {
            id(node)
            for fn in ast.walk(tree)
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
            for node in ast.walk(fn)
        }
        found = []
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                assert node.level == 0, f"{path}: relative import"
                names = [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            found += [(n, id(node) in in_function) for n in names if n.startswith("bapo_cli")]
        out[_module(path)] = found
    return out


def _allowed(name: str) -> bool:
    if name.startswith((f"{PACKAGE}.", *(f"{b}." for b in BELOW))) or name in BELOW:
        return True
    top = name.split(".")[1] if "." in name else ""
    return name == "bapo_cli" or top not in SUBPACKAGES  # the ground floor


def _config_module(name: str, modules: set[str]) -> str | None:
    """The config module `name` (a module, or a name in one) resolves to."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def test_config_imports_nothing_above_it() -> None:
    found = _imports()
    upward = [f"{m} -> {n}" for m, names in found.items() for n, _ in names if not _allowed(n)]
    assert upward == []
    assert len(found) >= 15  # every module was read, schema/ included


def test_config_modules_import_each_other_one_way_at_module_level() -> None:
    found = _imports()
    modules = set(found)
    graph = {
        m: {_config_module(n, modules) for n, _ in names if n.startswith(f"{PACKAGE}.")} - {m, None}
        for m, names in found.items()
    }
    # an import of config inside a function is how a circle hides: there is none
    hidden = [
        f"{m} -> {n}"
        for m, names in found.items()
        for n, in_function in names
        if in_function and n.startswith(PACKAGE)
    ]
    assert hidden == []

    def reaches(start: str) -> set[str]:
        seen, todo = set(), list(graph[start])
        while todo:
            m = todo.pop()
            if m not in seen:
                seen.add(m)
                todo += graph.get(m, ())
        return seen

    assert sorted(m for m in graph if m in reaches(m)) == []
    # the schema does not import the Hydra wrapper (which registers it): config_dir is paths'
    assert "bapo_cli.config.hydra_runner" not in reaches("bapo_cli.config.schema")


def test_registries_is_the_one_place_config_loads_a_module_by_name() -> None:
    users = sorted(
        _module(path) for path in CONFIG.rglob("*.py") if "import_module" in path.read_text()
    )
    assert users == ["bapo_cli.config.registries"]
    with pytest.raises(ValueError, match="bapo_cli.trainer.train is not a config plug-in"):
        registries.load("bapo_cli.trainer.train", "train")


def test_importing_the_schema_loads_no_higher_layer_and_no_torch() -> None:
    code = (
        "import sys, bapo_cli.config.schema, bapo_cli.config.hydra_runner; "
        "print(sorted({m.split('.')[1] for m in sys.modules if m.startswith('bapo_cli.')}), "
        "'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["['config',", "'threads']", "False"]


def test_the_tables_higher_code_shares_with_config_are_configs() -> None:
    assert adapters.MAX_RANK is schema.MAX_LORA_RANK == 4096
    assert adapters.MAX_ALPHA is schema.MAX_LORA_ALPHA == 4.0 * 4096
    assert schema.WARMUP_TASK_NAMES == ("arith", "pairs")  # models.tiny checks its table on load

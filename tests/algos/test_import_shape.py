"""The shape of `bapo_cli.algos`, read from its source with ast (every import, function-level ones
included): it is the package's lowest layer, so it imports nothing else of bapo_cli; its modules
import each other one way (no circle), at module level only; and the bound search reads one way,
from the shared types in `bapo_path` up to the entry point `bounds`."""

from __future__ import annotations

import ast
from pathlib import Path

import bapo_cli.algos
from bapo_cli.algos.bapo_algorithm1 import BoundAccumulator
from bapo_cli.algos.bapo_path import BoundSearch, PathAccumulator
from bapo_cli.algos.bapo_recipe import RecipeAccumulator

ALGOS = Path(bapo_cli.algos.__file__).parent
PACKAGE = "bapo_cli.algos"


def _imports() -> dict[str, list[tuple[str, bool]]]:
    """module name -> [(imported bapo_cli module, inside a function?)] for every algos module."""
    out: dict[str, list[tuple[str, bool]]] = {}
    for path in sorted(ALGOS.glob("*.py")):
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
                assert node.level == 0, f"{path.name}: relative import"
                base = node.module or ""
                names = [
                    f"{base}.{a.name}" if (ALGOS / f"{a.name}.py").exists() else base
                    for a in node.names
                ]
            else:
                continue
            found += [(name, id(node) in in_function) for name in names]
        out[path.stem] = found
    return out


def _graph() -> dict[str, set[str]]:
    """algos module -> the algos modules it imports (the package itself left out)."""
    return {
        module: {
            name.removeprefix(f"{PACKAGE}.")
            for name, _ in found
            if name.startswith(f"{PACKAGE}.") and name != PACKAGE
        }
        - {module}
        for module, found in _imports().items()
    }


def _reaches(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), list(graph[start])
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo += graph.get(module, ())
    return seen


def test_algos_imports_nothing_above_it_and_nothing_inside_a_function() -> None:
    upward, hidden = [], []
    for module, found in _imports().items():
        for name, in_function in found:
            if name.startswith("bapo_cli") and not name.startswith(PACKAGE):
                upward.append(f"{module} -> {name}")
            if in_function:
                hidden.append(f"{module} -> {name}")
    assert upward == []
    assert hidden == []


def test_algos_has_no_import_circle() -> None:
    graph = _graph()
    assert len(graph) >= 20  # every module was read
    circles = sorted(m for m in graph if m in _reaches(graph, m))
    assert circles == []


def test_the_bound_search_reads_one_way() -> None:
    graph = _graph()
    # the shared types import no part of the search; the two searches not each other
    assert graph["bapo_path"] == {"params"}
    assert graph["bapo_locator"] == {"bapo_path"}
    assert graph["bapo_algorithm1"] == {"bapo_path", "bapo_locator"}
    assert graph["bapo_recipe"] == {"bapo_path", "bapo_locator"}
    assert {"bapo_path", "bapo_locator", "bapo_algorithm1", "bapo_recipe"} <= graph["bounds"]


def test_each_rule_has_its_accumulator_registered_where_it_is_defined() -> None:
    assert PathAccumulator.of_rule("paper") is BoundAccumulator
    assert PathAccumulator.of_rule("recipe") is RecipeAccumulator
    for rule, cls in (("paper", BoundAccumulator), ("recipe", RecipeAccumulator)):
        acc = BoundSearch(rule=rule).accumulator(3.0)
        assert type(acc) is cls and acc.rule == rule and acc.dual_clip == 3.0
        assert acc.path == BoundSearch(rule=rule).path()

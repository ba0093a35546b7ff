"""docs/architecture.md names only what exists (issue 44): every file it names (a path, or a bare
`x.py` under the layout's directory it is listed in), every `bapo_cli.` module path, and every
`module.name` it quotes in backticks, when `module` is one of the package's modules. The table of
files touched before and after the refactors describes the code as it was, so it is left out."""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

import bapo_cli

PACKAGE = Path(bapo_cli.__file__).parent
REPO = PACKAGE.parents[1]
DOC = REPO / "docs" / "architecture.md"
HISTORY = "## Files touched, before and after"


def _text() -> str:
    text = DOC.read_text(encoding="utf-8")
    start = text.index(HISTORY)
    end = text.find("\n## ", start + 1)
    return text[:start] + (text[end:] if end >= 0 else "")


@cache
def _modules() -> dict[str, list[Path]]:
    """Module name (file stem) -> the package's files of that name."""
    found: dict[str, list[Path]] = {}
    for path in PACKAGE.rglob("*.py"):
        found.setdefault(path.stem, []).append(path)
    return found


def _defines(path: Path, name: str) -> bool:
    """Whether the module defines `name` at top level or in one of its classes."""
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names = [node.name]
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names = [t.id for t in targets if isinstance(t, ast.Name)]
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.asname or a.name for a in node.names]
        else:
            continue
        if name in names:
            return True
    return False


def _layout_files(text: str) -> list[tuple[str, str]]:
    """(directory, file) for the bare `x.py` names of the layout block, by the directory of the
    entry they are listed under."""
    block = text.split("```", 2)[1]
    out, directory = [], ""
    for line in block.splitlines():
        entry = re.match(r"^  (\S+)\s", line)
        if entry:
            directory = entry.group(1) if entry.group(1).endswith("/") else ""
        for name in re.findall(r"(?<![\w/.])(\w+\.py)\b", line):
            if directory:
                out.append((directory, name))
    return out


def test_every_named_file_exists() -> None:
    text, missing = _text(), []
    roots = (PACKAGE, REPO, REPO / "docs")
    for path in set(re.findall(r"(?<![\w.])((?:\w+/)+\w+\.(?:py|md|json|yaml))\b", text)):
        example = "/my_" in path  # "Adding a loss": the file a user writes
        if not example and not any((root / path).exists() for root in roots):
            missing.append(path)
    for directory, name in _layout_files(text):
        if not list((PACKAGE / directory).rglob(name)):
            missing.append(f"{directory}{name}")
    for name in set(re.findall(r"(?<![\w/.])(\w+\.py)\b", text)):
        if not list(PACKAGE.rglob(name)) and not list(REPO.glob(f"*/{name}")):
            missing.append(name)
    assert not missing, sorted(set(missing))


def test_every_named_module_and_name_exists() -> None:
    text, missing = _text(), []
    for dotted in set(re.findall(r"\bbapo_cli(?:\.\w+)+", text)):
        parts = dotted.split(".")[1:]
        path = PACKAGE.joinpath(*parts)
        if path.is_dir() or path.with_suffix(".py").exists():
            continue
        owner = PACKAGE.joinpath(*parts[:-1]).with_suffix(".py")
        if not (owner.exists() and _defines(owner, parts[-1])):
            missing.append(dotted)
    for module, name in set(re.findall(r"`(\w+)\.(\w+)[`(]", text)):
        files = _modules().get(module, [])
        if name not in ("py", "md") and len(files) == 1 and not _defines(files[0], name):
            missing.append(f"{module}.{name}")
    assert not missing, sorted(set(missing))


def test_the_check_sees_what_moved() -> None:
    assert not _defines(PACKAGE / "trainer" / "samples.py", "write_samples")
    assert ("trainer/", "setup.py") in _layout_files(_text())

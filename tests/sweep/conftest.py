"""Helpers of the sweep tests: the analysis scripts under scripts/ are not a package, so the tests
load them by path."""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType

from tests.conftest import REPO


def load_script(name: str) -> ModuleType:
    """scripts/<name>.py as the module `name`, with scripts/ on sys.path for its own imports of
    the other scripts; registered in sys.modules before it runs, since its dataclasses look
    their module up there."""
    scripts = str(REPO / "scripts")
    if scripts not in sys.path:
        sys.path.insert(0, scripts)
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module

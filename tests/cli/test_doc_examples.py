"""The docs' example errors are what the CLI prints today (docs/cli.md, "Bad input costs one line").

The examples were typed by hand once and drifted (the unknown-`algo` line listed 4 algorithms
when there were 10); here every `$ bapo ...` line of that block is run through the real CLI and
its error line compared with the one written under it. When an option is added the test fails
with the line to paste.
"""

from __future__ import annotations

import re
import shlex

import pytest
from typer.testing import CliRunner

from bapo_cli.cli import app
from bapo_cli.config.errors import USAGE_EXIT_CODE
from tests.conftest import REPO

runner = CliRunner()


def _examples() -> list[tuple[str, str]]:
    """(command, error line) pairs of docs/cli.md's first console block; a trailing `# ...`
    on an error line is commentary, not output."""
    text = (REPO / "docs" / "cli.md").read_text()
    block = re.search(r"```\n(\$ bapo .*?)```", text, re.S).group(1)
    lines = block.strip().splitlines()
    pairs = list(zip(lines[::2], lines[1::2], strict=True))
    return [(cmd.removeprefix("$ "), re.sub(r"\s+# .*$", "", err)) for cmd, err in pairs]


EXAMPLES = _examples()


def test_the_block_has_the_unknown_option_example() -> None:
    assert EXAMPLES[0][0] == "bapo config algo=foo"
    assert any(cmd.startswith("bapo train staleness=") for cmd, _ in EXAMPLES)


@pytest.mark.parametrize(("command", "written"), EXAMPLES, ids=[c for c, _ in EXAMPLES])
def test_each_example_error_is_what_the_cli_prints(command: str, written: str) -> None:
    args = shlex.split(command)[1:]  # without the program name
    result = runner.invoke(app, args, env={"COLUMNS": "1000"})
    assert result.exit_code == USAGE_EXIT_CODE, result.output
    printed = result.output.strip().splitlines()[-1]
    assert printed == written, f"docs/cli.md: replace the line under `$ {command}` with\n{printed}"

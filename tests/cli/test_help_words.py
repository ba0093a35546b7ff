"""`--help` in the user's words (issue 44, item 5): no module paths, no syntax the command does
not take (a sweep's `key=1,2,3` only where -m exists), each docstring paragraph one line the
console wraps (not the source's line breaks), and text such as `benchmark=[a,b]` printed as
written rather than eaten as markup."""

from __future__ import annotations

import inspect

import pytest
from typer.testing import CliRunner

from bapo_cli.cli import app

COMMANDS = [info.name or info.callback.__name__ for info in app.registered_commands]


def _help(*args: str) -> str:
    done = CliRunner().invoke(app, [*args, "--help"], env={"COLUMNS": "300"})
    assert done.exit_code == 0, done.output
    return done.output


@pytest.mark.parametrize("command", COMMANDS)
def test_help_says_it_in_the_users_words(command: str) -> None:
    shown = _help(command)
    assert "bapo_cli" not in shown
    sweeps = "--multirun" in shown
    assert ("1,2,3" in shown) == sweeps, "sweep syntax only where -m exists"
    info = next(i for i in app.registered_commands if (i.name or i.callback.__name__) == command)
    doc = inspect.getdoc(info.callback) or ""
    for paragraph in doc.split("\n\n"):
        assert " ".join(paragraph.split()) in shown, paragraph  # whole, on one line


def test_the_ui_and_serve_helps_named_in_the_issue() -> None:
    assert "stops all of it" in _help("ui")
    assert "with -m" not in _help("serve")
    assert "`benchmark=[aime24,aime25]`" in _help("eval")

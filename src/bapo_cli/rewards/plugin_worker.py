"""The reward=python worker process: ``python -m bapo_cli.rewards.plugin_worker <reward.fn>``.

It imports the user's function once, then answers ``fn(response, reference, record)`` requests
over stdin/stdout (see `guard.serve`). Whatever the function raises or returns is turned into a
reply here -- ``{"score": x}`` or ``{"error": "ValueError: ..."}`` -- so the parent can log the
message and count it; the parent enforces the time limit by killing this process.
"""

from __future__ import annotations

import argparse
from typing import Any

from bapo_cli.rewards.guard import serve
from bapo_cli.rewards.plugin import load_fn, score


def _describe(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0][:300]}" if lines else type(err).__name__


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bapo_cli.rewards.plugin_worker")
    parser.add_argument("spec", help="module:function or path/to/file.py:function")
    args = parser.parse_args(argv)
    fn = load_fn(args.spec)

    def handle(response: str, reference: str, record: Any) -> dict[str, Any]:
        try:
            return {"score": score(fn(response, reference, record))}
        except Exception as err:  # the user's bug scores 0 and is counted, never fatal
            return {"error": _describe(err)}

    serve(handle)


if __name__ == "__main__":
    main()

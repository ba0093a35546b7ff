"""The reward=python worker process: ``python -m bapo_cli.rewards.plugin_worker <reward.fn>``.

It imports the user's function once, then answers ``fn(response, reference, record)`` requests
over stdin/stdout (see `guard.serve`). Whatever the function raises or returns is turned into a
reply here -- ``{"score": x}`` or ``{"error": "ValueError: ..."}`` -- so the parent can log the
message and count it; the parent enforces the time limit by killing this process.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from bapo_cli.rewards.guard import limit_memory, serve
from bapo_cli.rewards.plugin import RewardPluginError, check_in_process, load_fn, score


def _describe(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0][:300]}" if lines else type(err).__name__


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bapo_cli.rewards.plugin_worker")
    parser.add_argument("spec", help="module:function or path/to/file.py:function")
    parser.add_argument("--memory-mb", type=int, default=None, help="address-space cap (MiB)")
    parser.add_argument(
        "--check", action="store_true", help="import and check it, answer one JSON line, exit"
    )
    args = parser.parse_args(argv)
    if args.memory_mb is not None:
        limit_memory(args.memory_mb)  # before the import: the module's own allocations count
    if args.check:
        _check(args.spec)
        return
    fn = load_fn(args.spec)

    def handle(response: str, reference: str, record: Any) -> dict[str, Any]:
        try:
            return {"score": score(fn(response, reference, record))}
        except Exception as err:  # the user's bug scores 0 and is counted, never fatal
            return {"error": _describe(err)}

    serve(handle)


def _check(spec: str) -> None:
    """Answer `{"check": "ok"}` or `{"check": "<one line>"}` on the real stdout (the module's
    own prints go to stderr)."""
    answer = os.fdopen(os.dup(sys.stdout.fileno()), "w", encoding="utf-8")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    try:
        check_in_process(spec)
        verdict = "ok"
    except RewardPluginError as err:
        verdict = str(err)
    answer.write(json.dumps({"check": verdict}) + "\n")
    answer.flush()
    sys.stderr.flush()
    os._exit(0)  # threads or processes the module started at import must not keep us waiting


if __name__ == "__main__":
    main()

"""The math-verify worker process: ``python -m bapo_cli.rewards.worker`` (started by the grader).

It imports math-verify once, warms up its parser, then answers ``verify_latex(reference, answer)``
requests over stdin/stdout (see `guard.serve`). math-verify's own signal-based timeouts are off;
the parent enforces the limit by killing this process. Its loggers are set to ERROR because on
failure they log the entire input (a 1 MB line per hostile sample).
"""

from __future__ import annotations

import argparse
import logging

from bapo_cli.rewards.guard import limit_memory, serve
from bapo_cli.rewards.math_grader import verify_latex


def _warmup() -> None:
    for name in ("math_verify", "latex2sympy2_extended"):
        logging.getLogger(name).setLevel(logging.ERROR)
    verify_latex("\\frac{1}{2}", "0.5")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bapo_cli.rewards.worker")
    parser.add_argument("--memory-mb", type=int, default=None, help="address-space cap (MiB)")
    args = parser.parse_args(argv)
    if args.memory_mb is not None:
        limit_memory(args.memory_mb)
    serve(verify_latex, warmup=_warmup)


if __name__ == "__main__":
    main()

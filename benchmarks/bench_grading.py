r"""Grading throughput on AIME-style answers, on one core, and what a hostile answer costs.

    python benchmarks/bench_grading.py            # ~30 s
    python benchmarks/bench_grading.py --n 5000 --timeout 5

Workloads (responses carry ~2 KB of "reasoning" before the final box, like real generations):

- aime-int:     boxed integers, 70% right, some zero-padded ("033"); all decided by the fast path.
- aime-mixed:   90% integers, 10% answers that need math-verify (``\frac{k}{2k}`` vs ``0.5``,
                ``\sqrt{4k^2}`` vs ``2k``), every one distinct, so the cache does not help.
- math-verify:  only such answers, graded through the worker process.
- in-process:   the same through ``verify_latex`` directly (no worker, no limit): the IPC cost.
- repeated:     16 samples per problem with the same non-integer answer (the cache's case).

Then the hostile rows: a power tower ``9^{9^{9^9}}`` (killed at the limit), the worker's restart,
and a 1 MB response (rejected before parsing). The process and its worker are pinned to one CPU
(``os.sched_setaffinity``) where the OS allows it.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import time

from rich.console import Console
from rich.table import Table

from bapo_cli.rewards import MathGrader, verify_latex
from bapo_cli.rewards.math_grader import extract_answer, reference_answer

REASONING = ("Let us compute the sum of the roots step by step. " * 40).strip()


def _response(answer: str) -> str:
    return f"{REASONING}\nTherefore the final answer is $\\boxed{{{answer}}}$."


def aime_int(n: int, rng: random.Random) -> tuple[list[str], list[str]]:
    responses, references = [], []
    for _ in range(n):
        ref = rng.randrange(0, 1000)
        ans = ref if rng.random() < 0.7 else rng.randrange(0, 1000)
        text = f"{ans:03d}" if rng.random() < 0.2 else str(ans)
        responses.append(_response(text))
        references.append(str(ref))
    return responses, references


def needs_math_verify(n: int, rng: random.Random, start: int = 1) -> tuple[list[str], list[str]]:
    responses, references = [], []
    for k in range(start, start + n):
        kind = k % 3
        if kind == 0:
            responses.append(_response(f"\\frac{{{k}}}{{{2 * k}}}"))
            references.append("0.5")
        elif kind == 1:
            responses.append(_response(f"\\sqrt{{{4 * k * k}}}"))
            references.append(str(2 * k if rng.random() < 0.8 else 2 * k + 1))
        else:
            responses.append(_response(f"\\dfrac{{{k}}}{{4}}"))
            references.append(str(k / 4))
    return responses, references


def aime_mixed(n: int, rng: random.Random) -> tuple[list[str], list[str]]:
    r1, f1 = aime_int(n - n // 10, rng)
    r2, f2 = needs_math_verify(n // 10, rng, start=10_000)
    pairs = list(zip(r1 + r2, f1 + f2, strict=True))
    rng.shuffle(pairs)
    return [p[0] for p in pairs], [p[1] for p in pairs]


def repeated(n: int) -> tuple[list[str], list[str]]:
    problems = max(n // 16, 1)
    responses = [_response(f"\\frac{{{p}}}{{{p + 1}}}") for p in range(problems) for _ in range(16)]
    references = [f"\\frac{{{2 * p}}}{{{2 * p + 2}}}" for p in range(problems) for _ in range(16)]
    return responses, references


def _rate(seconds: float, count: int) -> str:
    return f"{count / seconds:,.0f}" if seconds > 0 else "inf"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=2000, help="samples per fast workload")
    parser.add_argument("--n-slow", type=int, default=300, help="samples per math-verify workload")
    parser.add_argument("--timeout", type=float, default=5.0, help="per-sample limit (s)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    rng = random.Random(args.seed)
    console = Console(width=110)
    table = Table(title=f"Grading, one core (limit {args.timeout:g} s per sample)")
    for column in ("workload", "samples", "seconds", "samples/s", "right", "via math-verify"):
        table.add_column(column, justify="right" if column != "workload" else "left")

    with MathGrader(timeout_s=args.timeout, cache_size=64) as grader:
        t0 = time.perf_counter()
        grader.grade(_response("\\frac12"), "0.5")
        startup = time.perf_counter() - t0

        workloads = {
            "aime-int (grade_many)": aime_int(args.n, rng),
            "aime-mixed (grade_many)": aime_mixed(args.n, rng),
            "math-verify (grade_many)": needs_math_verify(args.n_slow, rng, start=20_000),
            "repeated x16 (grade_many)": repeated(args.n_slow),
        }
        for name, (responses, references) in workloads.items():
            before = grader.stats["math_verify"]
            t0 = time.perf_counter()
            verdicts = grader.grade_many(responses, references)
            seconds = time.perf_counter() - t0
            table.add_row(
                name,
                str(len(responses)),
                f"{seconds:.3f}",
                _rate(seconds, len(responses)),
                f"{sum(verdicts) / len(verdicts):.0%}",
                str(grader.stats["math_verify"] - before),
            )

        responses, references = aime_int(args.n, rng)
        t0 = time.perf_counter()
        verdicts = [grader.grade(r, f) for r, f in zip(responses, references, strict=True)]
        seconds = time.perf_counter() - t0
        table.add_row(
            "aime-int (grade, one by one)",
            str(len(responses)),
            f"{seconds:.3f}",
            _rate(seconds, len(responses)),
            f"{sum(verdicts) / len(verdicts):.0%}",
            "0",
        )

        responses, references = needs_math_verify(args.n_slow, rng, start=50_000)
        pairs = [
            (extract_answer(r), reference_answer(f))
            for r, f in zip(responses, references, strict=True)
        ]
        verify_latex("\\frac12", "0.5")  # import math-verify here before timing
        t0 = time.perf_counter()
        verdicts = [verify_latex(f, a) for a, f in pairs]
        seconds = time.perf_counter() - t0
        table.add_row(
            "math-verify in-process (no limit)",
            str(len(pairs)),
            f"{seconds:.3f}",
            _rate(seconds, len(pairs)),
            f"{sum(verdicts) / len(verdicts):.0%}",
            str(len(pairs)),
        )
        console.print(table)

        hostile = Table(title="Hostile answers")
        hostile.add_column("input", justify="left")
        hostile.add_column("verdict")
        hostile.add_column("seconds", justify="right")
        hostile.add_row("worker start-up (first slow sample)", "-", f"{startup:.2f}")
        for label, response, reference in [
            ("power tower 9^{9^{9^9}} (killed at the limit)", _response("9^{9^{9^9}}"), "5"),
            ("next slow sample (includes the restart)", _response("\\frac{7}{14}"), "0.5"),
            ("1 MB response, box at the end", "x" * 1_000_000 + "\\boxed{5}", "5"),
            ("1 MB inside an unclosed box", "\\boxed{" + "{" * 1_000_000, "5"),
            ("5,000 nested braces", "\\boxed{" + "{" * 5000 + "5" + "}" * 5000 + "}", "5"),
        ]:
            t0 = time.perf_counter()
            verdict = grader.grade(response, reference)
            hostile.add_row(label, str(verdict), f"{time.perf_counter() - t0:.3f}")
        console.print(hostile)
        console.print(f"stats: {grader.stats}, worker starts: {grader.worker.starts}")


if __name__ == "__main__":
    main()

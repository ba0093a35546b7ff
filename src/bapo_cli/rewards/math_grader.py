r"""Is a model's final answer mathematically equal to the reference? Fast, bounded, never eval'd.

A response is graded in three steps, cheapest first:

1. **Extract** the content of the last ``\boxed{...}`` (`extract.last_boxed`). No box, an unclosed
   box, an answer over `MAX_ANSWER_CHARS` or nested deeper than `MAX_BRACE_DEPTH` → wrong, without
   any parsing (a 1 MB response costs a few ms here).
2. **Fast path** (`fast_verdict`): compare ``normalize_answer`` forms. Equal → right. Both integers
   (AIME) and different → wrong. Both plain decimals → compared exactly. Most AIME samples end here
   and never touch sympy.
3. **math-verify** (`verify_latex`): ``parse`` + ``verify`` on the reference and the answer, each
   given LaTeX context as ``$\boxed{...}$``. Parsed raw, references such as ``\sqrt{12}`` or
   ``\frac34`` do not parse and right answers are marked wrong; inside a box they parse. Only
   math-verify's LaTeX extractor is used: its plain-expression extractor calls sympy's
   ``parse_expr``, which ``eval``s the text, and model text is never eval'd.

Step 3 runs in a `guard.TimeLimitedWorker` (a persistent child process) with math-verify's own
signal timeouts turned off (they only work in the main thread). A comparison that exceeds
``timeout_s`` — ``9^{9^{9^9}}`` would run for hours — kills the child and counts as wrong; the next
slow sample restarts it. Each timeout logs one line with the answer cut to 80 characters. Results
of step 3 are cached per (reference, answer), since groups of samples repeat the same answer.

Why a pool and a budget: one worker grades slow answers one after another, so a batch of k answers
that all time out costs k × (timeout_s + a restart), ~39 s for six at 5 s. ``MathGrader(workers=W)``
keeps W workers (each started on first need) and `grade_batch` hands a batch's slow answers to them
in parallel threads, so that batch costs about k / W rounds. ``budget_s`` bounds the whole batch:
before each answer a thread checks the deadline, waits for a restarting worker only until the
deadline (the worker goes on starting, ready for the next batch), and cuts the comparison at the
deadline; answers left when it has passed score False unread and are counted as ``over_budget``.
The fast path and cached verdicts are never cut. `GradeReport` says what a batch gave and cost.

``MathGrader`` owns its workers; ``bapo_cli.rewards.grade`` uses a shared default instance.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation

from bapo_cli.rewards.extract import brace_depth, is_integer, last_boxed, normalize_answer
from bapo_cli.rewards.guard import TimeLimitedWorker, fan_out

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "MAX_ANSWER_CHARS",
    "MAX_BRACE_DEPTH",
    "GradeReport",
    "MathGrader",
    "extract_answer",
    "fast_verdict",
    "reference_answer",
    "verify_latex",
]

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 5.0
MAX_ANSWER_CHARS = 2000  # longer "answers" (and references) are wrong without parsing
# math-verify's LaTeX parser is exponential in bare nested braces ("{{{x}}}": costs in
# docs/faults.md); MATH-500's references nest at most 2 levels.
MAX_BRACE_DEPTH = 10
WORKER_MODULE = "bapo_cli.rewards.worker"

_DECIMAL = re.compile(r"[+-]?(?:\d+\.?\d*|\.\d+)", re.ASCII)


def extract_answer(response: str) -> str | None:
    """The final answer of a response (last box), None when there is none or it is too long."""
    return last_boxed(response, max_chars=MAX_ANSWER_CHARS)


def reference_answer(reference: str) -> str:
    r"""A dataset reference as a bare answer: ``$\boxed{5}$`` and ``5`` both give ``5``."""
    ref = reference.strip()
    if "\\boxed" in ref or "\\fbox" in ref:
        ref = last_boxed(ref) or ref
    return ref.strip().strip("$").strip()


def _hostile(s: str) -> bool:
    return len(s) > MAX_ANSWER_CHARS or brace_depth(s) > MAX_BRACE_DEPTH


def fast_verdict(answer: str | None, reference: str) -> bool | None:
    """True/False when string rules decide; None when math-verify must look.

    ``answer`` is the extracted answer (None: no answer) and ``reference`` a bare reference.
    """
    if answer is None or not answer.strip() or not reference.strip():
        return False
    if _hostile(answer) or _hostile(reference):
        return False
    na, nr = normalize_answer(answer), normalize_answer(reference)
    if na == nr:
        return bool(na)
    if is_integer(na) and is_integer(nr):
        return False
    if len(na) < 64 and len(nr) < 64 and _DECIMAL.fullmatch(na) and _DECIMAL.fullmatch(nr):
        try:
            if Decimal(na) == Decimal(nr):
                return True
        except InvalidOperation:  # pragma: no cover - the regex admits only valid decimals
            return None
        if is_integer(nr):
            return False
    return None


def verify_latex(reference: str, answer: str) -> bool:
    """math-verify on two bare LaTeX answers, in this process and with no time limit.

    The worker calls this; call it directly only on trusted or already-bounded input.
    """
    from math_verify import LatexExtractionConfig, parse, verify

    config = (LatexExtractionConfig(boxed_match_priority=0),)
    gold = parse(f"$\\boxed{{{reference}}}$", extraction_config=config, parsing_timeout=None)
    if not gold:
        return False
    pred = parse(f"$\\boxed{{{answer}}}$", extraction_config=config, parsing_timeout=None)
    if not pred:
        return False
    return bool(verify(gold, pred, timeout_seconds=None))


@dataclass(frozen=True)
class GradeReport:
    """One batch's verdicts and what grading cost it, counted per response (responses that share
    an answer and a reference share one comparison, and each counts)."""

    verdicts: list[bool]
    timeouts: int = 0
    """Compared by math-verify until ``timeout_s`` ran out: scored False."""
    over_budget: int = 0
    """Not compared, or cut short, because the batch's ``budget_s`` was spent: scored False."""
    errors: int = 0
    """reward=python: the function raised, returned a non-number or its process died: scored 0."""
    scores: list[float] | None = None
    """reward=python: the rewards themselves (None: each verdict is the reward, 1.0 or 0.0)."""
    ungradeable: int = 0
    """Responses with no answer the grader can read (math: no closed ``\\boxed{}``, or one over
    `MAX_ANSWER_CHARS`): scored 0 without a comparison. All of a run's responses ungradeable is
    the silent zero-signal case: the model never writes the form the grader reads."""

    def rewards(self) -> list[float]:
        """The reward of each response: ``scores``, or the verdicts as 1.0 / 0.0."""
        return list(self.scores) if self.scores is not None else [float(v) for v in self.verdicts]


class MathGrader:
    """Grades responses against references with a pool of time-limited math-verify workers.

    ``timeout_s`` bounds each math-verify comparison (a timeout counts as wrong and is cached);
    ``workers`` is how many answers are compared at once (each worker process is started on first
    need and kept); ``memory_limit_mb`` caps each worker's address space (RLIMIT_AS, POSIX; None:
    no cap) so a runaway sympy computation fails with MemoryError instead of swapping the machine.

    Thread-safe. ``stats`` counts how samples were decided: ``fast`` (steps 1-2), ``math_verify``,
    ``cached``, ``timeout``, ``over_budget``, ``crashed``, ``error``. ``close()`` kills the workers;
    the grader remains usable and starts new ones when it next needs them.
    """

    def __init__(
        self,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        workers: int = 1,
        cache_size: int = 4096,
        startup_timeout_s: float = 120.0,
        memory_limit_mb: int | None = 4096,
    ) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        if not (isinstance(workers, int) and workers >= 1):
            raise ValueError(f"workers must be an integer >= 1, got {workers!r}")
        self.timeout_s = float(timeout_s)
        self.cache_size = int(cache_size)
        args = () if memory_limit_mb is None else ("--memory-mb", str(int(memory_limit_mb)))
        self.pool = [
            TimeLimitedWorker(WORKER_MODULE, args=args, startup_timeout_s=startup_timeout_s)
            for _ in range(workers)
        ]
        self.worker = self.pool[0]  # the one a lone slow answer goes to
        self.stats = dict.fromkeys(
            ("fast", "math_verify", "cached", "timeout", "over_budget", "crashed", "error"), 0
        )
        self._cache: OrderedDict[tuple[str, str], bool] = OrderedDict()
        self._cache_lock = threading.Lock()

    def grade(self, response: str, reference: str, *, timeout_s: float | None = None) -> bool:
        """True iff the last boxed answer in ``response`` equals ``reference``."""
        return self.grade_many([response], [reference], timeout_s=timeout_s)[0]

    def grade_many(
        self,
        responses: Sequence[str],
        references: Sequence[str],
        *,
        timeout_s: float | None = None,
    ) -> list[bool]:
        """Grade pairs; fast ones inline, the rest in the workers (each ≤ timeout_s)."""
        return self.grade_batch(responses, references, timeout_s=timeout_s).verdicts

    def grade_batch(
        self,
        responses: Sequence[str],
        references: Sequence[str],
        *,
        timeout_s: float | None = None,
        budget_s: float | None = None,
    ) -> GradeReport:
        """Grade pairs: fast ones inline, slow ones in parallel on the pool (each ≤ timeout_s),
        all of them within ``budget_s`` seconds of wall time (None: no bound)."""
        t0 = time.perf_counter()
        if len(responses) != len(references):
            raise ValueError(
                f"{len(responses)} responses but {len(references)} references: pass one each"
            )
        if budget_s is not None and not budget_s >= 0:
            raise ValueError(f"budget_s must be >= 0 or None, got {budget_s!r}")
        limit = self.timeout_s if timeout_s is None else float(timeout_s)
        results: list[bool | None] = []
        slow: dict[tuple[str, str], list[int]] = {}
        unread = 0
        for i, (response, reference) in enumerate(zip(responses, references, strict=True)):
            answer = extract_answer(response) if isinstance(response, str) else None
            unread += answer is None
            ref = reference_answer(reference) if isinstance(reference, str) else ""
            verdict = fast_verdict(answer, ref)
            if verdict is None:
                slow.setdefault((ref, answer), []).append(i)
            results.append(verdict)
        todo: list[tuple[str, str]] = []
        with self._cache_lock:
            self.stats["fast"] += len(results) - sum(len(v) for v in slow.values())
            for key, indices in slow.items():
                if key in self._cache:
                    self._cache.move_to_end(key)
                    self.stats["cached"] += 1
                    for i in indices:
                        results[i] = self._cache[key]
                else:
                    todo.append(key)
        deadline = None if budget_s is None else t0 + budget_s
        counts = {"timeout": 0, "over_budget": 0}
        for key, (status, verdict) in self._compare_all(todo, limit, deadline).items():
            for i in slow[key]:
                results[i] = verdict
            if status in counts:
                counts[status] += len(slow[key])
        if counts["over_budget"]:
            logger.warning(
                "math grading budget of %.1f s spent: %d answers scored 0 without a verdict",
                budget_s,
                counts["over_budget"],
            )
        return GradeReport(
            [bool(r) for r in results],
            counts["timeout"],
            counts["over_budget"],
            ungradeable=unread,
        )

    def _compare_all(
        self, keys: list[tuple[str, str]], limit: float, deadline: float | None
    ) -> dict[tuple[str, str], tuple[str, bool]]:
        """(status, verdict) of every key, from min(len(keys), workers) threads, one per worker."""
        out: dict[tuple[str, str], tuple[str, bool]] = {}

        def compare(worker: TimeLimitedWorker, key: tuple[str, str]) -> None:
            out[key] = self._compare(worker, key, limit, deadline)

        fan_out(self.pool, keys, compare)
        return out

    def _compare(
        self,
        worker: TimeLimitedWorker,
        key: tuple[str, str],
        timeout_s: float,
        deadline: float | None,
    ) -> tuple[str, bool]:
        limit, cut = timeout_s, False
        if deadline is not None:
            if time.perf_counter() >= deadline:
                return self._count("over_budget", key, False)
            # a restart after a timeout is paid from the budget: wait for it until the deadline
            # at most (past it the child goes on starting, ready for the next batch)
            if not worker.start(wait_s=deadline - time.perf_counter()):
                return self._count("over_budget", key, False)
            left = deadline - time.perf_counter()
            if left <= 0:
                return self._count("over_budget", key, False)
            limit, cut = min(timeout_s, left), left < timeout_s
        outcome = worker.call(key, limit)
        status = outcome.status
        if status == "timeout" and cut:
            status = "over_budget"  # stopped by the deadline, not by its own limit
        verdict = status == "ok" and outcome.value is True
        if status == "timeout":
            logger.warning(
                "math grading timed out after %.1f s, counted wrong; answer %r",
                timeout_s,
                key[1][:80],
            )
        elif status in ("crashed", "error"):
            logger.warning(
                "math grading %s (%s), counted wrong; answer %r",
                status,
                outcome.value,
                key[1][:80],
            )
        return self._count(status, key, verdict)

    def _count(self, status: str, key: tuple[str, str], verdict: bool) -> tuple[str, bool]:
        with self._cache_lock:
            self.stats["math_verify" if status == "ok" else status] += 1
            # a crash may be the machine's fault, a cut answer did not get its time: retry later
            if status not in ("crashed", "over_budget"):
                self._cache[key] = verdict
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
        return status, verdict

    def close(self) -> None:
        """Kill the worker processes (restarted lazily if the grader is used again)."""
        for worker in self.pool:
            worker.close()

    def __enter__(self) -> MathGrader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

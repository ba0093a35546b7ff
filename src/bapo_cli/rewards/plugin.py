"""`reward=python`: a user's reward function, called as ``fn(response, reference, record)``.

``reward.fn`` names it as ``module:function`` (importable from the working directory or
PYTHONPATH) or ``path/to/file.py:function``. It returns a float or a bool (True = 1.0); the
record is the prompt's source row as plain JSON data (a dataset row with all its columns; for the
synthetic tasks ``{"id", "problem", "answer", "kind"}``).

Why worker processes: a user's function may hang, crash or leak, and a Python thread cannot be
stopped, so it runs like math-verify does (`guard.TimeLimitedWorker`): ``reward.workers``
processes, each importing the function once, ``reward.timeout_s`` per call, the step's
``reward.step_budget_s`` over a batch. What a call can end in, and what it scores:

    a float / bool     that value (bool as 1.0 / 0.0), if finite and within ±`MAX_ABS_REWARD`
    an exception       0.0, counted in ``reward/errors``; the first message is logged once
    another value      0.0, counted in ``reward/errors`` (NaN, inf, 1e308, None, a string: not a
                       reward; one such value would make the step's reward/mean inf or NaN)
    the process died   0.0, counted in ``reward/errors`` (sys.exit, a segfault); restarted
    past timeout_s     0.0, counted in ``reward/timeouts``; the process is killed and restarted
    past the budget    0.0 unread, counted in ``reward/over_budget``

`check_spec` (run by preflight, before any model loads) imports the function in a child process
of its own, under `IMPORT_TIMEOUT_S`, and checks that it takes three arguments, so a typo fails in
one line rather than in the first step, and a module that hangs, calls ``sys.exit`` or crashes
the interpreter at import is one line too, never a hung or silently ended `bapo train`. The
worker processes run under the same address-space cap as the math-verify workers
(``memory_limit_mb``, RLIMIT_AS): a leaking function fails its calls with MemoryError (counted in
``reward/errors``) instead of swapping the machine.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import logging
import math
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from bapo_cli import redact
from bapo_cli.rewards.guard import TimeLimitedWorker, child_env, fan_out
from bapo_cli.rewards.math_grader import GradeReport

__all__ = ["PythonReward", "RewardPluginError", "check_spec", "load_fn", "resolve_spec", "score"]

log = logging.getLogger(__name__)

WORKER_MODULE = "bapo_cli.rewards.plugin_worker"
ALLOWED = "module:function or path/to/file.py:function"
# A reward's accepted range: finite and |r| <= this. Rewards are added up over a batch and
# normalised into advantages: a few 1e308 overflow the step's mean to inf (the metric is then
# dropped by MLflow and nothing is learned); 1e6 leaves every sum and square far from overflow.
MAX_ABS_REWARD = 1e6
# How long the preflight import of reward.fn may take (a module that imports torch and loads a
# small model takes seconds; one that waits on a network or a lock forever is refused)
IMPORT_TIMEOUT_S = 60.0
# Address-space cap of each reward=python worker, as for the math-verify workers (MathGrader)
MEMORY_LIMIT_MB = 4096


class RewardPluginError(ValueError):
    """``reward.fn`` cannot be used; the message is one line (without the ``reward.fn=`` key)."""


def resolve_spec(spec: str) -> str:
    """``spec`` with a file path made absolute (the workers may not share our working dir)."""
    target, _, name = spec.rpartition(":")
    if target.endswith(".py"):
        return f"{Path(target).expanduser().resolve()}:{name}"
    return spec


def load_fn(spec: str) -> Callable[..., Any]:
    """The function ``spec`` names, imported in this process. Raises RewardPluginError."""
    target, colon, name = spec.rpartition(":")
    if not colon or not target or not name:
        raise RewardPluginError(f"must be {ALLOWED}")
    if target.endswith(".py"):
        path = Path(target).expanduser()
        if not path.is_file():
            raise RewardPluginError(f"{path}: no such file; must be {ALLOWED}")
        module_name = f"_bapo_reward_{abs(hash(str(path.resolve())))}"
        module_spec = importlib.util.spec_from_file_location(module_name, path)
        if module_spec is None or module_spec.loader is None:  # pragma: no cover - .py files load
            raise RewardPluginError(f"{path}: cannot be imported as a Python file")
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[module_name] = module
        try:
            module_spec.loader.exec_module(module)
        except (Exception, SystemExit) as err:  # sys.exit() at import must not end the caller
            del sys.modules[module_name]
            raise RewardPluginError(f"{path} fails on import ({_describe(err)})") from None
    else:
        if str(Path.cwd()) not in sys.path and "" not in sys.path:
            sys.path.insert(0, str(Path.cwd()))  # as `python -m` would see it
        try:
            module = importlib.import_module(target)
        except ModuleNotFoundError as err:
            if err.name and target.startswith(err.name):
                raise RewardPluginError(
                    f"no module named {target!r} on the path (working directory or PYTHONPATH); "
                    f"must be {ALLOWED}"
                ) from None
            raise RewardPluginError(
                f"module {target!r} fails on import ({_describe(err)})"
            ) from None
        except (Exception, SystemExit) as err:  # sys.exit() at import must not end the caller
            raise RewardPluginError(
                f"module {target!r} fails on import ({_describe(err)})"
            ) from None
    fn = getattr(module, name, None)
    if fn is None:
        raise RewardPluginError(f"{target} has no attribute {name!r}; must be {ALLOWED}")
    if not callable(fn):
        raise RewardPluginError(f"{target}.{name} is not callable ({type(fn).__name__})")
    return fn


def check_spec(spec: str, timeout_s: float | None = None) -> None:
    """Import the function in a child process (at most ``timeout_s``, default
    `IMPORT_TIMEOUT_S`) and check it can be called as fn(response, reference, record).
    Raises RewardPluginError: one line, whether the import raised, hung, exited or crashed."""
    import subprocess

    limit = IMPORT_TIMEOUT_S if timeout_s is None else float(timeout_s)
    command = [sys.executable, "-m", WORKER_MODULE, "--check", spec]
    proc = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        env=child_env(),
        text=True,
        errors="replace",
        start_new_session=True,  # killed as a group: a module may start processes of its own
    )
    try:
        out, err = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        raise RewardPluginError(
            f"importing it did not finish within {limit:g} s (a hang at import?); the "
            f"preflight import limit is {limit:g} s"
        ) from None
    for line in reversed(out.strip().splitlines()):
        try:
            reply = json.loads(line)
        except ValueError:
            continue
        if isinstance(reply, dict) and "check" in reply:
            if reply["check"] != "ok":
                raise RewardPluginError(str(reply["check"]))
            return
    last = [x for x in err.strip().splitlines() if x.strip()][-1:]  # relayed masked
    said = f": {redact.text(last[0].strip())[:200]}" if last else ""
    raise RewardPluginError(
        f"the process importing it ended with exit code {proc.returncode} before it could be "
        f"checked (os._exit or a crash at import){said}"
    )


def _kill_group(proc: Any) -> None:
    import os
    import signal

    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        proc.kill()
    proc.wait()


def check_in_process(spec: str) -> None:
    """`check_spec`'s work, in this process (the child it starts runs this)."""
    fn = load_fn(spec)
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # some builtins have none: let the first call tell
        return
    try:
        signature.bind("response", "reference", {})
    except TypeError as err:
        raise RewardPluginError(
            f"{spec.rpartition(':')[2]}{signature} cannot be called with 3 arguments ({err}); "
            "it must take (response, reference, record) and return a float or bool"
        ) from None


def score(value: Any) -> float:
    """A reward function's return value as a float; ValueError for anything that is not one."""
    if isinstance(value, bool):
        return 1.0 if value else 0.0
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        out = float(value)
        if math.isfinite(out) and abs(out) <= MAX_ABS_REWARD:
            return out
    # numpy scalars and 0-d tensors have .item()
    item = getattr(value, "item", None)
    if callable(item) and not isinstance(value, (str, bytes)):
        try:
            return score(item())
        except (TypeError, ValueError):
            pass
    shown = repr(value)
    shown = shown if len(shown) <= 40 else shown[:37] + "..."
    raise ValueError(
        f"returned {shown}; must return a finite float or a bool, within "
        f"[-{MAX_ABS_REWARD:g}, {MAX_ABS_REWARD:g}]"
    )


def json_safe(record: Mapping[str, Any]) -> dict[str, Any]:
    """A row as plain JSON data (dates and other objects as strings), as the workers get it."""
    return json.loads(json.dumps(dict(record), default=str))


def _import_failed(target: str, err: BaseException) -> RewardPluginError:
    return RewardPluginError(f"module {target!r} fails on import ({_describe(err)})")


def _describe(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0]}" if text else type(err).__name__


class PythonReward:
    """Scores batches with the user's function in ``workers`` time-limited processes.

    `grade_batch(responses, references, records, budget_s=...)` returns a `GradeReport` whose
    ``scores`` are the rewards (``verdicts``: score > 0) and whose ``timeouts``, ``errors`` and
    ``over_budget`` count the zeros that were not the function's own verdict. Thread-safe;
    ``close()`` stops the processes (a later batch starts new ones).
    """

    def __init__(
        self,
        spec: str,
        *,
        timeout_s: float = 5.0,
        workers: int = 1,
        startup_timeout_s: float = 120.0,
        memory_limit_mb: int | None = MEMORY_LIMIT_MB,
    ) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        if not (isinstance(workers, int) and workers >= 1):
            raise ValueError(f"workers must be an integer >= 1, got {workers!r}")
        self.spec = resolve_spec(spec)
        self.timeout_s = float(timeout_s)
        cap = () if memory_limit_mb is None else ("--memory-mb", str(int(memory_limit_mb)))
        self.pool = [
            TimeLimitedWorker(
                WORKER_MODULE, args=(*cap, self.spec), startup_timeout_s=startup_timeout_s
            )
            for _ in range(workers)
        ]
        self.stats = dict.fromkeys(("ok", "error", "timeout", "over_budget"), 0)
        self._logged_error = False
        self._lock = threading.Lock()

    def grade_batch(
        self,
        responses: Sequence[str],
        references: Sequence[str],
        records: Sequence[Mapping[str, Any]] | None = None,
        *,
        budget_s: float | None = None,
    ) -> GradeReport:
        """Score every (response, reference, record), all within ``budget_s`` (None: no bound)."""
        t0 = time.perf_counter()
        if records is None:
            records = [{} for _ in responses]
        if not len(responses) == len(references) == len(records):
            raise ValueError(
                f"{len(responses)} responses, {len(references)} references and {len(records)} "
                "records: pass one each"
            )
        deadline = None if budget_s is None else t0 + max(budget_s, 0.0)
        items = list(enumerate(zip(responses, references, records, strict=True)))
        results: list[tuple[str, float]] = [("ok", 0.0)] * len(items)

        def score(worker: TimeLimitedWorker, item: tuple[int, tuple[str, str, Any]]) -> None:
            i, args = item
            results[i] = self._call(worker, args, deadline)

        fan_out(self.pool, items, score)
        counts = {status: 0 for status in ("error", "timeout", "over_budget")}
        for status, _ in results:
            if status in counts:
                counts[status] += 1
        scores = [value for _, value in results]
        return GradeReport(
            [s > 0 for s in scores],
            timeouts=counts["timeout"],
            over_budget=counts["over_budget"],
            errors=counts["error"],
            scores=scores,
        )

    def _call(
        self, worker: TimeLimitedWorker, args: tuple[str, str, Any], deadline: float | None
    ) -> tuple[str, float]:
        limit, cut = self.timeout_s, False
        if deadline is not None:
            if time.perf_counter() >= deadline or not worker.start(
                wait_s=deadline - time.perf_counter()
            ):
                return self._count("over_budget")
            left = deadline - time.perf_counter()
            if left <= 0:
                return self._count("over_budget")
            limit, cut = min(self.timeout_s, left), left < self.timeout_s
        response, reference, record = args
        outcome = worker.call([response, reference, json_safe(record)], limit)
        if outcome.status == "timeout":
            if cut:
                return self._count("over_budget")
            log.warning(
                "reward.fn=%s ran past reward.timeout_s=%.1f s: scored 0 (reward/timeouts)",
                self.spec,
                self.timeout_s,
            )
            return self._count("timeout")
        if outcome.status == "crashed":
            return self._error("the worker process died (sys.exit, a crash or out of memory)")
        if outcome.status == "error":  # not raised by the function: the worker wraps those
            return self._error(str(outcome.value))
        reply = outcome.value if isinstance(outcome.value, dict) else {}
        if "error" in reply:
            return self._error(str(reply["error"]))
        try:  # checked here too: whatever came over the pipe is held to the same range
            return self._count("ok", score(reply.get("score")))
        except ValueError as err:
            return self._error(str(err))

    def _error(self, message: str) -> tuple[str, float]:
        with self._lock:
            first, self._logged_error = not self._logged_error, True
        if first:
            log.warning(
                "reward.fn=%s failed, scored 0 and counted in reward/errors (logged once): %s",
                self.spec,
                redact.text(message),
            )
        return self._count("error")

    def _count(self, status: str, value: float = 0.0) -> tuple[str, float]:
        with self._lock:
            self.stats[status] += 1
        return status, value

    def close(self) -> None:
        """Kill the worker processes (restarted lazily if used again)."""
        for worker in self.pool:
            worker.close()

    def __enter__(self) -> PythonReward:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

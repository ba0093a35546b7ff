"""`bapo eval --watch RUN_DIR`: evaluation during (async) training, beside it.

    bapo train staleness.regime=async rollout.servers=[A,B] ... trainer.save_every=10 &
    bapo eval --watch RUN_DIR eval.server=C benchmark=aime24 eval.n=16     # C: a server of its own

Every checkpoint the training run writes (`RUN_DIR/checkpoints/step_N`, complete) is loaded here
(a LoRA checkpoint merged into its base), pushed to the evaluation's own server through the
filesystem transport, checked there by the training run's probe (the server's log-probs of the
probe text against this process's of the same weights, `staleness.probe.verdict`: a push that
did not reach the model stops the watch in one line), then scored exactly as `bapo eval` scores
(`evaluate.score`: the same prompts, sampling, seeds and grading), written to
`RUN_DIR/eval/<benchmark>/step_N/` (results.json, samples.jsonl) and logged to the training run's
MLflow run (the id its checkpoint records) as `eval/<benchmark>/<metric>` at step N. It ends once
the training run has ended (its MLflow run FINISHED, FAILED or KILLED, or its checkpoint of
`trainer.max_steps` scored) and every checkpoint is scored; run again, it scores only what is not
scored yet.

Why a watcher on checkpoints rather than the trainer taking a server out of generation
(docs/evaluation.md): training never waits for it and its fleet keeps every server; the version
is exact (a checkpoint is the trainer's weights after step N, kept on disk, while a published
weights version is deleted once the servers hold the next); it scales by giving it servers of its
own, and it catches up after the run ends, or scores an old run's checkpoints.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf
from rich.console import Console

from bapo_cli.data.records import DataError
from bapo_cli.evaluation import evaluate, served
from bapo_cli.launch.launcher import Refused
from bapo_cli.launch.launcher import check as check_overrides
from bapo_cli.models import loading as models
from bapo_cli.models import lora
from bapo_cli.models.errors import ModelLoadError
from bapo_cli.rollout import weights_fs
from bapo_cli.rollout.claims import Owner
from bapo_cli.rollout.pools import pool_for
from bapo_cli.rollout.server_engine import ServerEngine
from bapo_cli.rollout.servers import ServerError, ServerPool
from bapo_cli.staleness import probe
from bapo_cli.tracking.attach import TERMINAL, AttachError, log_to_run, run_status
from bapo_cli.trainer import checkpoint

WATCH_DIR = "eval"  # RUN_DIR/eval/<benchmark>/step_N/
POLL_S = 5.0  # how often the run's checkpoints are listed while nothing is new


class WatchError(RuntimeError):
    """The watch cannot go on (its server, a push the probe refutes); one line."""


@dataclass(frozen=True)
class Scored:
    """One checkpoint scored: its step, the weights version it holds, the metrics (results.json's
    entry) and the probe's largest |server - here| after its push."""

    step: int
    version: int
    metrics: dict[str, Any]
    probe_abs_diff_max: float


def check(cfg: Any, run_dir: Path) -> None:
    """What `--watch` needs before it starts (WatchError, one line): a run dir, a server."""
    if not (run_dir / "checkpoints").is_dir() and not (run_dir / ".hydra").is_dir():
        raise WatchError(
            f"--watch {run_dir}: not a training run dir (no checkpoints/ nor .hydra/); give the "
            "run dir bapo train printed"
        )
    if cfg.eval.server is None:
        raise WatchError(
            "--watch scores each checkpoint on a generation server of its own: give "
            "eval.server=URL (bapo serve with the run's model overrides; not one of the run's "
            "rollout.servers)"
        )


class Watch:
    """The watch over one run dir (module docstring); `run()` until the run has ended."""

    def __init__(self, cfg: Any, run_dir: Path, console: Console | None = None) -> None:
        import transformers

        transformers.utils.logging.disable_progress_bar()  # a bar per checkpoint loaded
        self.cfg = cfg
        self.run_dir = Path(run_dir).resolve()
        self.console = console or Console()
        self.out = self.run_dir / WATCH_DIR / cfg.benchmark.name
        self.problems, _ = evaluate.load_problems(cfg.benchmark, cfg.eval.limit)
        if not self.problems:
            raise DataError(f"benchmark {cfg.benchmark.name}: no problems to score")
        self.tokenizer, ends = served.tokenizer_of(cfg.model)
        self.probe = probe.probe_ids(self.tokenizer, int(cfg.model.max_model_len))
        self.pool = self._pool()
        self.engine = ServerEngine(self.pool, ends, interrupt=False)
        self.max_steps = _max_steps(self.run_dir)
        self.run_id: str | None = None

    def _pool(self) -> ServerPool:
        """eval.server, checked (model, window, extension) and claimed for this watch alone: it
        loads weights, so it holds the server as a training run does (no run or evaluation may
        use it meanwhile)."""
        pool = pool_for(
            [self.cfg.eval.server],
            self.cfg.model,
            stall_s=self.cfg.rollout.server_stall_s,
            fingerprint=True,
            owner=Owner.of_run(self.run_dir / WATCH_DIR),
            weights_dir=self.out / ".weights",
        )
        try:
            pool.check()
        except ServerError:
            pool.close()
            raise
        return pool

    def close(self) -> None:
        self.pool.close()

    # ------------------------------------------------------------------------------ the loop

    def run(self, poll_s: float = POLL_S) -> list[Scored]:
        """Score every checkpoint not scored yet, as they appear, until the run has ended."""
        scored: list[Scored] = []
        self.console.print(
            f"watching {self.run_dir / 'checkpoints'}: each checkpoint scored on "
            f"{self.cfg.eval.server} ({self.cfg.benchmark.name}, {len(self.problems)} problems "
            f"× {self.cfg.eval.n} samples)",
            markup=False,
            emoji=False,
            soft_wrap=True,
        )
        while True:
            ended = self._ended(scored)  # asked first: a checkpoint written since is listed
            pending = [d for d in checkpoint.complete(self.run_dir / "checkpoints") if self._new(d)]
            for directory in pending:
                done = self.score(directory)
                if done is not None:
                    scored.append(done)
            if not pending and ended:
                return scored
            if not pending:
                time.sleep(poll_s)

    def _new(self, directory: Path) -> bool:
        return not (self.out / directory.name / "results.json").is_file()

    def _ended(self, scored: list[Scored]) -> bool:
        """The training run writes no more checkpoints: its MLflow run ended, or the watch
        scored (now or before) its checkpoint of trainer.max_steps."""
        if self.max_steps is not None:
            last = self.out / checkpoint.step_dir(Path(), self.max_steps).name / "results.json"
            if last.is_file() or any(s.step == self.max_steps for s in scored):
                return True
        if self.run_id is not None and "mlflow" in self.cfg.tracking.backends:
            return run_status(self.cfg.tracking.uri, self.run_id) in TERMINAL
        return False

    # ----------------------------------------------------------------------- one checkpoint

    def score(self, directory: Path) -> Scored | None:
        """Load, push, probe, score, write, log one checkpoint; None when it vanished first
        (trainer.keep_last pruned it)."""
        step = int(directory.name.removeprefix("step_"))
        try:
            saved = checkpoint.load_state(directory)
            model, _ = models.load_checkpoint(directory)
        except (checkpoint.CheckpointError, ModelLoadError, OSError) as exc:
            if directory.exists():
                raise WatchError(f"checkpoint {directory} cannot be loaded: {exc}") from None
            self.console.print(f"skipped {directory.name}: removed before it was read")
            return None
        self.run_id = saved.get("run_id") or self.run_id
        version = int(saved.get("state", {}).get("version", step))
        worst = self._push(model, directory, version)
        result = evaluate.score(self.cfg, self.problems, self.engine, self.tokenizer)
        evaluate.write_results(self.out / directory.name, self.cfg.benchmark.name, result)
        logged = self._log(result.metrics, step)
        shown = ", ".join(
            f"{k} {v:.3f}" for k, v in result.metrics.items() if "@" in k and isinstance(v, float)
        )
        self.console.print(
            f"step {step} (version {version}): {shown}{logged}",
            markup=False,
            emoji=False,
            soft_wrap=True,
        )
        return Scored(step, version, result.metrics, worst)

    def _push(self, model: torch.nn.Module, directory: Path, version: int) -> float:
        """The checkpoint's weights into the server as `version`, checked by the probe; the
        largest |server - here| of the probe's log-probs. The server records the checkpoint's
        fingerprint as the model it holds, so `bapo eval model.path=<that checkpoint>
        eval.server=URL` accepts it afterwards."""
        root = self.out / ".weights"
        self.pool.base = weights_fs.model_fingerprint(directory)
        try:
            written = weights_fs.write_version(lora.engine_weights(model), root, version)
        except OSError as exc:
            raise WatchError(f"cannot write weights under {root}: {exc}") from None
        self.pool.push(written, version, interrupt=False)  # NoServerLeft: the server is down
        want = probe.trainer_logprobs(model, self.probe)
        dtypes = [str(next(model.parameters()).dtype)]
        dtypes += [str(s.info.get("dtype")) for s in self.pool.servers if s.info]
        limit = probe.tolerance(None, dtypes)
        worst = 0.0
        for url, (held, logprobs) in self.pool.probe(self.probe).items():
            served_lp = torch.tensor(logprobs)
            wrong = probe.verdict(url, version, held, served_lp, want, None, limit)
            if wrong is not None:
                raise WatchError(wrong)
            worst = max(worst, (served_lp - want).abs().max().item())
        weights_fs.cleanup(root, keep_from=version)
        return worst

    def _log(self, metrics: dict[str, Any], step: int) -> str:
        """The scores to the training run's MLflow run at `step`; what the console line adds."""
        if self.run_id is None or "mlflow" not in self.cfg.tracking.backends:
            return ""
        keys = evaluate.metric_keys("eval", self.cfg.benchmark.name, metrics)
        try:
            log_to_run(self.cfg.tracking.uri, self.run_id, keys, step)
        except AttachError as exc:
            return f" (not logged: {exc}; kept in results.json)"
        return f" (logged to MLflow run {self.run_id})"


def _max_steps(run_dir: Path) -> int | None:
    """trainer.max_steps of the run, from Hydra's record of its config; None without one."""
    path = run_dir / ".hydra" / "config.yaml"
    try:
        return int(OmegaConf.load(path).trainer.max_steps)
    except Exception:  # noqa: BLE001  (no record, or another shape: the MLflow status decides)
        return None


class WatchFailed(RuntimeError):
    """The watch stopped after it started (a server down, a refuted push); one line, exit 1."""


def main(overrides: list[str], run_dir: Path, several: bool) -> list[Scored]:
    """`bapo eval --watch RUN_DIR OVERRIDES`: checked (launcher.Refused, exit 2, nothing
    written), then the watch until the run has ended (WatchFailed, exit 1)."""
    if several:
        raise Refused("--watch scores one benchmark: start one watch per benchmark")
    cfg = check_overrides("eval", overrides).config
    try:
        check(cfg, Path(run_dir))
        watch = Watch(cfg, Path(run_dir))
    except (WatchError, ServerError, ModelLoadError, DataError) as exc:
        raise Refused(str(exc)) from None
    try:
        return watch.run()
    except (WatchError, ServerError) as exc:
        raise WatchFailed(str(exc)) from None
    finally:
        watch.close()

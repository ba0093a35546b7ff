"""Several trackers as one (`tracking.backends=[mlflow,wandb]`): every call goes to each, in
order. Each tracker survives its own backend's outage (writer.BufferedTracker), so one backend
that is down neither stops the others nor the run."""

from __future__ import annotations

from pathlib import Path

from bapo_cli.tracking.writer import Tracker


class FanoutTracker:
    """The run id is the first tracker's that has one (MLflow's when it is on, which W&B then
    shares): the checkpoint keeps it, and a resume reopens every backend's run with it."""

    def __init__(self, trackers: list[Tracker]) -> None:
        self.trackers = trackers
        self.run_id = next((t.run_id for t in trackers if t.run_id is not None), None)

    def log_params(self, params: dict[str, str]) -> None:
        for tracker in self.trackers:
            tracker.log_params(params)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        for tracker in self.trackers:
            tracker.log_metrics(metrics, step)

    def log_text(self, text: str, artifact_file: str) -> None:
        for tracker in self.trackers:
            tracker.log_text(text, artifact_file)

    def log_artifact(self, path: Path, artifact_path: str | None = None) -> None:
        for tracker in self.trackers:
            tracker.log_artifact(path, artifact_path)

    def flush(self) -> None:
        for tracker in self.trackers:
            tracker.flush()

    def close(self, status: str = "FINISHED") -> None:
        """Close every tracker, also when one raises (Ctrl-C during a retry): each writes its
        own undelivered metrics; the first error is raised after all are closed."""
        error: BaseException | None = None
        for tracker in self.trackers:
            try:
                tracker.close(status)
            except BaseException as exc:
                error = error or exc
        if error is not None:
            raise error

"""What the training loop logs through: the ``Tracker`` protocol, a null tracker, a resume filter, the factory.

The buffered MLflow tracker is :class:`runner.tracking.mlflow_tracker.MlflowTracker`. mlflow is
imported inside functions, never when this module is imported.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from runner.tracking.mlflow_tracker import MlflowTracker


@runtime_checkable
class Tracker(Protocol):
    """Where one rank sends its metrics, tags and artifacts; only the logging rank (rank 0) records anything.

    The training loop calls :meth:`log_metrics` on its hot path, so an implementation must
    return without waiting on the network there (:class:`~runner.tracking.mlflow_tracker.MlflowTracker`
    buffers; :class:`NullTracker` drops). Only :meth:`flush` and :meth:`close` may block.
    Implementations: :class:`NullTracker`, :class:`~runner.tracking.mlflow_tracker.MlflowTracker`,
    :class:`SkipLoggedSteps`.
    """

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """Record metric values at one step; does not block on the network.

        Args:
            metrics: Metric name (``train/loss``, ``lr``, ``val/accuracy``, ...) -> value as a
                Python float (converting a CUDA tensor here would synchronise the device).
                Losses and accuracies are unitless, ``lr`` is the learning rate, times are seconds.
            step: The x axis of the metric history: the number of optimizer steps done so
                far (the global step; per-epoch metrics are logged at the global step reached at
                the end of the epoch). Steps of one metric increase; a resumed run continues them.

        Raises:
            TypeError: ``step`` is not an integer.
            ValueError: A name is not a valid MLflow metric name.
            TrackingError: The tracker was closed.
        """

    def log_artifact(self, path: str | os.PathLike[str], artifact_path: str | None = None) -> None:
        """Record a local file or folder as an artifact of the run; does not block on the network.

        The upload may happen later: the file must stay in place until the next :meth:`flush`
        or :meth:`close`.

        Args:
            path: Local file or folder.
            artifact_path: Folder inside the run's artifacts, e.g. ``"checkpoints"``. Default: the root.

        Raises:
            FileNotFoundError: ``path`` does not exist (trackers that record nothing accept it).
            TrackingError: The tracker was closed.
        """

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        """Set run tags; values are rendered like params (``true``, ``1.0``, JSON for lists); does not block.

        Args:
            tags: Tag key -> value; a later value for the same key replaces the earlier one.

        Raises:
            TrackingError: The tracker was closed.
        """

    def flush(self) -> None:
        """Block until everything recorded before this call has been sent (by a tracker with a spool:
        sent, or written to the spool while the store does not answer).

        Raises:
            TrackingError: Something recorded since the last flush could not be sent (the
                error is reported once, with how many items were lost).
        """

    def close(self) -> None:
        """Send everything still buffered, then release the tracker; blocks; calling it twice is harmless.

        Nothing can be recorded after it.

        Raises:
            TrackingError: As :meth:`flush`.
        """


class NullTracker:
    """A tracker that records nothing (ranks other than 0, ``tracking.enabled = false``).

    It starts no thread, opens no store and imports no mlflow; every method returns ``None``.
    """

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """Do nothing."""

    def log_artifact(self, path: str | os.PathLike[str], artifact_path: str | None = None) -> None:
        """Do nothing (``path`` is not even checked)."""

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        """Do nothing."""

    def flush(self) -> None:
        """Do nothing."""

    def close(self) -> None:
        """Do nothing."""

    def __enter__(self) -> NullTracker:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


class SkipLoggedSteps:
    """A tracker wrapper that drops metrics at steps the run already holds (after resume).

    Args:
        inner: The real tracker; everything but the dropped metrics is forwarded to it.
        last_steps: Metric name -> highest step already logged, from
            :func:`runner.tracking.runs.last_logged_steps`.
    """

    def __init__(self, inner: Tracker, last_steps: Mapping[str, int]):
        self.inner = inner
        self.last_steps = dict(last_steps)

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """Forward the metrics whose ``step`` is beyond what the run already holds."""
        fresh = {k: v for k, v in metrics.items() if step > self.last_steps.get(k, -1)}
        if fresh:
            self.inner.log_metrics(fresh, step=step)

    def log_artifact(self, path: str | os.PathLike[str], artifact_path: str | None = None) -> None:
        """Forward to the inner tracker."""
        self.inner.log_artifact(path, artifact_path)

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        """Forward to the inner tracker."""
        self.inner.set_tags(tags)

    def flush(self) -> None:
        """Forward to the inner tracker."""
        self.inner.flush()

    def close(self) -> None:
        """Forward to the inner tracker."""
        self.inner.close()

    def recorded(self) -> int:
        """The inner tracker's count of metric values recorded by the run (0 when it keeps none)."""
        count = getattr(self.inner, "recorded", None)
        return int(count()) if callable(count) else 0


def make_tracker(
    uri: str | None,
    run_id: str | None,
    *,
    is_logger: bool,
    flush_every_s: float,
    spool: Path | None = None,
    first_seq: int = 0,
) -> Tracker:
    """The tracker of one rank: an ``MlflowTracker`` on the logging rank of a tracked run, else a :class:`NullTracker`.

    Args:
        uri: Tracking URI, or ``None`` when tracking is off.
        run_id: The run, or ``None`` when tracking is off.
        is_logger: Whether this rank logs (rank 0 of the job).
        flush_every_s: Longest time, in seconds, a metric waits in the buffer.
        spool: The run's spool file, where values wait while the store does not answer.
        first_seq: Metric values the run recorded before this job (from the checkpoint it resumes).
    """
    if is_logger and run_id is not None and uri is not None:
        return MlflowTracker(uri, run_id, flush_every_s=flush_every_s, spool=spool, first_seq=first_seq)
    return NullTracker()


def skip_logged_steps(tracker: Tracker, uri: str | None, run_id: str | None) -> Tracker:
    """Wrap ``tracker`` so that a resumed run does not log a step its metric history already holds.

    Returns:
        ``tracker`` itself for a :class:`NullTracker` or an untracked run, else a :class:`SkipLoggedSteps`.

    Raises:
        mlflow.exceptions.MlflowException: The run's metric histories cannot be read.
    """
    from runner.tracking.runs import last_logged_steps

    if isinstance(tracker, NullTracker) or uri is None or run_id is None:
        return tracker
    return SkipLoggedSteps(tracker, last_logged_steps(uri, run_id))


if TYPE_CHECKING:  # mypy checks here that every tracker implements the protocol; nothing runs
    _null: Tracker = NullTracker()
    _buffered: Tracker = MlflowTracker("", "")
    _skipping: Tracker = SkipLoggedSteps(NullTracker(), {})

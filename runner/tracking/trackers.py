"""Trackers the training loop logs through: the interface, a null one, and a buffered MLflow one.

mlflow is imported inside functions, never when this module is imported.
"""

from __future__ import annotations

import json
import logging
import operator
import os
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from runner.errors import TrackingError

log = logging.getLogger(__name__)

PARAMS_PER_BATCH = 100  # MLflow's limit for params (and tags) in one log_batch request
METRICS_PER_BATCH = 1000  # MLflow's limit for metrics in one log_batch request


def param_value(value: Any) -> str:
    """Render one flattened spec value as an MLflow param string, stably.

    ``True`` -> ``"true"``, ``1`` -> ``"1"``, ``1.0`` -> ``"1.0"`` (floats use ``repr``),
    lists and tables -> JSON, strings unchanged.

    Args:
        value: A JSON-able scalar, list or dict.
    """
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, (list, tuple, dict)):
        return json.dumps(value, default=str)
    return str(value)


class Tracker(Protocol):
    """What the training loop logs through; only rank 0 gets an :class:`MlflowTracker`."""

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None: ...
    def log_artifact(self, path: str | os.PathLike[str], artifact_path: str | None = None) -> None: ...
    def set_tags(self, tags: Mapping[str, Any]) -> None: ...
    def flush(self) -> None: ...
    def close(self) -> None: ...


class NullTracker:
    """A tracker that records nothing (ranks other than 0, ``tracking.enabled = false``)."""

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """Do nothing."""

    def log_artifact(self, path: str | os.PathLike[str], artifact_path: str | None = None) -> None:
        """Do nothing."""

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


class MlflowTracker:
    """Logs metrics, tags and artifacts of one run from a background thread.

    ``log_metrics``, ``set_tags`` and ``log_artifact`` only append to a buffer (a lock
    held for a list append); a daemon thread sends metrics with ``MlflowClient.log_batch``
    (at most ``max_batch`` per request) every ``flush_every_s`` seconds, or sooner when
    ``max_batch`` metrics are waiting. The training thread waits on the network only in
    :meth:`flush` and :meth:`close`. A failed request is not retried beyond MLflow's own
    HTTP retries; its error is kept and raised as :class:`TrackingError` by the next
    ``flush``/``close``, so nothing is lost silently.

    Args:
        uri: Tracking URI.
        run_id: The run to log to (created by :func:`runner.tracking.runs.start_run`).
        flush_every_s: Longest time, in seconds, a metric waits in the buffer.
        max_batch: Metrics per request (capped at MLflow's limit of 1000).
    """

    def __init__(self, uri: str, run_id: str, flush_every_s: float = 5.0, max_batch: int = METRICS_PER_BATCH):
        from mlflow.tracking import MlflowClient

        if flush_every_s <= 0:
            raise ValueError(f"flush_every_s must be > 0 seconds, got {flush_every_s}")
        self.uri, self.run_id = uri, run_id
        self.flush_every_s = float(flush_every_s)
        self.max_batch = max(1, min(int(max_batch), METRICS_PER_BATCH))
        self._client = MlflowClient(tracking_uri=uri)
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)  # the sender waits on it
        self._done = threading.Condition(self._lock)  # flush() waits on it
        self._metrics: list[tuple[str, float, int, int]] = []  # (key, value, timestamp_ms, step)
        self._ops: list[tuple[str, Any, Any]] = []  # ("tags", dict, None) | ("artifact", path, artifact_path)
        self._queued = 0  # items ever buffered
        self._processed = 0  # items sent or given up on
        self._flush_wanted = False
        self._closing = False
        self._closed = False
        self._failures: list[tuple[str, BaseException]] = []
        self._lost = 0
        self._keys_ok: set[str] = set()
        self._thread = threading.Thread(target=self._run, name=f"runner-mlflow-{run_id[:8]}", daemon=True)
        self._thread.start()

    # ---- training-thread side

    def _check_key(self, key: str) -> None:
        from mlflow.exceptions import MlflowException
        from mlflow.utils.validation import _validate_metric_name

        try:
            _validate_metric_name(key)
        except MlflowException as exc:
            raise ValueError(f"invalid MLflow metric name {key!r}: {exc.message}") from None
        self._keys_ok.add(key)

    def _enqueue(self, metrics: list[tuple[str, float, int, int]] = (), op: tuple[str, Any, Any] | None = None) -> None:
        with self._lock:
            if self._closing:
                raise TrackingError(f"tracker of run {self.run_id} is closed; nothing more can be logged")
            if metrics:
                self._metrics.extend(metrics)
                self._queued += len(metrics)
                if len(self._metrics) >= self.max_batch:
                    self._wake.notify()
            if op is not None:
                self._ops.append(op)
                self._queued += 1

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """Buffer metric values for one step; returns without touching the network.

        Args:
            metrics: Name (e.g. ``train/loss``) -> value; convertible with ``float()``.
                Pass Python floats: converting a CUDA tensor here would synchronise the GPU.
            step: Integer step (optimizer steps, or epochs for per-epoch metrics).

        Raises:
            TypeError: ``step`` is not an integer.
            ValueError: A name is not a valid MLflow metric name.
            TrackingError: The tracker was closed.
        """
        step = operator.index(step)
        ts = int(time.time() * 1000)
        items = []
        for key, value in metrics.items():
            if key not in self._keys_ok:
                self._check_key(key)
            items.append((key, float(value), ts, step))
        self._enqueue(items)

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        """Buffer run tags (values rendered like params: ``true``, ``1.0``, JSON for lists).

        Raises:
            TrackingError: The tracker was closed.
        """
        if tags:
            self._enqueue(op=("tags", {str(k): param_value(v) for k, v in tags.items()}, None))

    def log_artifact(self, path: str | os.PathLike[str], artifact_path: str | None = None) -> None:
        """Buffer the upload of a file or folder; it must stay in place until the next flush/close.

        Args:
            path: Local file or folder.
            artifact_path: Folder inside the run's artifacts. Default: the root.

        Raises:
            FileNotFoundError: ``path`` does not exist.
            TrackingError: The tracker was closed.
        """
        p = Path(path).resolve()
        if not p.exists():
            raise FileNotFoundError(f"artifact {p} does not exist")
        self._enqueue(op=("artifact", str(p), artifact_path))

    def flush(self, timeout_s: float | None = None) -> None:
        """Block until everything buffered before this call has been sent.

        Args:
            timeout_s: Give up after this many seconds. Default: wait (MLflow's HTTP
                retries bound how long a dead server takes to fail).

        Raises:
            TrackingError: Sending failed (the errors since the last flush are reported
                once, with how many items were lost), the sender thread died, or the
                timeout passed.
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._lock:
            target = self._queued
            if self._processed < target:
                self._flush_wanted = True
                self._wake.notify()
            while self._processed < target:
                if not self._thread.is_alive():
                    break
                left = 0.5 if deadline is None else min(0.5, deadline - time.monotonic())
                if left <= 0:
                    raise TrackingError(
                        f"timed out after {timeout_s} s sending {target - self._processed} buffered items to run {self.run_id} at {self.uri}"
                    )
                self._done.wait(left)
            pending = target - self._processed
        self._raise_failures(pending)

    def close(self, timeout_s: float | None = None) -> None:
        """Send everything buffered, then stop the sender thread. Idempotent.

        Raises:
            TrackingError: As :meth:`flush`.
        """
        if self._closed:
            self._raise_failures(0)
            return
        try:
            self.flush(timeout_s)
        finally:
            with self._lock:
                self._closing = True
                self._wake.notify()
            self._thread.join(timeout=timeout_s)
            self._closed = True
        self._raise_failures(0)

    def __enter__(self) -> MlflowTracker:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
            return
        try:  # do not hide the exception already on its way out
            self.close()
        except TrackingError as err:
            log.warning("%s", err)

    def _raise_failures(self, pending: int) -> None:
        with self._lock:
            failures, self._failures = self._failures, []
            lost, self._lost = self._lost, 0
            dead = not self._thread.is_alive() and not self._closing
        if not failures and not pending and not dead:
            return
        what = f"{lost} items were not recorded" if lost else "items may be missing"
        if pending:
            what += f"; {pending} items are still unsent (the sender thread stopped)"
        first = failures[0] if failures else ("sender thread", None)
        detail = f"; first error ({first[0]}): {type(first[1]).__name__}: {first[1]}" if first[1] is not None else ""
        more = f" ({len(failures)} failed requests)" if len(failures) > 1 else ""
        raise TrackingError(
            f"MLflow logging to run {self.run_id} at {self.uri} failed{more}: {what}{detail}"
        ) from first[1]

    # ---- sender thread

    def _run(self) -> None:
        try:
            next_due = time.monotonic() + self.flush_every_s
            while True:
                with self._lock:
                    while True:
                        pending = bool(self._metrics or self._ops)
                        now = time.monotonic()
                        if self._closing or self._flush_wanted or len(self._metrics) >= self.max_batch:
                            break
                        if now >= next_due:
                            if pending:
                                break
                            next_due = now + self.flush_every_s
                        self._wake.wait(max(0.0, next_due - now))
                    metrics, self._metrics = self._metrics, []
                    ops, self._ops = self._ops, []
                    target = self._queued
                    self._flush_wanted = False
                    closing = self._closing
                self._send(metrics, ops)
                next_due = time.monotonic() + self.flush_every_s
                with self._lock:
                    self._processed = target
                    self._done.notify_all()
                    if closing and not self._metrics and not self._ops:
                        return
        except BaseException as exc:  # keep it for flush(); the thread ends
            with self._lock:
                self._failures.append(("sender thread", exc))
                self._done.notify_all()

    def _fail(self, what: str, exc: BaseException, count: int) -> None:
        log.debug("MLflow %s failed", what, exc_info=True)
        with self._lock:
            self._failures.append((what, exc))
            self._lost += count

    def _send(self, metrics: list[tuple[str, float, int, int]], ops: list[tuple[str, Any, Any]]) -> None:
        from mlflow.entities import Metric, RunTag

        for i in range(0, len(metrics), self.max_batch):
            chunk = [Metric(k, v, ts, step) for k, v, ts, step in metrics[i : i + self.max_batch]]
            try:
                self._client.log_batch(self.run_id, metrics=chunk, synchronous=True)
            except Exception as exc:
                self._fail(f"log_batch of {len(chunk)} metrics", exc, len(chunk))
        for kind, a, b in ops:
            try:
                if kind == "tags":
                    tags = [RunTag(k, v) for k, v in a.items()]
                    for j in range(0, len(tags), PARAMS_PER_BATCH):
                        self._client.log_batch(self.run_id, tags=tags[j : j + PARAMS_PER_BATCH], synchronous=True)
                elif Path(a).is_dir():
                    self._client.log_artifacts(self.run_id, a, b)
                else:
                    self._client.log_artifact(self.run_id, a, b)
            except Exception as exc:
                self._fail(f"{'set_tags' if kind == 'tags' else 'log_artifact ' + a}", exc, 1)


class SkipLoggedSteps:
    """A tracker wrapper that drops metrics at steps the run already holds (after resume).

    Args:
        inner: The real tracker.
        last_steps: From :func:`runner.tracking.runs.last_logged_steps`.
    """

    def __init__(self, inner: Any, last_steps: dict[str, int]):
        self.inner = inner
        self.last_steps = last_steps

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Forward the metrics whose ``step`` is beyond what the run already holds."""
        fresh = {k: v for k, v in metrics.items() if step > self.last_steps.get(k, -1)}
        if fresh:
            self.inner.log_metrics(fresh, step=step)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def make_tracker(uri: str | None, run_id: str | None, *, is_logger: bool, flush_every_s: float) -> Tracker:
    """The tracker of one rank: an :class:`MlflowTracker` on the logging rank of a tracked run, else a :class:`NullTracker`.

    Args:
        uri: Tracking URI, or ``None`` when tracking is off.
        run_id: The run, or ``None`` when tracking is off.
        is_logger: Whether this rank logs (rank 0 of the job).
        flush_every_s: Longest time, in seconds, a metric waits in the buffer.
    """
    if is_logger and run_id is not None and uri is not None:
        return MlflowTracker(uri, run_id, flush_every_s=flush_every_s)
    return NullTracker()


def skip_logged_steps(tracker: Tracker, uri: str | None, run_id: str | None) -> Tracker:
    """Wrap ``tracker`` so that a resumed run does not log a step its metric history already holds.

    Args:
        tracker: The rank's tracker.
        uri: Tracking URI of the run.
        run_id: The resumed run.

    Returns:
        ``tracker`` itself for a :class:`NullTracker` or an untracked run, else a :class:`SkipLoggedSteps`.
    """
    from runner.tracking.runs import last_logged_steps

    if isinstance(tracker, NullTracker) or uri is None or run_id is None:
        return tracker
    return SkipLoggedSteps(tracker, last_logged_steps(uri, run_id))

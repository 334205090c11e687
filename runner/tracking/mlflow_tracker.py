"""The MLflow tracker: metrics, tags and artifacts of one run, sent from a background thread.

mlflow is imported inside functions, never when this module is imported.
"""

from __future__ import annotations

import logging
import operator
import os
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from runner.errors import TrackingError
from runner.tracking.values import METRICS_PER_BATCH, PARAMS_PER_BATCH, param_value

if TYPE_CHECKING:
    from types import TracebackType

log = logging.getLogger(__name__)

_Metric = tuple[str, float, int, int]  # (key, value, timestamp in ms, step)


class _Tags(NamedTuple):
    """Buffered ``set_tags`` call: tag key -> rendered value."""

    tags: dict[str, str]


class _Artifact(NamedTuple):
    """Buffered ``log_artifact`` call: an absolute local path and the folder inside the run's artifacts."""

    path: str
    artifact_path: str | None


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
        self._metrics: list[_Metric] = []
        self._ops: list[_Tags | _Artifact] = []
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
        """Raise ValueError for a name MLflow would reject (checked once per name)."""
        from mlflow.exceptions import MlflowException
        from mlflow.utils.validation import _validate_metric_name

        try:
            _validate_metric_name(key)
        except MlflowException as exc:
            raise ValueError(f"invalid MLflow metric name {key!r}: {exc.message}") from None
        self._keys_ok.add(key)

    def _enqueue(self, metrics: Sequence[_Metric] = (), op: _Tags | _Artifact | None = None) -> None:
        """Append to the buffer under the lock; wake the sender when a batch is full."""
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
        items: list[_Metric] = []
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
            self._enqueue(op=_Tags({str(k): param_value(v) for k, v in tags.items()}))

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
        self._enqueue(op=_Artifact(str(p), artifact_path))

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
                        f"timed out after {timeout_s} s sending {target - self._processed} buffered items "
                        f"to run {self.run_id} at {self.uri}"
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

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is None:
            self.close()
            return
        try:  # do not hide the exception already on its way out
            self.close()
        except TrackingError as err:
            log.warning("%s", err)

    def _raise_failures(self, pending: int) -> None:
        """Raise the failures kept since the last call (once), or when items are left unsent."""
        with self._lock:
            failures, self._failures = self._failures, []
            lost, self._lost = self._lost, 0
            dead = not self._thread.is_alive() and not self._closing
        if not failures and not pending and not dead:
            return
        what = f"{lost} items were not recorded" if lost else "items may be missing"
        if pending:
            what += f"; {pending} items are still unsent (the sender thread stopped)"
        cause = failures[0][1] if failures else None
        detail = f"; first error ({failures[0][0]}): {type(cause).__name__}: {cause}" if cause is not None else ""
        more = f" ({len(failures)} failed requests)" if len(failures) > 1 else ""
        raise TrackingError(
            f"MLflow logging to run {self.run_id} at {self.uri} failed{more}: {what}{detail}"
        ) from cause

    # ---- sender thread

    def _wait_for_work(self, next_due: float) -> None:
        """Wait, with the lock held, until a batch is full, a flush is wanted, the tracker closes,
        or ``next_due`` (monotonic seconds) passed with something buffered."""
        while True:
            now = time.monotonic()
            if self._closing or self._flush_wanted or len(self._metrics) >= self.max_batch:
                return
            if now >= next_due:
                if self._metrics or self._ops:
                    return
                next_due = now + self.flush_every_s
            self._wake.wait(max(0.0, next_due - now))

    def _run(self) -> None:
        """Body of the sender thread: drain the buffer whenever there is work, until closed."""
        try:
            next_due = time.monotonic() + self.flush_every_s
            while True:
                with self._lock:
                    self._wait_for_work(next_due)
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
        """Keep a failed request's error for the next flush/close; ``count`` items were lost."""
        log.debug("MLflow %s failed", what, exc_info=True)
        with self._lock:
            self._failures.append((what, exc))
            self._lost += count

    def _send(self, metrics: list[_Metric], ops: list[_Tags | _Artifact]) -> None:
        """Send one drained buffer (sender thread); failures are kept for the next flush/close."""
        from mlflow.entities import Metric, RunTag

        for i in range(0, len(metrics), self.max_batch):
            chunk = [Metric(k, v, ts, step) for k, v, ts, step in metrics[i : i + self.max_batch]]
            try:
                self._client.log_batch(self.run_id, metrics=chunk, synchronous=True)
            except Exception as exc:
                self._fail(f"log_batch of {len(chunk)} metrics", exc, len(chunk))
        for op in ops:
            try:
                if isinstance(op, _Tags):
                    tags = [RunTag(k, v) for k, v in op.tags.items()]
                    for j in range(0, len(tags), PARAMS_PER_BATCH):
                        self._client.log_batch(self.run_id, tags=tags[j : j + PARAMS_PER_BATCH], synchronous=True)
                elif Path(op.path).is_dir():
                    self._client.log_artifacts(self.run_id, op.path, op.artifact_path)
                else:
                    self._client.log_artifact(self.run_id, op.path, op.artifact_path)
            except Exception as exc:
                self._fail("set_tags" if isinstance(op, _Tags) else f"log_artifact {op.path}", exc, 1)

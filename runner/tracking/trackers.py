"""What a run logs through: the ``Tracker`` protocol, the MLflow tracker, a null tracker, a resume filter, system
metrics.

The sender thread lives in :mod:`runner.tracking.spool`; outage rules in docs/design.md §8 and §12.
"""

from __future__ import annotations

import logging
import operator
import os
import threading
import time
from collections import deque
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from runner.errors import TrackingError, mask_secrets
from runner.tracking import spool as spool_file
from runner.tracking.spool import Artifact, BatchSender, Item, Tags
from runner.tracking.tags import METRICS_PER_BATCH, param_value
from runner.tracking.uri import client_for

if TYPE_CHECKING:
    from types import TracebackType

    from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor


log = logging.getLogger(__name__)

MEMORY_ITEMS = 100_000  # metric values kept in memory while the store is away, before they go to the spool
SPILL_AFTER_S = 5.0  # a flush waits this long for a store that stopped answering, then spools
CLOSE_WAIT_S = 10.0  # close() waits this long for an absent store before it leaves the rest in the spool


class MlflowTracker(BatchSender):
    """Logs metrics, tags and artifacts of one run from a background thread (docs/design.md §12).

    ``log_metrics``, ``set_tags`` and ``log_artifact`` append to a buffer; a daemon thread sends values in order with
    ``MlflowClient.log_batch`` (``max_batch`` per request) every ``flush_every_s`` seconds or when ``max_batch`` wait.
    Only :meth:`flush` and :meth:`close` wait on the network. Without a ``spool`` a failed request's error is raised as
    :class:`TrackingError` by the next flush/close. With one, a store that does not answer is retried (pause up to 30
    s); unsent values stay in memory up to ``max_memory``, then go to the spool, and a flush waits at most
    ``spill_after_s``, so a checkpoint never stalls training. ``first_seq`` numbers values across resumes.
    """

    def __init__(
        self,
        uri: str,
        run_id: str,
        flush_every_s: float = 5.0,
        max_batch: int = METRICS_PER_BATCH,
        *,
        spool: Path | None = None,
        first_seq: int = 0,
        max_memory: int = MEMORY_ITEMS,
        spill_after_s: float = SPILL_AFTER_S,
    ):
        if flush_every_s <= 0:
            raise ValueError(f"flush_every_s must be > 0 seconds, got {flush_every_s}")
        self.uri, self.run_id, self.spool = uri, run_id, spool
        self.flush_every_s, self.spill_after_s = float(flush_every_s), float(spill_after_s)
        self.max_batch = max(1, min(int(max_batch), METRICS_PER_BATCH))
        self.max_memory = max(self.max_batch, int(max_memory))
        self._client = client_for(uri)
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)  # the sender waits on it
        self._done = threading.Condition(self._lock)  # flush() waits on it
        self._queue: deque[Item] = deque()  # values not yet taken by the sender, oldest first
        self._batch: list[Item] = []  # the oldest unsent values, being sent (retried until sent)
        self._batch_end_offset: int | None = None  # spool offset past the batch, when read from the spool
        self._ops: list[Tags | Artifact] = []
        self._recorded = self._sent = self._on_disk = first_seq  # next value; all before sent; all before safe
        self._read_at = 0  # spool offset from which values not known to be sent are read back
        self._spilled = False  # this tracker wrote values to the spool that may not be sent yet
        self._ops_queued = self._ops_done = 0
        self._down_until: float | None = None  # the store does not answer: next attempt, monotonic seconds
        self._unanswered = False  # a flush gave up waiting on it: later flushes spill at once
        self._backoff = 0.0
        self._flush_wanted = self._closing = self._closed = False
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

    def log_metrics(self, metrics: Mapping[str, float], step: int, timestamp_ms: int | None = None) -> None:
        """Buffer metric values for one step (:meth:`Tracker.log_metrics`); returns without touching the network."""
        step = operator.index(step)
        ts = int(time.time() * 1000) if timestamp_ms is None else timestamp_ms
        values = []
        for key, value in metrics.items():
            if key not in self._keys_ok:
                self._check_key(key)
            values.append((key, float(value)))
        with self._lock:
            self._check_open()
            for key, value in values:
                self._queue.append(Item(self._recorded, key, value, ts, step))
                self._recorded += 1
            if len(self._queue) >= self.max_batch:
                self._wake.notify()
            if self.spool is not None and len(self._queue) >= self.max_memory:
                self._spill()

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        """Buffer run tags (:meth:`Tracker.set_tags`)."""
        if tags:
            self._add_op(Tags({str(k): param_value(v) for k, v in tags.items()}))

    def log_artifact(self, path: str | os.PathLike[str], artifact_path: str | None = None) -> None:
        """Buffer the upload of a file or folder (:meth:`Tracker.log_artifact`)."""
        p = Path(path).resolve()
        if not p.exists():
            raise FileNotFoundError(f"artifact {p} does not exist")
        self._add_op(Artifact(str(p), artifact_path))

    def recorded(self) -> int:
        """Metric values recorded by the run so far (numbered across resumes); a checkpoint stores it."""
        with self._lock:
            return self._recorded

    def unsent(self) -> int:
        """Metric values not known to have reached the store (with a spool, they are in it after ``close``)."""
        with self._lock:
            return self._recorded - self._sent

    def flush(self, timeout_s: float | None = None) -> None:
        """Block until everything buffered before this call is sent (with a spool: sent, or spooled).

        Raises:
            TrackingError: Sending failed (reported once, with how many items were lost), the sender died, or
                ``timeout_s`` passed.
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._lock:
            target, ops_target = self._recorded, self._ops_queued
            # a store that did not answer the last flush (hung, not refusing) is not waited for again until it answers
            away = self._down_until is not None or self._unanswered
            spill_at = time.monotonic() + (0.0 if away else self.spill_after_s)
            if self._sent < target or self._ops_done < ops_target:
                self._flush_wanted = True
                self._wake.notify()
            while (self._sent < target or self._ops_done < ops_target) and self._thread.is_alive():
                now = time.monotonic()
                if self.spool is not None and (self._down_until is not None or now >= spill_at):
                    break
                left = 0.5 if deadline is None else min(0.5, deadline - now)
                if self.spool is not None:
                    left = min(left, max(0.01, spill_at - now))
                if left <= 0:
                    raise TrackingError(
                        f"timed out after {timeout_s} s sending {target - self._sent} buffered values "
                        f"to run {self.run_id} at {self.uri}"
                    )
                self._done.wait(left)
            if self.spool is not None and self._sent < target:
                self._unanswered = True  # cleared by the sender once a batch gets through
                self._spill()
            pending = 0 if self.spool is not None else (target - self._sent) + (ops_target - self._ops_done)
        self._raise_failures(pending)

    def close(self, timeout_s: float | None = None) -> None:
        """Send everything buffered, then stop the sender thread (:meth:`Tracker.close`). With a spool, waits at most
        :data:`CLOSE_WAIT_S` for a store that does not answer; the rest stays in the spool (tags too) for a resume."""
        if self._closed:
            self._raise_failures(0)
            return
        try:
            if self.spool is None:
                self.flush(timeout_s)
            else:
                self._drain_or_spool(CLOSE_WAIT_S if timeout_s is None else timeout_s)
        finally:
            with self._lock:
                self._closing = True
                self._wake.notify()
            self._thread.join(timeout=timeout_s if self.spool is None else 1.0)
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
            log.warning("%s", mask_secrets(str(err)))  # a sink: the log

    def _check_open(self) -> None:
        if self._closing:
            raise TrackingError(f"tracker of run {self.run_id} is closed; nothing more can be logged")

    def _add_op(self, op: Tags | Artifact) -> None:
        with self._lock:
            self._check_open()
            self._ops.append(op)
            self._ops_queued += 1

    def _drain_or_spool(self, wait_s: float) -> None:
        """Wait up to ``wait_s`` for everything to be sent; then spool the values and tags that were not."""
        deadline = time.monotonic() + wait_s
        with self._lock:
            self._flush_wanted = True
            self._wake.notify()
            while (self._sent < self._recorded or self._ops_done < self._ops_queued) and self._thread.is_alive():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._done.wait(min(0.5, left))
            if self._sent < self._recorded:
                self._spill()
            tags = {k: v for op in self._ops if isinstance(op, Tags) for k, v in op.tags.items()}
            artifacts = [op for op in self._ops if isinstance(op, Artifact)]
            if tags:
                self._write_spool(tags=tags)
            for op in artifacts:
                self._failures.append((f"log_artifact {op.path}", TrackingError("the tracking store did not answer")))
                self._lost += 1
            self._ops.clear()

    def _spill(self) -> None:
        """Write every value that is neither sent nor in the spool to it (lock held); they leave memory."""
        items = [i for i in self._batch if i.seq >= self._on_disk] + list(self._queue)
        if items and self._write_spool(items=items):
            self._on_disk = self._recorded
            self._queue.clear()
            self._spilled = True

    def _write_spool(self, items: list[Item] | None = None, tags: dict[str, str] | None = None) -> bool:
        assert self.spool is not None
        try:
            spool_file.append(self.spool, items or (), tags)
            return True
        except OSError as exc:  # the values stay in memory; the failure is reported
            self._failures.append((f"writing the spool {self.spool}", exc))
            return False

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


def start_system_metrics(uri: str | None, run_id: str, resumed: bool) -> SystemMetricsMonitor:
    """Start MLflow's system metrics monitor (``mlflow.system_metrics``); the caller calls ``finish()``."""
    from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

    monitor = SystemMetricsMonitor(run_id, tracking_uri=uri, resume_logging=resumed)
    monitor.start()
    return monitor


@runtime_checkable
class Tracker(Protocol):
    """Where one rank sends its metrics, tags and artifacts; only rank 0 records anything.

    :meth:`log_metrics` is on the hot path and must not wait on the network; only :meth:`flush` and :meth:`close` may
    block.
    """

    def log_metrics(self, metrics: Mapping[str, float], step: int, timestamp_ms: int | None = None) -> None:
        """Record metric values (Python floats) at ``step``, the global optimizer step, taken at ``timestamp_ms`` (ms
        since the epoch; default now); does not block.

        Raises:
            TypeError: ``step`` is not an integer.
            ValueError: A name is not a valid MLflow metric name.
            TrackingError: The tracker was closed.
        """

    def log_artifact(self, path: str | os.PathLike[str], artifact_path: str | None = None) -> None:
        """Record a local file or folder as an artifact; it must stay in place until the next flush or close.

        Raises:
            FileNotFoundError: ``path`` does not exist (trackers that record nothing accept it).
            TrackingError: The tracker was closed.
        """

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        """Set run tags, rendered like params; a later value for a key replaces the earlier. Raises TrackingError
        when closed."""

    def flush(self) -> None:
        """Block until everything recorded before is sent (or spooled); raises TrackingError for what could not be
        sent."""

    def close(self) -> None:
        """Send what is buffered and release the tracker; blocks; harmless twice. Raises as :meth:`flush`."""


class NullTracker:
    """Records nothing (ranks other than 0, ``tracking.enabled = false``); starts no thread, imports no mlflow."""

    def log_metrics(self, metrics: Mapping[str, float], step: int, timestamp_ms: int | None = None) -> None:
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


if TYPE_CHECKING:  # mypy checks here that every tracker implements the protocol; nothing runs
    _null: Tracker = NullTracker()
    _buffered: Tracker = MlflowTracker("", "")

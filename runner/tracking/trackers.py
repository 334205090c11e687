"""What a run logs through: the ``Tracker`` protocol, the MLflow tracker, a null tracker, system metrics. Outage rules:
docs/design.md §8 and §12.

Training must never wait on the tracking store: values are buffered and sent by a background thread, kept in a
spool when the store is away, and only ``flush`` and ``close`` wait.
"""

from __future__ import annotations

import atexit
import logging
import operator
import os
import threading
import time
from collections import deque
from collections.abc import Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from runner.errors import STORE_LEFT_HANGING, TrackingError, mask_secrets
from runner.tracking import spool as spool_file
from runner.tracking.runs import TrackedRun
from runner.tracking.spool import Item
from runner.tracking.tags import param_value

if TYPE_CHECKING:
    from types import TracebackType

    from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor


log = logging.getLogger(__name__)

MEMORY_ITEMS = 100_000  # metric values kept in memory while the store is away, before they go to the spool
SPILL_AFTER_S = 5.0  # a flush waits this long for a store that stopped answering, then spools
CLOSE_WAIT_S = 10.0  # close() waits this long for an absent store before it leaves the rest in the spool
_MAX_BACKOFF_S = 30.0
PARAMS_PER_BATCH = 100  # MLflow's most params (or tags) in one log_batch request
ENTITIES_PER_BATCH = 1000  # MLflow's most metrics, params and tags in one request: log_batch splits a larger call
MAX_BATCH = ENTITIES_PER_BATCH - PARAMS_PER_BATCH  # with its tags, a batch is one MLflow request: one future


class MlflowTracker:
    """Logs one run's metrics, tags and artifacts in batches (``max_batch`` values, at most :data:`MAX_BATCH`, or every
    ``flush_every_s``) through MLflow's asynchronous logging, one batch in its hands at a time, so values arrive in
    order; only :meth:`flush` and :meth:`close` wait on the network and upload artifacts. Without a ``spool`` a failed
    batch is raised by the next of them; with one, nothing is lost or stalls (docs/design.md §12); ``first_seq``
    numbers values across resumes."""

    def __init__(
        self,
        run: TrackedRun,
        flush_every_s: float = 5.0,
        max_batch: int = MAX_BATCH,
        *,
        spool: Path | None = None,
        first_seq: int = 0,
        max_memory: int = MEMORY_ITEMS,
        spill_after_s: float = SPILL_AFTER_S,
    ):
        if flush_every_s <= 0:
            raise ValueError(f"flush_every_s must be > 0 seconds, got {flush_every_s}")
        self.run = run
        self.spool = spool
        self.flush_every_s, self.spill_after_s = float(flush_every_s), float(spill_after_s)
        self.max_batch = max(1, min(int(max_batch), MAX_BATCH))
        self.max_memory = max(self.max_batch, int(max_memory))
        self._client = run.client
        # a failed batch is reported by flush/close (masked) or spooled, not logged by MLflow's thread on each try
        logging.getLogger("mlflow.utils.async_logging.async_logging_queue").setLevel(logging.CRITICAL)
        self._lock = threading.RLock()  # MLflow may complete a batch inside the call that hands it over
        self._done = threading.Condition(self._lock)  # a batch completed
        self._queue: deque[Item] = deque()  # values not handed over yet, oldest first
        self._batch: list[Item] = []  # the oldest unsent values: in MLflow's hands, or to hand over again
        self._batch_tags: dict[str, str] = {}  # the tags that go with them
        self._batch_end_offset: int | None = None  # spool offset past the batch, when read from the spool
        self._tags: dict[str, str] = {}
        self._artifacts: list[tuple[str, str | None]] = []  # (absolute local path, folder in the run's artifacts)
        self._inflight: Future[None] | None = None
        self._timer: threading.Timer | None = None
        self._timer_at = 0.0
        self._next_due = time.monotonic() + self.flush_every_s
        self._recorded = self._sent = self._on_disk = first_seq  # next value; all before sent; all before safe
        self._read_at = 0  # spool offset from which values not known to be sent are read back
        self._spilled = False  # this tracker wrote values to the spool that may not be sent yet
        self._down_until: float | None = None  # the store does not answer: next attempt, monotonic seconds
        self._unanswered = False  # a flush gave up waiting on it: later flushes spill at once
        self._backoff = 0.0
        self._closed = False
        self._failures: list[tuple[str, BaseException]] = []
        self._lost = 0
        self._keys_ok: set[str] = set()

    # ---- the caller's side

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
            if self.spool is not None and len(self._queue) >= self.max_memory:
                self._spill()
            self._pump()

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        """Buffer run tags (:meth:`Tracker.set_tags`); they leave with the next batch."""
        with self._lock:
            self._check_open()
            self._tags.update({str(k): param_value(v) for k, v in tags.items()})
            self._pump()

    def log_artifact(self, path: str | os.PathLike[str], artifact_path: str | None = None) -> None:
        """Note a file or folder for the next flush or close to upload (:meth:`Tracker.log_artifact`)."""
        p = Path(path).resolve()
        if not p.exists():
            raise FileNotFoundError(f"artifact {p} does not exist")
        with self._lock:
            self._check_open()
            self._artifacts.append((str(p), artifact_path))

    def send(self, message: Any) -> None:
        """Drop a driver's message (:meth:`Tracker.send`): this tracker records straight into the run, no driver
        stands behind it."""

    def recorded(self) -> int:
        """Metric values recorded by the run so far (numbered across resumes); a checkpoint stores it."""
        with self._lock:
            return self._recorded

    def flush(self, timeout_s: float | None = None) -> None:
        """Block until everything buffered before this call is sent (with a spool: sent, or spooled), then upload the
        artifacts (with a spool, only while the store answers). TrackingError: sending failed (reported once, with
        how many items were lost), or ``timeout_s`` passed."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._lock:
            target = self._recorded
            # a store that did not answer the last flush (hung, not refusing) is not waited for again until it answers
            away = self._down_until is not None or self._unanswered
            spill_at = time.monotonic() + (0.0 if away else self.spill_after_s)
            while self._pumped_short_of(target):
                now = time.monotonic()
                if self.spool is not None and (self._down_until is not None or now >= spill_at):
                    break
                left = 0.5 if deadline is None else min(0.5, deadline - now)
                if self.spool is not None:
                    left = min(left, max(0.01, spill_at - now))
                if left <= 0:
                    raise TrackingError(
                        f"timed out after {timeout_s} s sending {target - self._sent} buffered values "
                        f"to run {self.run.run_id} at {self.run.uri}"
                    )
                self._done.wait(left)
            if self.spool is not None and self._sent < target:
                self._unanswered = True  # cleared once a batch gets through
                self._spill()
            answering = self._down_until is None and not self._unanswered
            artifacts, self._artifacts = (self._artifacts, []) if answering else ([], self._artifacts)
        self._upload(artifacts)
        self._raise_failures()

    def close(self, timeout_s: float | None = None) -> None:
        """Send everything buffered and stop (:meth:`Tracker.close`). With a spool, waits at most :data:`CLOSE_WAIT_S`
        for a store that does not answer; the values and tags left go to the spool for a resume."""
        if self._closed:
            self._raise_failures()
            return
        try:
            if self.spool is None:
                self.flush(timeout_s)
            else:
                self._drain_or_spool(CLOSE_WAIT_S if timeout_s is None else timeout_s)
        finally:
            with self._lock:
                self._closed = True
                if self._timer is not None:
                    self._timer.cancel()
                if self._inflight is not None and self.spool is not None:  # its values are in the spool
                    STORE_LEFT_HANGING.append(self.run.uri)
                elif self._inflight is None:
                    _skip_exit_drain(self._client)
        self._raise_failures()

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
        if self._closed:
            raise TrackingError(f"tracker of run {self.run.run_id} is closed; nothing more can be logged")

    def _pumped_short_of(self, target: int) -> bool:
        """Hand over what is left at once (lock held); whether values before ``target``, or tags, are unsent."""
        self._pump(urgent=True)
        return self._sent < target or bool(self._tags or self._batch_tags)

    def _drain_or_spool(self, wait_s: float) -> None:
        """Wait up to ``wait_s`` for everything to be sent; then spool the values and tags that were not."""
        deadline = time.monotonic() + wait_s
        with self._lock:
            while (short := self._pumped_short_of(self._recorded)) and time.monotonic() < deadline:
                self._done.wait(min(0.5, max(0.01, deadline - time.monotonic())))
            answering = self._sent >= self._recorded
            if not answering:
                self._spill()
            tags = {**self._batch_tags, **self._tags}
            if short and tags:  # tags are idempotent: a batch still in MLflow's hands may send them too
                self._write_spool(tags=tags)
            self._tags.clear()
            artifacts = self._artifacts
            self._artifacts = []
        if answering:
            self._upload(artifacts)
            return
        for path, _ in artifacts:
            self._failures.append((f"log_artifact {path}", TrackingError("the tracking store did not answer")))
            self._lost += 1

    # ---- handing batches to MLflow (lock held), and MLflow's threads calling back

    def _pump(self, urgent: bool = False) -> None:
        """Hand the next batch to MLflow when it is due and none is in flight; else wake up when it will be."""
        if self._inflight is not None or self._closed:
            return
        now = time.monotonic()
        if self._down_until is not None and now < self._down_until:
            self._arm(self._down_until - now)
            return
        if not (self._batch or self._queue or self._on_disk > self._sent or self._tags):
            return
        due = urgent or self._down_until is not None or bool(self._batch) or len(self._queue) >= self.max_batch
        if not due and now < self._next_due:
            self._arm(self._next_due - now)
            return
        self._next_due = now + self.flush_every_s
        self._hand_over()

    def _hand_over(self) -> None:
        from mlflow.entities import Metric, RunTag

        batch = self._take_batch()
        if not self._batch_tags:
            self._batch_tags = {k: self._tags.pop(k) for k in list(self._tags)[:PARAMS_PER_BATCH]}
        try:
            operations = self._client.log_batch(
                self.run.run_id,
                metrics=[Metric(i.key, i.value, i.timestamp, i.step) for i in batch],
                tags=[RunTag(k, v) for k, v in self._batch_tags.items()],
                synchronous=False,
            )
            if operations is None:
                raise TrackingError("MLflow's asynchronous log_batch returned nothing to wait on")
            (future,) = operations._operation_futures  # RunOperations offers only a wait() without a timeout
        except Exception as exc:
            self._settle(exc)
            return
        self._inflight = future
        future.add_done_callback(self._completed)

    def _completed(self, future: Future[None]) -> None:
        """On MLflow's thread: the batch in flight completed; hand over the next one if it is due."""
        with self._lock:
            if future is self._inflight:
                self._inflight = None
                self._settle(future.exception())
                self._pump()

    def _settle(self, error: BaseException | None) -> None:
        """Account for the batch that left: sent, given up on (lost, reported), or to hand over again after a pause."""
        if error is not None and self.spool is not None and spool_file.transient(error):
            log.debug("the tracking store did not take %d values; retrying", len(self._batch), exc_info=error)
            self._backoff = min(_MAX_BACKOFF_S, max(1.0, 2 * self._backoff))
            self._down_until = time.monotonic() + self._backoff
            self._arm(self._backoff)
        else:
            if error is not None:
                log.debug("MLflow log_batch failed", exc_info=error)
                self._failures.append((f"log_batch of {len(self._batch)} metrics", error))
                self._lost += len(self._batch) + len(self._batch_tags)
            else:
                self._down_until = None
                self._backoff = 0.0
                self._unanswered = False
            if self._batch:
                self._sent = max(self._sent, self._batch[-1].seq + 1)
            self._batch = []
            self._batch_tags = {}
            if self._batch_end_offset is not None:
                self._read_at = self._batch_end_offset
            if self.spool is not None and self._sent >= self._on_disk and self._spilled and not self._closed:
                self.spool.unlink(missing_ok=True)  # everything in it was sent
                self._read_at = 0
                self._spilled = False
        self._done.notify_all()

    def _arm(self, delay: float) -> None:
        """Call :meth:`_pump` again in ``delay`` seconds, unless a wake-up is set for that time or earlier."""
        at = time.monotonic() + max(0.0, delay)
        if self._timer is not None and self._timer.is_alive():
            if self._timer_at <= at:
                return
            self._timer.cancel()
        self._timer, self._timer_at = threading.Timer(max(0.0, delay), self._wake_up), at
        self._timer.daemon = True
        self._timer.start()

    def _wake_up(self) -> None:
        with self._lock:
            self._timer = None
            self._pump()

    def _take_batch(self) -> list[Item]:
        """The oldest unsent values: the batch handed over again, else from the spool, else from memory."""
        if self._batch:
            return list(self._batch)
        self._batch_end_offset = None
        if self._on_disk > self._sent and self.spool is not None:
            contents, offset = spool_file.read(self.spool, self._read_at, limit=self.max_batch, after=self._sent - 1)
            self._batch = [i for i in contents.items if i.seq < self._on_disk]
            self._batch_end_offset = offset
            if not self._batch:  # the spool holds nothing more that is unsent
                self._sent = self._on_disk
        if not self._batch:
            while self._queue and len(self._batch) < self.max_batch:
                self._batch.append(self._queue.popleft())
        return list(self._batch)

    def _spill(self) -> None:
        """Write every value that is neither sent nor in the spool to it; they leave memory."""
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

    def _upload(self, artifacts: list[tuple[str, str | None]]) -> None:
        """Upload artifacts on the caller's thread; a failure is reported by :meth:`_raise_failures`."""
        for path, folder in artifacts:
            try:
                upload = self._client.log_artifacts if Path(path).is_dir() else self._client.log_artifact
                upload(self.run.run_id, path, folder)
            except Exception as exc:
                log.debug("MLflow log_artifact failed", exc_info=True)
                with self._lock:
                    self._failures.append((f"log_artifact {path}", exc))
                    self._lost += 1

    def _raise_failures(self) -> None:
        """Raise the failures kept since the last call, once."""
        with self._lock:
            failures = self._failures
            self._failures = []
            lost = self._lost
            self._lost = 0
        if not failures:
            return
        what = f"{lost} items were not recorded" if lost else "items may be missing"
        cause = failures[0][1]
        more = f" ({len(failures)} failed requests)" if len(failures) > 1 else ""
        raise TrackingError(
            f"MLflow logging to run {self.run.run_id} at {self.run.uri} failed{more}: {what}; "
            f"first error ({failures[0][0]}): {type(cause).__name__}: {cause}"
        ) from cause


def _skip_exit_drain(client: Any) -> None:
    """Unregister MLflow's at-exit queue drain once nothing of ours is queued: it slows each exit (§6)."""
    store = getattr(getattr(client, "_tracking_client", None), "store", None)
    drain = getattr(getattr(store, "_async_logging_queue", None), "_at_exit_callback", None)
    if drain is not None:
        atexit.unregister(drain)


def start_system_metrics(run: TrackedRun, resumed: bool) -> SystemMetricsMonitor:
    """Start MLflow's system metrics monitor (``mlflow.system_metrics``); the caller calls ``finish()``."""
    from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

    monitor = SystemMetricsMonitor(run.run_id, tracking_uri=run.uri, resume_logging=resumed)
    monitor.start()
    return monitor


@runtime_checkable
class Tracker(Protocol):
    """Where one rank sends its metrics, tags and artifacts; only rank 0 records anything. Only :meth:`flush` and
    :meth:`close` may wait on the network. Every method raises TrackingError once the tracker is closed."""

    def log_metrics(self, metrics: Mapping[str, float], step: int, timestamp_ms: int | None = None) -> None:
        """Record metric values at ``step`` (the global optimizer step), taken at ``timestamp_ms`` (ms since the epoch;
        default now); does not block. TypeError: a step not an int; ValueError: a name MLflow rejects."""

    def log_artifact(self, path: str | os.PathLike[str], artifact_path: str | None = None) -> None:
        """Record a local file or folder as an artifact; it must stay in place until the next flush or close.
        FileNotFoundError when ``path`` does not exist (trackers that record nothing accept it)."""

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        """Set run tags, rendered like params; a later value for a key replaces the earlier. Raises TrackingError
        when closed."""

    def flush(self) -> None:
        """Block until everything recorded before is sent (or spooled); raises TrackingError for what could not be
        sent."""

    def close(self) -> None:
        """Send what is buffered and release the tracker; blocks; harmless twice. Raises as :meth:`flush`."""

    def send(self, message: Any) -> None:
        """Hand the driver a message beyond values, tags and files (the run's data, the trained model), in order with
        them; a tracker with no driver behind it (one that records nothing, or straight into MLflow) drops it."""

    def recorded(self) -> int:
        """Metric values the run has numbered, as of the last flush (a checkpoint stores it, so a resume knows which
        spooled values came before it); 0 for a tracker that keeps none."""


class NullTracker:
    """Records nothing (ranks other than 0, ``tracking.enabled = false``; an artifact's path is not even checked);
    starts no thread, imports no mlflow."""

    def log_metrics(self, metrics: Mapping[str, float], step: int, timestamp_ms: int | None = None) -> None: ...

    def log_artifact(self, path: str | os.PathLike[str], artifact_path: str | None = None) -> None: ...

    def set_tags(self, tags: Mapping[str, Any]) -> None: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...

    def send(self, message: Any) -> None: ...

    def recorded(self) -> int:
        return 0


if TYPE_CHECKING:  # mypy checks here that every tracker implements the protocol; nothing runs
    _null: Tracker = NullTracker()
    _buffered: Tracker = MlflowTracker(TrackedRun("", ""))

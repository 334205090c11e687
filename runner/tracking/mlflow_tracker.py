"""The MLflow tracker: one run's metrics, tags and artifacts, sent from a background thread, spooled when needed.

mlflow is imported inside functions, never when this module is imported.
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
from typing import TYPE_CHECKING, Any, NamedTuple

from runner.errors import TrackingError
from runner.tracking import spool as spool_file
from runner.tracking.spool import Item
from runner.tracking.values import METRICS_PER_BATCH, PARAMS_PER_BATCH, param_value

if TYPE_CHECKING:
    from types import TracebackType

log = logging.getLogger(__name__)

MEMORY_ITEMS = 100_000  # metric values kept in memory while the store is away, before they go to the spool
SPILL_AFTER_S = 5.0  # a flush waits this long for a store that stopped answering, then spools
CLOSE_WAIT_S = 10.0  # close() waits this long for an absent store before it leaves the rest in the spool
_MAX_BACKOFF_S = 30.0
_PERMANENT = {  # MLflow error codes that a retry cannot fix: the values are lost and reported
    "RESOURCE_DOES_NOT_EXIST",
    "INVALID_PARAMETER_VALUE",
    "INVALID_STATE",
    "BAD_REQUEST",
    "PERMISSION_DENIED",
    "UNAUTHENTICATED",
    "RESOURCE_ALREADY_EXISTS",
}


class _Tags(NamedTuple):
    """Buffered ``set_tags`` call: tag key -> rendered value."""

    tags: dict[str, str]


class _Artifact(NamedTuple):
    """Buffered ``log_artifact`` call: an absolute local path and the folder inside the run's artifacts."""

    path: str
    artifact_path: str | None


class MlflowTracker:
    """Logs metrics, tags and artifacts of one run from a background thread.

    ``log_metrics``, ``set_tags`` and ``log_artifact`` only append to a buffer (a lock held for a
    list append); a daemon thread sends metric values in order with ``MlflowClient.log_batch`` (at
    most ``max_batch`` per request) every ``flush_every_s`` seconds, or sooner when ``max_batch``
    values are waiting. The training thread waits on the network only in :meth:`flush` and
    :meth:`close`.

    Without a ``spool``, a failed request is not retried beyond MLflow's own HTTP retries; its
    error is kept and raised as :class:`TrackingError` by the next ``flush``/``close``.

    With a ``spool`` file (docs/design.md §12), a request that fails because the store does not
    answer is retried with a growing pause (up to 30 s) and nothing is lost: unsent values stay in
    memory, up to ``max_memory``, then go to the spool file, and are sent, oldest first, when the
    store answers again. :meth:`flush` then returns once every value recorded before it is sent
    *or written to the spool*, waiting at most ``spill_after_s`` for a store that stopped answering,
    so a checkpoint never stalls training. Values the store rejects (an unknown or deleted run) are
    lost and reported, as without a spool.

    Args:
        uri: Tracking URI.
        run_id: The run to log to (created by :func:`runner.tracking.runs.start_run`).
        flush_every_s: Longest time, in seconds, a metric waits in the buffer.
        max_batch: Metrics per request (capped at MLflow's limit of 1000).
        spool: The run's spool file (:func:`runner.tracking.spool.spool_path`), or ``None``.
        first_seq: Number of the first value recorded here: the run's count when a resumed job
            continues it (values are numbered across resumes).
        max_memory: Unsent values kept in memory before they go to the spool.
        spill_after_s: Seconds a flush waits for a store that does not answer.
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
        from mlflow.tracking import MlflowClient

        if flush_every_s <= 0:
            raise ValueError(f"flush_every_s must be > 0 seconds, got {flush_every_s}")
        self.uri, self.run_id, self.spool = uri, run_id, spool
        self.flush_every_s, self.spill_after_s = float(flush_every_s), float(spill_after_s)
        self.max_batch = max(1, min(int(max_batch), METRICS_PER_BATCH))
        self.max_memory = max(self.max_batch, int(max_memory))
        self._client = MlflowClient(tracking_uri=uri)
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)  # the sender waits on it
        self._done = threading.Condition(self._lock)  # flush() waits on it
        self._queue: deque[Item] = deque()  # values not yet taken by the sender, oldest first
        self._batch: list[Item] = []  # the oldest unsent values, being sent (retried until sent)
        self._batch_end_offset: int | None = None  # spool offset past the batch, when read from the spool
        self._ops: list[_Tags | _Artifact] = []
        self._recorded = self._sent = self._on_disk = first_seq  # next value; all before sent; all before safe
        self._read_at = 0  # spool offset from which values not known to be sent are read back
        self._spilled = False  # this tracker wrote values to the spool that may not be sent yet
        self._ops_queued = self._ops_done = 0
        self._down_until: float | None = None  # the store does not answer: next attempt, monotonic seconds
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
        """Buffer run tags (values rendered like params: ``true``, ``1.0``, JSON for lists).

        Raises:
            TrackingError: The tracker was closed.
        """
        if tags:
            self._add_op(_Tags({str(k): param_value(v) for k, v in tags.items()}))

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
        self._add_op(_Artifact(str(p), artifact_path))

    def recorded(self) -> int:
        """Metric values recorded by the run so far (numbered across resumes); a checkpoint stores it."""
        with self._lock:
            return self._recorded

    def unsent(self) -> int:
        """Metric values not known to have reached the store (with a spool, they are in it after ``close``)."""
        with self._lock:
            return self._recorded - self._sent

    def flush(self, timeout_s: float | None = None) -> None:
        """Block until everything buffered before this call has been sent (with a spool: sent, or spooled).

        Args:
            timeout_s: Give up after this many seconds. Default: wait (without a spool, MLflow's
                HTTP retries bound how long a dead server takes to fail; with one, ``spill_after_s``).

        Raises:
            TrackingError: Sending failed (the errors since the last flush are reported
                once, with how many items were lost), the sender thread died, or the
                timeout passed.
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._lock:
            target, ops_target = self._recorded, self._ops_queued
            spill_at = time.monotonic() + (0.0 if self._down_until is not None else self.spill_after_s)
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
                self._spill()
            pending = 0 if self.spool is not None else (target - self._sent) + (ops_target - self._ops_done)
        self._raise_failures(pending)

    def close(self, timeout_s: float | None = None) -> None:
        """Send everything buffered, then stop the sender thread. Idempotent.

        With a spool, waits at most :data:`CLOSE_WAIT_S` for a store that does not answer; what is
        still unsent then stays in the spool file (tags too), for ``runner status`` or a resume.

        Raises:
            TrackingError: As :meth:`flush`.
        """
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
            log.warning("%s", err)

    def _check_open(self) -> None:
        if self._closing:
            raise TrackingError(f"tracker of run {self.run_id} is closed; nothing more can be logged")

    def _add_op(self, op: _Tags | _Artifact) -> None:
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
            tags = {k: v for op in self._ops if isinstance(op, _Tags) for k, v in op.tags.items()}
            artifacts = [op for op in self._ops if isinstance(op, _Artifact)]
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

    # ---- sender thread

    def _run(self) -> None:
        """Body of the sender thread: send values in order, then tags and artifacts, until closed."""
        try:
            next_due = time.monotonic() + self.flush_every_s
            while True:
                with self._lock:
                    work = self._next_work(next_due)
                if work is None:
                    return
                batch, ops = work
                if not batch or self._send_batch(batch):
                    self._send_ops(ops)
                elif ops:
                    with self._lock:
                        self._ops[:0] = ops  # the store is away: try them again later
                next_due = time.monotonic() + self.flush_every_s
        except BaseException as exc:  # keep it for flush(); the thread ends
            with self._lock:
                self._failures.append(("sender thread", exc))
                self._done.notify_all()

    def _has_values(self) -> bool:
        return bool(self._batch or self._queue or self._on_disk > self._sent)

    def _next_work(self, next_due: float) -> tuple[list[Item], list[_Tags | _Artifact]] | None:
        """Wait (lock held) until there is something to send and it is time; ``None`` when the tracker closes."""
        while True:
            now = time.monotonic()
            if self._closing and (self._down_until is not None or not (self._has_values() or self._ops)):
                return None
            if self._down_until is not None and now < self._down_until and not self._closing:
                self._wake.wait(self._down_until - now)
                continue
            work = self._has_values() or self._ops
            urgent = self._closing or self._flush_wanted or self._down_until is not None or bool(self._batch)
            if work and (urgent or len(self._queue) >= self.max_batch or now >= next_due):
                self._flush_wanted = False
                ops, self._ops = self._ops, []
                return self._take_batch(), ops
            if now >= next_due:
                next_due = now + self.flush_every_s
            self._wake.wait(max(0.0, next_due - now))

    def _take_batch(self) -> list[Item]:
        """The oldest unsent values (lock held): the batch being retried, else from the spool, else from memory."""
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

    def _send_batch(self, batch: list[Item]) -> bool:
        """Send one batch of values; returns whether it reached the store (or was given up on)."""
        from mlflow.entities import Metric

        try:
            self._client.log_batch(
                self.run_id, metrics=[Metric(i.key, i.value, i.timestamp, i.step) for i in batch], synchronous=True
            )
            error: BaseException | None = None
        except Exception as exc:
            error = exc
        with self._lock:
            if error is not None and self.spool is not None and _transient(error):
                log.debug("the tracking store did not take %d values; retrying", len(batch), exc_info=True)
                self._backoff = min(_MAX_BACKOFF_S, max(1.0, 2 * self._backoff))
                self._down_until = time.monotonic() + self._backoff
                self._done.notify_all()
                return False
            if error is not None:
                log.debug("MLflow log_batch failed", exc_info=True)
                self._failures.append((f"log_batch of {len(batch)} metrics", error))
                self._lost += len(batch)
            else:
                self._down_until, self._backoff = None, 0.0
            self._sent = max(self._sent, batch[-1].seq + 1)
            self._batch = []
            if self._batch_end_offset is not None:
                self._read_at = self._batch_end_offset
            self._forget_sent_spool()
            self._done.notify_all()
        return True

    def _forget_sent_spool(self) -> None:
        """Remove the spool once everything in it was sent (lock held)."""
        if self.spool is not None and self._sent >= self._on_disk and self._spilled:
            self.spool.unlink(missing_ok=True)
            self._read_at, self._spilled = 0, False

    def _send_ops(self, ops: list[_Tags | _Artifact]) -> None:
        """Send tags and artifacts in order; a failure is kept for the next flush/close."""
        from mlflow.entities import RunTag

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
                log.debug("MLflow %s failed", type(op).__name__, exc_info=True)
                with self._lock:
                    what = "set_tags" if isinstance(op, _Tags) else f"log_artifact {op.path}"
                    self._failures.append((what, exc))
                    self._lost += 1
            with self._lock:
                self._ops_done += 1
                self._done.notify_all()


def _transient(exc: BaseException) -> bool:
    """Whether a failed request may succeed later (the store did not answer), not a rejection."""
    from mlflow.exceptions import MlflowException

    return not (isinstance(exc, MlflowException) and exc.error_code in _PERMANENT)

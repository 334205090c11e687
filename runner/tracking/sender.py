"""The sender thread of :class:`~runner.tracking.mlflow_tracker.MlflowTracker`: values in order, then tags, artifacts.

The thread takes the oldest unsent values (the batch being retried, else from the spool, else from
memory), sends them with ``MlflowClient.log_batch``, and backs off while the store does not answer
(docs/design.md §12). State is shared with the training thread under ``_lock``. mlflow is imported
inside functions.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from runner.tracking import spool as spool_file
from runner.tracking.spool import Item
from runner.tracking.tags import PARAMS_PER_BATCH

if TYPE_CHECKING:
    from mlflow.tracking import MlflowClient

log = logging.getLogger("runner.tracking.mlflow_tracker")

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


class Tags(NamedTuple):
    """Buffered ``set_tags`` call: tag key -> rendered value."""

    tags: dict[str, str]


class Artifact(NamedTuple):
    """Buffered ``log_artifact`` call: an absolute local path and the folder inside the run's artifacts."""

    path: str
    artifact_path: str | None


class BatchSender:
    """The sender thread's half of a tracker; :class:`~runner.tracking.mlflow_tracker.MlflowTracker` sets the state.

    Attributes are those of the tracker: the buffered values (``_queue``), the batch in flight
    (``_batch``), the counters ``_recorded`` > ``_on_disk`` >= ``_sent`` (value numbers), the pending
    tags and artifacts (``_ops``), and when the store may be tried again (``_down_until``).
    """

    run_id: str
    spool: Path | None
    flush_every_s: float
    max_batch: int
    _client: MlflowClient
    _lock: threading.Lock
    _wake: threading.Condition
    _done: threading.Condition
    _queue: deque[Item]
    _batch: list[Item]
    _batch_end_offset: int | None
    _ops: list[Tags | Artifact]
    _recorded: int
    _sent: int
    _on_disk: int
    _read_at: int
    _spilled: bool
    _ops_done: int
    _down_until: float | None
    _unanswered: bool
    _backoff: float
    _flush_wanted: bool
    _closing: bool
    _failures: list[tuple[str, BaseException]]
    _lost: int

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

    def _next_work(self, next_due: float) -> tuple[list[Item], list[Tags | Artifact]] | None:
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
                self._down_until, self._backoff, self._unanswered = None, 0.0, False
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

    def _send_ops(self, ops: list[Tags | Artifact]) -> None:
        """Send tags and artifacts in order; a failure is kept for the next flush/close."""
        from mlflow.entities import RunTag

        for op in ops:
            try:
                if isinstance(op, Tags):
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
                    what = "set_tags" if isinstance(op, Tags) else f"log_artifact {op.path}"
                    self._failures.append((what, exc))
                    self._lost += 1
            with self._lock:
                self._ops_done += 1
                self._done.notify_all()


def _transient(exc: BaseException) -> bool:
    """Whether a failed request may succeed later (the store did not answer), not a rejection."""
    from mlflow.exceptions import MlflowException

    return not (isinstance(exc, MlflowException) and exc.error_code in _PERMANENT)

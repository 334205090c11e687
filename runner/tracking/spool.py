"""The metric spool: what could not reach the tracking store yet, kept in a JSON-lines file beside the checkpoints.

Details: docs/design.md, "Module notes", runner/tracking/spool.py.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from runner.errors import store_errors
from runner.tracking.runs import end_run, last_logged_steps
from runner.tracking.tags import METRICS_PER_BATCH, PARAMS_PER_BATCH
from runner.tracking.uri import client_for

if TYPE_CHECKING:
    from mlflow.tracking import MlflowClient


SPOOL_NAME = "metrics-spool.jsonl"


class Item(NamedTuple):
    """One metric value: its number in the run, name, value, time (ms since the epoch) and step."""

    seq: int
    key: str
    value: float
    timestamp: int
    step: int


@dataclass
class SpoolContents:
    """What a spool file holds: tags (later replacing earlier) and a run end ``(status, error)`` not yet sent."""

    items: list[Item] = field(default_factory=list)
    tags: dict[str, str] = field(default_factory=dict)
    end: tuple[str, str | None] | None = None


def spool_path(checkpoint_dir: str | os.PathLike[str]) -> Path:
    """The spool file of a run: :data:`SPOOL_NAME` in its checkpoint folder."""
    return Path(checkpoint_dir) / SPOOL_NAME


def append(
    path: Path,
    items: Iterable[Item] = (),
    tags: Mapping[str, str] | None = None,
    end: tuple[str, str | None] | None = None,
) -> int:
    """Append records (and a run ``end``) to the spool at ``path`` and fsync it; return the values written. OSError."""
    lines = [json.dumps({"seq": i.seq, "key": i.key, "value": i.value, "timestamp": i.timestamp, "step": i.step})
             for i in items]  # fmt: skip
    count = len(lines)
    if tags:
        lines.append(json.dumps({"tags": dict(tags)}))
    if end is not None:
        lines.append(json.dumps({"end": end[0], "error": end[1]}))
    if not lines:
        return 0
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as fh:
        fh.write("\n".join(lines) + "\n")
        fh.flush()
        os.fsync(fh.fileno())
    return count


def read(path: Path, offset: int = 0, limit: int | None = None, after: int = -1) -> tuple[SpoolContents, int]:
    """Contents from byte ``offset``: at most ``limit`` values with ``seq > after`` (a last line cut by a crash is
    ignored), and the offset past the last line read."""
    out = SpoolContents()
    if not path.is_file():
        return out, offset
    with open(path, "rb") as fh:
        fh.seek(offset)
        for raw in fh:
            if not raw.endswith(b"\n"):
                break  # a torn last line
            offset += len(raw)
            try:
                record = json.loads(raw)
            except ValueError:
                continue
            if "seq" in record:
                if record["seq"] > after:
                    out.items.append(
                        Item(record["seq"], record["key"], float(record["value"]), record["timestamp"], record["step"])
                    )
            elif "tags" in record:
                out.tags.update(record["tags"])
            elif "end" in record:
                out.end = (record["end"], record.get("error"))
            if limit is not None and len(out.items) >= limit:
                break
    return out, offset


@dataclass(frozen=True)
class Sent:
    """What :func:`send_spool` did: values skipped (already held, or after the checkpoint) and the status applied."""

    metrics: int = 0
    skipped: int = 0
    ended: str | None = None


def send_spool(
    uri: str, run_id: str, path: Path, *, before_seq: int | None = None, apply_end: bool = True
) -> Sent | None:
    """Send a spool to the run and remove it; ``None`` without a spool file.

    ``before_seq`` sends only values recorded before a resume's checkpoint; ``apply_end`` sets the recorded final
    status. Raises TrackingError, keeping the spool, when the store does not answer or rejects the values.
    """
    from mlflow.entities import Metric, RunTag

    if not path.is_file():
        return None
    contents, _ = read(path)
    with store_errors(f"send the metrics kept in {path} to run {run_id} at {uri}"):
        last = last_logged_steps(uri, run_id)
        wanted = [i for i in contents.items if before_seq is None or i.seq < before_seq]
        fresh = [i for i in wanted if i.step > last.get(i.key, -1)]
        client = client_for(uri)
        for start in range(0, len(fresh), METRICS_PER_BATCH):
            chunk = [Metric(i.key, i.value, i.timestamp, i.step) for i in fresh[start : start + METRICS_PER_BATCH]]
            client.log_batch(run_id, metrics=chunk, synchronous=True)
        if contents.tags:
            client.log_batch(run_id, tags=[RunTag(k, v) for k, v in contents.tags.items()], synchronous=True)
    ended = None
    if apply_end and contents.end is not None:
        end_run(uri, run_id, contents.end[0], contents.end[1])
        ended = contents.end[0]
    path.unlink(missing_ok=True)
    return Sent(len(fresh), len(contents.items) - len(fresh), ended)


log = logging.getLogger("runner.tracking.trackers")

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
    """The sender thread's half of a tracker; :class:`MlflowTracker` holds the state (queue, batch in flight,
    counters ``_recorded`` > ``_on_disk`` >= ``_sent``, pending ops, ``_down_until``)."""

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
            contents, offset = read(self.spool, self._read_at, limit=self.max_batch, after=self._sent - 1)
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

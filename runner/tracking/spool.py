"""The metric spool: what could not reach the tracking store yet, kept in a JSON-lines file beside the checkpoints.

While the store does not answer, ``runner.tracking.trackers.MlflowTracker`` keeps the
metric values it could not send in memory and then here, and sends them when the store is back.
Each line is one record:

* ``{"seq": 12, "key": "train/loss", "value": 0.51, "timestamp": 1700000000000, "step": 10}``: a
  metric value; ``seq`` counts the run's metric values from 0 (also across resumes);
* ``{"tags": {"key": "value"}}``: tags set while the store was away;
* ``{"end": "FINISHED", "error": null}``: the run's final status, when the driver could not set it.

What is left in a spool is sent by ``send_spool`` (``runner status RUN_ID``, or a resume, which
first drops the values recorded after its checkpoint: they are computed again). A value is sent only
when its step is beyond what the run holds for that metric, so nothing is logged twice.
mlflow is imported inside the functions.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from runner.errors import store_errors
from runner.tracking.runs import TrackedRun

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
    lines = [json.dumps(item._asdict()) for item in items]
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
                    out.items.append(Item(**record))
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


def send_spool(run: TrackedRun, path: Path, *, before_seq: int | None = None, apply_end: bool = True) -> Sent | None:
    """Send a spool to the run and remove it; ``None`` without a spool file.

    ``before_seq`` sends only values recorded before a resume's checkpoint; ``apply_end`` sets the recorded final
    status. Raises TrackingError, keeping the spool, when the store does not answer or rejects the values.
    """
    from mlflow.entities import Metric, RunTag

    if not path.is_file():
        return None
    contents, _ = read(path)
    with store_errors(f"send the metrics kept in {path} to run {run.run_id} at {run.uri}"):
        last = run.last_logged_steps()
        wanted = [i for i in contents.items if before_seq is None or i.seq < before_seq]
        fresh = [i for i in wanted if i.step > last.get(i.key, -1)]
        metrics = [Metric(i.key, i.value, i.timestamp, i.step) for i in fresh]
        tags = [RunTag(k, v) for k, v in contents.tags.items()]
        run.client.log_batch(run.run_id, metrics=metrics, tags=tags, synchronous=True)  # split within MLflow's limits
    ended = None
    if apply_end and contents.end is not None:
        run.end(*contents.end)
        ended = contents.end[0]
    path.unlink(missing_ok=True)
    return Sent(len(fresh), len(contents.items) - len(fresh), ended)


_PERMANENT = {  # MLflow error codes that a retry cannot fix: the values are lost and reported
    "RESOURCE_DOES_NOT_EXIST",
    "INVALID_PARAMETER_VALUE",
    "INVALID_STATE",
    "BAD_REQUEST",
    "PERMISSION_DENIED",
    "UNAUTHENTICATED",
    "RESOURCE_ALREADY_EXISTS",
}


def transient(exc: BaseException) -> bool:
    """Whether a failed request may succeed later (the store did not answer), not a rejection."""
    from mlflow.exceptions import MlflowException

    return not (isinstance(exc, MlflowException) and exc.error_code in _PERMANENT)

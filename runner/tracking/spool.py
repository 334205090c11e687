"""The metric spool: what could not reach the tracking store yet, kept in a JSON-lines file beside the checkpoints.

While the store does not answer, :class:`~runner.tracking.mlflow_tracker.MlflowTracker` keeps the
metric values it could not send in memory and then here, and sends them when the store is back.
Each line is one record:

* ``{"seq": 12, "key": "train/loss", "value": 0.51, "timestamp": 1700000000000, "step": 10}``: a
  metric value; ``seq`` counts the run's metric values from 0 (also across resumes);
* ``{"tags": {"key": "value"}}``: tags set while the store was away;
* ``{"end": "FINISHED", "error": null}``: the run's final status, when the driver could not set it.

What is left in a spool is sent by :func:`send_spool` (``runner status RUN_ID``, or a resume, which
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

from runner.errors import TrackingError
from runner.tracking.tags import METRICS_PER_BATCH

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
    """What a spool file holds.

    Attributes:
        tags: Tags, later values replacing earlier ones.
        end: ``(status, error)`` of a run end that could not be sent, or ``None``.
    """

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
    """Append records to the spool at ``path`` (created with its folder) and fsync it; returns the values written.

    Args:
        tags: Tags to record, or ``None``.
        end: ``(status, error)`` of a run end to record, or ``None``.

    Raises:
        OSError: The file cannot be written.
    """
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
    """Read a spool from byte ``offset``: at most ``limit`` metric values with ``seq > after``.

    A last line cut short by a crash is ignored.

    Returns:
        The contents and the byte offset just past the last line read.
    """
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
    """What :func:`send_spool` did.

    Attributes:
        skipped: Values not sent: the run already holds their step, or (on resume) they come after the checkpoint.
        ended: The run status that was applied, or ``None``.
    """

    metrics: int = 0
    skipped: int = 0
    ended: str | None = None


def send_spool(
    uri: str, run_id: str, path: Path, *, before_seq: int | None = None, apply_end: bool = True
) -> Sent | None:
    """Send what a spool holds to the run, then remove the file; ``None`` when there is no spool file.

    Args:
        before_seq: Resume: send only values recorded before the checkpoint (``seq < before_seq``); the
            others are computed again after it.
        apply_end: Set the recorded final status (``runner status``); a resume continues the run instead.

    Raises:
        TrackingError: The store does not answer or rejects the values; the spool is kept.
    """
    from mlflow.entities import Metric, RunTag
    from mlflow.tracking import MlflowClient

    from runner.tracking.runs import end_run, last_logged_steps

    if not path.is_file():
        return None
    contents, _ = read(path)
    try:
        last = last_logged_steps(uri, run_id)
        wanted = [i for i in contents.items if before_seq is None or i.seq < before_seq]
        fresh = [i for i in wanted if i.step > last.get(i.key, -1)]
        client = MlflowClient(tracking_uri=uri)
        for start in range(0, len(fresh), METRICS_PER_BATCH):
            chunk = [Metric(i.key, i.value, i.timestamp, i.step) for i in fresh[start : start + METRICS_PER_BATCH]]
            client.log_batch(run_id, metrics=chunk, synchronous=True)
        if contents.tags:
            client.log_batch(run_id, tags=[RunTag(k, v) for k, v in contents.tags.items()], synchronous=True)
    except Exception as exc:
        raise TrackingError(
            f"could not send the metrics kept in {path} to run {run_id} at {uri}: {type(exc).__name__}: {exc}"
        ) from exc
    ended = None
    if apply_end and contents.end is not None:
        end_run(uri, run_id, contents.end[0], contents.end[1])
        ended = contents.end[0]
    path.unlink(missing_ok=True)
    return Sent(len(fresh), len(contents.items) - len(fresh), ended)

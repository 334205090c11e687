"""Parent runs that group child runs (a sweep's trials, a bench's configurations): create, read, find, summarise.
Details: docs/design.md, "Module notes"."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from runner.errors import mask_secrets, store_errors
from runner.tracking.runs import ensure_experiment
from runner.tracking.tags import log_in_batches
from runner.tracking.uri import client_for, open_store

if TYPE_CHECKING:
    from mlflow.tracking import MlflowClient

PARENT_TAG = "mlflow.parentRunId"


def _client(uri: str) -> MlflowClient:
    open_store(uri)  # the first use of a new sqlite store creates it, under its lock
    return client_for(uri)


def experiment_id(uri: str, experiment: str) -> str:
    """Id of experiment ``experiment`` at ``uri``, created when missing; TrackingError if deleted or rejected."""
    with store_errors(f"open MLflow experiment {experiment!r} at {uri}"):
        return ensure_experiment(_client(uri), experiment, uri)


def record_summary(
    uri: str,
    run_id: str,
    *,
    metrics: Mapping[str, float] | None = None,
    params: Mapping[str, str] | None = None,
    tags: Mapping[str, str] | None = None,
    texts: Mapping[str, str] | None = None,
    files: Sequence[str | Path] = (),
    files_dir: str | None = None,
    step: int = 0,
) -> None:
    """Record what a parent or finished child sums up: metrics at ``step``, params, tags, files under ``files_dir``."""
    from mlflow.entities import Metric, Param, RunTag

    client, now = _client(uri), int(time.time() * 1000)
    with store_errors(f"record the summary of run {run_id} at {uri}"):
        log_in_batches(
            client,
            run_id,
            metrics=[Metric(k, float(v), now, step) for k, v in (metrics or {}).items()],
            params=[Param(k, mask_secrets(v)) for k, v in (params or {}).items()],
            tags=[RunTag(k, mask_secrets(v)) for k, v in (tags or {}).items()],
        )
        for artifact_file, text in (texts or {}).items():
            client.log_text(run_id, mask_secrets(text), artifact_file)
        for file in files:
            client.log_artifact(run_id, str(file), files_dir)


def mark_running(uri: str, run_id: str) -> None:
    """Set a stopped run RUNNING again (a parent whose children run again); TrackingError when rejected."""
    with store_errors(f"reopen MLflow run {run_id} at {uri}"):
        _client(uri).update_run(run_id, status="RUNNING")

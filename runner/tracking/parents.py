"""Parent runs that group child runs (a sweep's trials, a bench's configurations): create, read, find, summarise.

Details: docs/design.md, "Module notes", runner/tracking/parents.py.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from runner.errors import TrackingError, mask_secrets, store_errors
from runner.tracking.runs import ensure_experiment, mark_failed_quietly
from runner.tracking.tags import METRICS_PER_BATCH, PARAMS_PER_BATCH
from runner.tracking.uri import client_for, open_store

if TYPE_CHECKING:
    from mlflow.entities import Run
    from mlflow.tracking import MlflowClient

PARENT_TAG = "mlflow.parentRunId"


@dataclass(frozen=True)
class RunRecord:
    """A run as read back from the store.

    Attributes:
        status: ``RUNNING``, ``FINISHED``, ``FAILED`` or ``KILLED``.
        start_time_ms: Start time, milliseconds since the Unix epoch.
    """

    run_id: str
    experiment_id: str
    status: str
    start_time_ms: int
    tags: dict[str, str] = field(default_factory=dict)
    params: dict[str, str] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)


def _record(run: Run) -> RunRecord:
    return RunRecord(
        run_id=run.info.run_id,
        experiment_id=run.info.experiment_id,
        status=run.info.status,
        start_time_ms=int(run.info.start_time or 0),
        tags=dict(run.data.tags),
        params=dict(run.data.params),
        metrics={k: float(v) for k, v in run.data.metrics.items()},
    )


def _client(uri: str) -> MlflowClient:
    open_store(uri)  # the first use of a new sqlite store creates it, under its lock
    return client_for(uri)


def experiment_id(uri: str, experiment: str) -> str:
    """Id of the experiment named ``experiment`` at ``uri``, created when missing.

    Raises:
        TrackingError: The experiment is deleted, or MLflow rejects a request.
    """
    with store_errors(f"open MLflow experiment {experiment!r} at {uri}"):
        return ensure_experiment(_client(uri), experiment, uri)


def _log_batches(
    client: MlflowClient,
    run_id: str,
    *,
    metrics: Mapping[str, float],
    params: Mapping[str, str],
    tags: Mapping[str, str],
    step: int,
) -> None:
    """Log metrics (at ``step``, timestamped now), params and tags within MLflow's per-request limits."""
    from mlflow.entities import Metric, Param, RunTag

    now = int(time.time() * 1000)
    metric_list = [Metric(k, float(v), now, step) for k, v in metrics.items()]
    param_list = [Param(k, mask_secrets(v)) for k, v in params.items()]
    tag_list = [RunTag(k, mask_secrets(v)) for k, v in tags.items()]
    for i in range(0, len(param_list), PARAMS_PER_BATCH):
        client.log_batch(run_id, params=param_list[i : i + PARAMS_PER_BATCH], synchronous=True)
    for i in range(0, len(tag_list), PARAMS_PER_BATCH):
        client.log_batch(run_id, tags=tag_list[i : i + PARAMS_PER_BATCH], synchronous=True)
    for i in range(0, len(metric_list), METRICS_PER_BATCH):
        client.log_batch(run_id, metrics=metric_list[i : i + METRICS_PER_BATCH], synchronous=True)


def create_parent_run(
    uri: str,
    experiment: str,
    *,
    run_name: str,
    tags: Mapping[str, str],
    params: Mapping[str, str] | None = None,
    texts: Mapping[str, str] | None = None,
    what: str = "the parent run",
) -> str:
    """Create a RUNNING run that child runs will point at, with its tags, params and text artifacts.

    The experiment is created when missing. If recording the params or texts fails, the
    run is ended FAILED before the error is raised.

    Args:
        tags: Tags given at creation (values within MLflow's length limit).
        params: Params (logged in batches of 100).
        texts: Artifact path -> text, each logged with ``MlflowClient.log_text``.
        what: The run in error messages, e.g. ``"the sweep's parent run"``.

    Returns:
        The new run's id.

    Raises:
        TrackingError: The experiment is deleted, or MLflow rejects a request.
    """
    eid = experiment_id(uri, experiment)
    client = _client(uri)
    with store_errors(f"create {what} at {uri}"):
        masked = {key: mask_secrets(value) for key, value in tags.items()}
        run_id = str(client.create_run(eid, tags=masked, run_name=mask_secrets(run_name)).info.run_id)
    try:
        _log_batches(client, run_id, metrics={}, params=params or {}, tags={}, step=0)
        for artifact_file, text in (texts or {}).items():
            client.log_text(run_id, mask_secrets(text), artifact_file)
    except Exception as exc:
        mark_failed_quietly(client, run_id)
        raise TrackingError(f"could not record {what} {run_id} at {uri}: {exc}") from exc
    return run_id


def find_run(uri: str, run_id: str) -> RunRecord | None:
    """The run ``run_id`` at ``uri``, or ``None`` when the store has no such run.

    Raises:
        TrackingError: The store cannot be read for another reason.
    """
    from mlflow.exceptions import MlflowException

    try:
        return _record(_client(uri).get_run(run_id))
    except MlflowException:
        return None
    except Exception as exc:
        raise TrackingError(f"could not read MLflow run {run_id} at {uri}: {type(exc).__name__}: {exc}") from exc


def child_runs(
    uri: str, experiment_id: str, parent_run_id: str, tags: Mapping[str, str] | None = None
) -> list[RunRecord]:
    """Every run of ``experiment_id`` whose ``mlflow.parentRunId`` is ``parent_run_id``, oldest first.

    Args:
        tags: Only children with these tag values (e.g. a sweep's ``runner.sweep.optuna_trial``).

    Raises:
        TrackingError: MLflow rejects a request.
    """
    client = _client(uri)
    runs: list[RunRecord] = []
    token = None
    conditions = [f"tags.{PARENT_TAG} = '{parent_run_id}'"]
    conditions += [f"tags.`{key}` = '{value}'" for key, value in (tags or {}).items()]
    with store_errors(f"list the child runs of {parent_run_id} at {uri}"):
        while True:
            page = client.search_runs(
                [experiment_id],
                filter_string=" and ".join(conditions),
                order_by=["attributes.start_time ASC"],
                page_token=token,
            )
            runs += [_record(run) for run in page]
            token = page.token
            if not token:
                return runs


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
    """Record what a parent (or a finished child) run sums up: figures, params, tags and files.

    Args:
        metrics: Metric key -> value, logged once at ``step``, timestamped now.
        params: Param key -> value (a param cannot change once logged).
        files_dir: Folder of ``files`` inside the run's artifacts. Default: the root.

    Raises:
        TrackingError: MLflow rejects a request.
    """
    client = _client(uri)
    with store_errors(f"record the summary of run {run_id} at {uri}"):
        _log_batches(client, run_id, metrics=metrics or {}, params=params or {}, tags=tags or {}, step=step)
        for artifact_file, text in (texts or {}).items():
            client.log_text(run_id, mask_secrets(text), artifact_file)
        for file in files:
            client.log_artifact(run_id, str(file), files_dir)


def mark_running(uri: str, run_id: str) -> None:
    """Set a stopped run's status back to RUNNING (a parent whose children are run again); nothing else changes.

    Raises:
        TrackingError: MLflow rejects the update.
    """
    with store_errors(f"reopen MLflow run {run_id} at {uri}"):
        _client(uri).update_run(run_id, status="RUNNING")

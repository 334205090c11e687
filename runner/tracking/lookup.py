"""Look runs up and mark them: one run's status and tags, every run still RUNNING in a store, tags set afterwards.

Used by ``runner status`` and resume to find runs whose owner died (:mod:`runner.launch.owner`).
mlflow is imported inside the functions.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from runner.errors import TrackingError, UsageError


@dataclass(frozen=True)
class RunInfo:
    """What a run says about itself.

    Attributes:
        run_id: The run.
        status: ``RUNNING``, ``FINISHED``, ``FAILED`` or ``KILLED``.
        tags: Its tags.
        experiment: Name of its experiment.
        run_name: Its display name.
        start_time_ms: When it started, milliseconds since the epoch (MLflow's unit).
    """

    run_id: str
    status: str
    tags: dict[str, str]
    experiment: str = ""
    run_name: str = ""
    start_time_ms: int = 0


def run_info(uri: str, run_id: str) -> RunInfo:
    """Status and tags of ``run_id``.

    Raises:
        UsageError: No such run in the store (or it is deleted).
        TrackingError: The store does not answer.
    """
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    try:
        run = client.get_run(run_id)
    except MlflowException as exc:
        if getattr(exc, "error_code", "") == "RESOURCE_DOES_NOT_EXIST":
            raise UsageError(f"{run_id}: no such run at {uri} (copy the run id from the MLflow UI)") from None
        raise TrackingError(f"could not read MLflow run {run_id} at {uri}: {exc.message}") from None
    if run.info.lifecycle_stage == "deleted":
        raise UsageError(f"{run_id}: the run is deleted at {uri}")
    experiment = client.get_experiment(run.info.experiment_id)
    return RunInfo(run_id, str(run.info.status), dict(run.data.tags), experiment.name if experiment else "")


def running_runs(uri: str, limit: int = 1000) -> list[RunInfo]:
    """Every run of every experiment at ``uri`` whose status is RUNNING (newest first, at most ``limit``).

    Raises:
        TrackingError: The store does not answer.
    """
    from mlflow.entities import ViewType
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    try:
        experiments = {e.experiment_id: e.name for e in client.search_experiments(view_type=ViewType.ACTIVE_ONLY)}
        if not experiments:
            return []
        runs = client.search_runs(
            list(experiments),
            filter_string="attributes.status = 'RUNNING'",
            order_by=["attributes.start_time DESC"],
            max_results=limit,
        )
    except MlflowException as exc:
        raise TrackingError(f"could not search the runs at {uri}: {exc.message}") from None
    return [
        RunInfo(r.info.run_id, str(r.info.status), dict(r.data.tags), experiments[r.info.experiment_id]) for r in runs
    ]


def continuable_runs(uri: str, experiment: str, limit: int = 100) -> list[RunInfo]:
    """The runs of ``experiment`` that ``runner exec`` of its spec could continue, newest first.

    Candidates are KILLED, FAILED or RUNNING (a RUNNING run is continued only when its owner is
    gone, which :mod:`runner.launch.owner` decides). Not candidates: FINISHED runs, the parent runs
    of sweeps and benches (tags ``runner.sweep`` / ``runner.bench`` = ``parent``) and child runs
    (trials, bench configurations: tag ``mlflow.parentRunId``).

    Raises:
        TrackingError: The store does not answer.
    """
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    try:
        exp = client.get_experiment_by_name(experiment)
        if exp is None:
            return []
        runs = client.search_runs([exp.experiment_id], order_by=["attributes.start_time DESC"], max_results=limit)
    except MlflowException as exc:
        raise TrackingError(f"could not search the runs of experiment {experiment!r} at {uri}: {exc.message}") from None
    tags_of = [dict(r.data.tags) for r in runs]
    return [
        RunInfo(r.info.run_id, str(r.info.status), tags, experiment, str(r.info.run_name or ""), r.info.start_time or 0)
        for r, tags in zip(runs, tags_of, strict=True)
        if r.info.status in ("RUNNING", "KILLED", "FAILED")
        and "mlflow.parentRunId" not in tags
        and "parent" not in (tags.get("runner.sweep"), tags.get("runner.bench"))
    ]


def set_run_tags(uri: str, run_id: str, tags: Mapping[str, str]) -> None:
    """Set tags on a run (replacing earlier values).

    Raises:
        TrackingError: MLflow rejects the request.
    """
    from mlflow.entities import RunTag
    from mlflow.tracking import MlflowClient

    try:
        MlflowClient(tracking_uri=uri).log_batch(run_id, tags=[RunTag(k, v) for k, v in tags.items()], synchronous=True)
    except Exception as exc:
        raise TrackingError(f"could not tag MLflow run {run_id} at {uri}: {type(exc).__name__}: {exc}") from exc

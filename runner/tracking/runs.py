"""MLflow runs: create one with its spec and provenance; the run handle (``TrackedRun``) records into it, ends,
reopens, deletes and reads it back.

A child run points at its parent with the tag ``mlflow.parentRunId``, which the MLflow UI
nests. The parent-run functions know nothing of sweeps or benches: the tools give them names,
tags, params, metrics and texts, and find the children with ``runner.tracking.stored.search_runs``.

Only ``mlflow.tracking.MlflowClient`` is used, always with an explicit run id, so runs never depend on MLflow's
fluent "active run" stack. A run is reached through its handle, which holds the process's one client of the store
(``runner.tracking.uri.client_for``) and maps MLflow's errors onto ``TrackingError`` with
``runner.errors.store_errors`` (MLflow's own message; runner's errors pass through), so no caller carries a URI
beside a run id. Where the store is lives in ``runner.tracking.uri``, what a run records about its origin in
``runner.tracking.tags``, the trackers that log a run's metrics in ``runner.tracking.trackers``. mlflow and torch
are imported inside functions, never when this module is imported.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from runner.errors import TrackingError, UsageError, first_line, mask_secrets, store_errors
from runner.tracking.tags import (
    git_artifacts,
    git_info,
    planned,
    run_tags,
    spec_artifacts,
    spec_params,
    tag_run,
)
from runner.tracking.uri import client_for, open_store, resolve_tracking_uri, sqlite_path

if TYPE_CHECKING:
    from mlflow.entities import Run
    from mlflow.tracking import MlflowClient

    from runner.spec.loading import LoadedSpec

TERMINAL_STATUSES = ("FINISHED", "FAILED", "KILLED")
# MLflow 3's UI shows an experiment with this tag in its model-training view (Runs, charts) instead of
# its GenAI view (traces overview, runs labelled "Evaluations"); the value is the UI's own.
EXPERIMENT_KIND = ("mlflow.experimentKind", "custom_model_development")
ERROR_TAG_CHARS = 1000


THREADS_PARAM = "runner.threads_per_process"


@dataclass(frozen=True)
class RunRecord:
    """A run as read back: status, start time (milliseconds since the epoch), its experiment's name when asked."""

    run_id: str
    experiment_id: str
    status: str
    start_time_ms: int
    tags: dict[str, str] = field(default_factory=dict)
    params: dict[str, str] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    experiment: str = ""
    run_name: str = ""


def run_record(run: Run, experiment: str = "") -> RunRecord:
    """The :class:`RunRecord` of an MLflow ``Run``."""
    info = run.info
    data = run.data
    metrics = {k: float(v) for k, v in data.metrics.items()}
    started, name = int(info.start_time or 0), str(info.run_name or "")
    return RunRecord(
        info.run_id,
        info.experiment_id,
        str(info.status),
        started,
        dict(data.tags),
        dict(data.params),
        metrics,
        experiment,
        name,
    )


def check_fluent_run(nested: bool) -> str | None:
    """Raise when a fluent MLflow run is active and nesting was not asked for; return the parent id."""
    import mlflow

    active = mlflow.active_run()
    if active is None:
        return None
    active_id = active.info.run_id
    if not nested:
        raise TrackingError(
            f"an MLflow run ({active_id}) is already active in this process "
            "(mlflow.start_run() was called before runner): end it with mlflow.end_run() first, "
            "or pass nested=True to record this run as its child"
        )
    return str(active_id)


def experiment_artifact_location(uri: str, name: str) -> str | None:
    """``<db folder>/mlartifacts/<safe name>`` for a sqlite store (as ``mlflow server`` does), else ``None``.

    MLflow's default ``./mlruns`` would spread a store's runs over every folder they started from. An unsafe name
    becomes its cleaned form plus 8 hex digits of its SHA-256, so names that clean alike keep apart (docs/design.md §6).
    """
    path = sqlite_path(uri)
    if path is None:
        return None
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._") or "experiment"
    if safe != name:
        safe += "-" + hashlib.sha256(name.encode()).hexdigest()[:8]
    return (path.parent / "mlartifacts" / safe).as_uri()


def ensure_experiment(client: MlflowClient, name: str, uri: str) -> str:
    """The id of experiment ``name``, created when missing (safe under races), with :data:`EXPERIMENT_KIND` set if
    unset.

    Raises TrackingError for a deleted experiment, MlflowException when MLflow rejects a request.
    """
    from mlflow.exceptions import MlflowException

    exp = client.get_experiment_by_name(name)
    if exp is None:
        try:
            location = experiment_artifact_location(uri, name)
            return client.create_experiment(name, artifact_location=location, tags=dict([EXPERIMENT_KIND]))
        except MlflowException as exc:
            if getattr(exc, "error_code", "") != "RESOURCE_ALREADY_EXISTS":
                raise
            exp = client.get_experiment_by_name(name)  # another process created it meanwhile
            if exp is None:
                raise
    if exp.lifecycle_stage == "deleted":
        raise TrackingError(
            f"MLflow experiment {name!r} (id {exp.experiment_id}) in {uri} is deleted: restore it with "
            f"`mlflow experiments restore --experiment-id {exp.experiment_id}` "
            "or set tracking.experiment to another name"
        )
    if EXPERIMENT_KIND[0] not in exp.tags:
        client.set_experiment_tag(exp.experiment_id, *EXPERIMENT_KIND)
    return str(exp.experiment_id)


def start_run(
    loaded: LoadedSpec,
    plan_description: Mapping[str, Any],
    run_name: str | None = None,
    extra_tags: Mapping[str, Any] | None = None,
    *,
    uri: str | None = None,
    nested: bool = False,
    experiment: str | None = None,
) -> RunRecord:
    """Create the MLflow run and record its spec, provenance and plan; it is RUNNING until :meth:`TrackedRun.end`.

    An explicit run id, without MLflow's fluent run. Params are the keys that apply; tags from :func:`run_tags`;
    artifacts ``spec/`` and ``git/``. A failure after creation marks the run FAILED first. ``nested`` allows an active
    fluent run and makes it the parent. Raises TrackingError: A fluent run is active without ``nested``, the store is
    unreachable, the experiment is deleted, or MLflow rejects a request."""
    spec = loaded.spec
    uri = uri or resolve_tracking_uri(spec)
    parent_run_id = check_fluent_run(nested)
    open_store(uri)
    # Everything that can fail without the network is computed before the run exists.
    params, texts, tags = _what_the_run_records(loaded, plan_description, extra_tags, parent_run_id)
    run_name = mask_secrets(run_name or spec.tracking.run_name or "") or None
    experiment_name = experiment or spec.experiment_name

    client = client_for(uri)
    with store_errors(f"create an MLflow run in experiment {experiment_name!r} at {uri}"):
        experiment_id = ensure_experiment(client, experiment_name, uri)
        run = client.create_run(experiment_id, tags=tags, run_name=run_name)
    try:
        TrackedRun(uri, run.info.run_id).log(params=params, texts=texts)
    except TrackingError:
        with contextlib.suppress(Exception):  # the original error matters more
            set_terminated(client, run.info.run_id, "FAILED")
        raise
    return run_record(run, experiment_name)


def _what_the_run_records(
    loaded: LoadedSpec, plan_description: Mapping[str, Any], extra_tags: Mapping[str, Any] | None, parent: str | None
) -> tuple[dict[str, str], dict[str, str], dict[str, str]]:
    """``(params, text artifacts, tags)`` of a new run, credentials masked: they never leave the process."""
    from runner.spec.dump import dump_spec

    accelerator = planned(plan_description, "accelerator")
    accelerator = str(accelerator) if accelerator else None
    params = {k: mask_secrets(v) for k, v in spec_params(loaded.spec, accelerator).items()}
    threads = planned(plan_description, "threads_per_process")
    if threads is not None:  # the CPU threads each training process used (docs/design.md §3)
        params[THREADS_PARAM] = str(threads)
    plan_json = json.dumps(dict(plan_description), indent=2, sort_keys=True, default=str) + "\n"
    texts = spec_artifacts(loaded, dump_spec(loaded.spec), plan_json)
    info = git_info(loaded.path)
    texts.update(git_artifacts(info))
    tags = run_tags(loaded, plan_description, info, extra_tags, parent)
    return params, {k: mask_secrets(v) for k, v in texts.items()}, {k: mask_secrets(str(v)) for k, v in tags.items()}


def _error_tag(error: str) -> str:
    """Keep both ends of a long error (a traceback ends with the exception message)."""
    text = error.strip()
    if len(text) <= ERROR_TAG_CHARS:
        return text
    head = 200
    tail = ERROR_TAG_CHARS - 260
    return (
        f"{text[:head]}\n...[{len(text) - head - tail} chars cut; full text in artifact error.txt]...\n{text[-tail:]}"
    )


@dataclass(frozen=True)
class TrackedRun:
    """One MLflow run, by its store and id: the handle through which runner records into a run, ends, reopens,
    deletes and reads it back. It owns the process's client of the store (``client_for``) and maps the store's
    errors onto TrackingError naming the run and the store (``store_errors``), so no caller passes a URI beside a
    run id or words that error itself. Whoever creates or finds a run makes its handle (in ``runner exec`` the
    driver, once the run exists) and passes the handle down."""

    uri: str
    run_id: str

    @property
    def client(self) -> MlflowClient:
        return client_for(self.uri)

    def errors(self, doing: str, detail: str = "") -> contextlib.AbstractContextManager[None]:
        """Map the store's errors while ``doing`` (``"end"``, ``"log to"`` ...) this run onto TrackingError."""
        return store_errors(f"{doing} MLflow run {self.run_id} at {self.uri}{detail}")

    def find(self) -> RunRecord | None:
        """The run's record, or ``None`` (no such run, or deleted); TrackingError when the store cannot be read."""
        from mlflow.exceptions import MlflowException

        with self.errors("read"):
            try:
                run = self.client.get_run(self.run_id)
            except MlflowException as exc:
                if exc.error_code in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):  # no such run, or no id
                    return None
                raise
        return None if run.info.lifecycle_stage == "deleted" else run_record(run)

    def record(self) -> RunRecord:
        """:meth:`find`'s record; UsageError for no such run (or a deleted one)."""
        found = self.find()
        if found is None:
            raise UsageError(
                f"{self.run_id}: no such run at {self.uri}, or it is deleted (copy the run id from the MLflow UI)"
            )
        return found

    def log(
        self,
        *,
        metrics: Mapping[str, float] | None = None,
        params: Mapping[str, str] | None = None,
        tags: Mapping[str, str] | None = None,
        texts: Mapping[str, str] | None = None,
        files: Sequence[str | Path] = (),
        files_dir: str | None = None,
        step: int = 0,
        remarks: Mapping[str, str] | None = None,
    ) -> None:
        """Log to the run in a few requests: metrics at ``step``, params, tags, texts, files under ``files_dir``, and
        ``remarks`` added to its description (credentials masked); TrackingError when MLflow rejects them."""
        from mlflow.entities import Metric, Param

        open_store(self.uri)  # the first use of a new sqlite store creates it, under its lock
        now = int(time.time() * 1000)
        client = self.client
        with self.errors("log to"):
            client.log_batch(
                self.run_id,
                metrics=[Metric(k, float(v), now, step) for k, v in (metrics or {}).items()],
                params=[Param(k, mask_secrets(v)) for k, v in (params or {}).items()],
                synchronous=True,  # MLflow splits it into requests within its limits
            )
            for artifact_file, text in (texts or {}).items():
                client.log_text(self.run_id, mask_secrets(text), artifact_file)
            for file in files:
                client.log_artifact(self.run_id, str(file), files_dir)
            if tags or remarks:  # the column rule of runner.* tags, as every tag runner writes
                masked = [{k: mask_secrets(v) for k, v in m.items()} for m in (tags or {}, remarks or {})]
                tag_run(client, self.run_id, *masked)

    def end(self, status: str, error: str | None = None) -> None:
        """Give the run its terminal ``status``; ``error`` goes whole to ``error.txt``, cut into the description, and
        its naming line into tag ``runner.error``. Raises ValueError for another status, TrackingError when MLflow
        rejects it."""
        if status not in TERMINAL_STATUSES:
            raise ValueError(f"status {status!r} is not one of {', '.join(TERMINAL_STATUSES)}")
        error = mask_secrets(error) if error else error
        with self.errors("end", f" with status {status}"):
            if error:
                tag_run(self.client, self.run_id, {"runner.error": first_line(error)}, {"error": _error_tag(error)})
                self.client.log_text(self.run_id, error if error.endswith("\n") else error + "\n", "error.txt")
            set_terminated(self.client, self.run_id, status)

    def reopen(self, spec_change: str | None = None, *, resumed: bool = True) -> None:
        """Mark the stopped run RUNNING again: a resumed job (counted in tag ``runner.resume.count``, ``spec_change`` in
        tag ``runner.resume.spec_change``), or a parent whose children run again (``resumed=False``)."""
        client = self.client
        with self.errors("reopen"):
            client.update_run(self.run_id, status="RUNNING")
            if not resumed:
                return
            count = int(client.get_run(self.run_id).data.tags.get("runner.resume.count", "0")) + 1
            client.set_tag(self.run_id, "runner.resume.count", str(count))
            if spec_change:
                tag_run(client, self.run_id, {"runner.resume.spec_change": spec_change}, {"spec change": spec_change})

    def delete(self) -> None:
        """Delete a run that never trained (its spec did not build), leaving not even a deleted run where the store
        allows it: a database or file store purges it and its artifacts as ``mlflow gc`` does; a server only marks it
        deleted (its ``mlflow gc`` purges). TrackingError when rejected."""
        from mlflow.store.artifact.artifact_repository_registry import get_artifact_repository

        with self.errors("delete"):
            client = self.client
            client.delete_run(self.run_id)
            store = client._tracking_client.store
            if hasattr(store, "_hard_delete_run"):
                get_artifact_repository(client.get_run(self.run_id).info.artifact_uri).delete_artifacts()
                store._hard_delete_run(self.run_id)

    def experiment_id(self) -> str:
        """The id of the run's experiment, or ``""`` when the store does not say (a link is then left out)."""
        try:
            return str(self.client.get_run(self.run_id).info.experiment_id)
        except Exception:  # only for a printed link: the run's own outcome is already recorded
            return ""

    def last_logged_steps(self) -> dict[str, int]:
        """The highest step logged for every metric of the run, so a resumed job never logs a step twice."""
        client = self.client
        keys = client.get_run(self.run_id).data.metrics.keys()
        return {k: max((m.step for m in client.get_metric_history(self.run_id, k)), default=-1) for k in keys}


def set_terminated(client: MlflowClient, run_id: str, status: str) -> None:
    """``MlflowClient.set_terminated`` without its ``shut_down_async_logging()``, which joins MLflow's idle logging
    loop (``queue.get(timeout=1)``): 1 s a run. runner's tracker waited for its batches before the run ends."""
    from mlflow.entities import RunStatus

    stamp = int(time.time() * 1000)
    client._tracking_client.store.update_run_info(run_id, RunStatus.from_string(status), stamp, None)


# ----------------------------------------------------------------------------- parent runs (docs/design.md)


PARENT_TAG = "mlflow.parentRunId"


def experiment_id(uri: str, experiment: str) -> str:
    """Id of experiment ``experiment`` at ``uri``, created when missing; TrackingError if deleted or rejected."""
    open_store(uri)  # the first use of a new sqlite store creates it, under its lock
    with store_errors(f"open MLflow experiment {experiment!r} at {uri}"):
        return ensure_experiment(client_for(uri), experiment, uri)

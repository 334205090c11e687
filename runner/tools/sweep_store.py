"""What a sweep records in MLflow (parent run, child runs, best trial, plots), and its Optuna storage, sampler, pruner.
Details: docs/design.md, "Module notes"."""

from __future__ import annotations

import hashlib
import json
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from runner.tools.sweep_space import SweepDefinition, SweepReport
from runner.tracking import runs
from runner.tracking.runs import RunRecord
from runner.tracking.stored import search_runs
from runner.tracking.tags import max_param_chars, max_tag_chars, safe_key
from runner.tracking.uri import local_store_path, resolve_tracking_uri

if TYPE_CHECKING:
    from optuna.pruners import BasePruner
    from optuna.samplers import BaseSampler
    from optuna.storages import RDBStorage

    from runner.spec.loading import LoadedSpec
    from runner.spec.schema import ExperimentSpec


PRUNED_TAG = "runner.sweep.pruned"


class SweepStore:
    """The sweep's runs in one store and experiment; nothing touches the store before a method needs it."""

    def __init__(self, uri: str, experiment: str):
        self.uri, self.experiment = uri, experiment

    @classmethod
    def for_spec(cls, spec: ExperimentSpec) -> SweepStore:
        """The store and experiment the spec's runs are recorded in."""
        return cls(resolve_tracking_uri(spec), spec.tracking.experiment or spec.name)

    def create_parent(self, base: LoadedSpec, definition: SweepDefinition, study: str, storage: str) -> str:
        """Create the parent run as ``runner exec`` records a run (:func:`~runner.tracking.runs.start_run`), with the
        definition as params, the study and storage as tags and ``sweep.json``."""
        recorded = json.dumps(definition.to_json(), default=str)
        tags = {"runner.sweep": "parent", "runner.sweep.study": study, "runner.sweep.storage": storage}
        if len(recorded) <= max_tag_chars():
            tags["runner.sweep.definition"] = recorded
        fields = ("method", "seed", "metric", "goal", "trials", "pruner")
        params = {f"sweep.{name}": str(getattr(definition, name)) for name in fields}
        limit = max_param_chars()
        params.update({safe_key(f"sweep.params.{k}"): definition.describe(k)[:limit] for k in definition.params})
        sweep_json: dict[str, Any] = {"spec": str(base.path), "overrides": base.overrides, "unset": base.unset}
        sweep_json |= {"study": study, "storage": storage, "definition": definition.to_json()}
        run = runs.start_run(
            base, {"mode": "sweep"}, parent_run_name(base.spec.name), tags, uri=self.uri, experiment=self.experiment
        )
        texts = {"sweep.json": json.dumps(sweep_json, indent=2, default=str) + "\n"}
        try:
            runs.record_summary(self.uri, run.run_id, params=params, texts=texts)
        except BaseException:
            runs.delete_run(self.uri, run.run_id)
            raise
        return run.run_id

    def reopen(self, run_id: str) -> None:
        """Mark the parent RUNNING again when a worker joins a stopped sweep."""
        record = runs.find_run(self.uri, run_id)
        if record is not None and record.status != "RUNNING":
            runs.mark_running(self.uri, run_id)

    def trial_runs(self, parent_id: str, number: int) -> list[RunRecord]:
        """The child runs of Optuna trial ``number``, newest first (the first is its latest attempt's)."""
        tags = {runs.PARENT_TAG: parent_id, "runner.sweep.optuna_trial": str(number)}
        return search_runs(self.uri, self.experiment, tags)

    def trial_run(self, parent_id: str, number: int) -> str | None:
        """The child run of Optuna trial ``number`` (for a trial whose training raised), or ``None``."""
        runs = self.trial_runs(parent_id, number)
        return runs[0].run_id if runs else None

    def kill_taken_over(self, parent_id: str, numbers: Sequence[int]) -> None:
        """End KILLED the runs of trials whose worker died (the trials run again under a new run)."""
        for number in numbers:
            for run in self.trial_runs(parent_id, number):
                if run.status == "RUNNING":
                    why = f"trial {number} was taken over by another worker: its worker stopped sending heartbeats"
                    runs.end_run(self.uri, run.run_id, "KILLED", why)

    def mark_pruned(self, run_id: str, epoch: int) -> None:
        """Tag a trial's run as pruned after ``epoch`` (its status stays FINISHED; docs/design.md §16)."""
        runs.record_summary(self.uri, run_id, tags={PRUNED_TAG: "true", "runner.sweep.pruned_epoch": str(epoch)})

    def end(self, run_id: str, status: str, error: str | None, report: SweepReport, plots: Sequence[Path] = ()) -> None:
        """Record the best trial, the report and the plots on the parent run, then end it with ``status``."""
        best = report.best if report.trials else None
        metrics: dict[str, float] = {}
        tags = {"runner.sweep.failed": str(report.failed), "runner.sweep.pruned_trials": str(report.pruned)}
        if best is not None and best.metric_value is not None:
            metrics[safe_key(f"best/{report.definition.metric}")] = float(best.metric_value)
            tags["runner.sweep.best_run_id"] = best.run_id or ""
            tags["runner.sweep.best_trial"] = str(best.index)
        texts = {"sweep_report.json": json.dumps(report.to_json(), indent=2, default=str) + "\n"}
        runs.record_summary(
            self.uri, run_id, metrics=metrics, tags=tags, texts=texts, files=list(plots), files_dir="plots"
        )
        runs.end_run(self.uri, run_id, status, error)


def parent_run_name(name: str) -> str:
    """The sweep's parent run name: the spec name with ``-sweep`` appended, unless it already ends with it."""
    return name if name.endswith("-sweep") else f"{name}-sweep"


HEARTBEAT_S = 10  # a running trial's worker writes a heartbeat this often (seconds)
GRACE_S = 60  # a running trial without a heartbeat for this long is failed and enqueued again
STORAGE_FILE = "optuna.db"


class StorageError(Exception):
    """The Optuna storage cannot be opened or used (the caller says where its URL came from)."""


def default_storage_url(tracking_uri: str, cwd: Path | None = None) -> str:
    """sqlite ``optuna.db`` beside a local MLflow store (an absolute URI), else in ``cwd``."""
    local = local_store_path(tracking_uri)
    folder = local[1].parent if local is not None else (cwd or Path.cwd()).resolve()
    return f"sqlite:///{folder / STORAGE_FILE}"


def open_storage(url: str, *, heartbeat: bool = True, attempts: int = 5) -> RDBStorage:
    """Open (creating on first use) the Optuna RDB storage at ``url``; sqlite waits 60 s for a lock.

    Workers creating a new storage's tables at once race, and the loser tries again (``attempts``). ``heartbeat`` fails
    trials whose worker went silent. Raises StorageError: malformed URL, driver missing, or refused.
    """
    import optuna
    from optuna.storages import RDBStorage, RetryHeartbeatStaleTrialCallback

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)  # heartbeats, retries
    engine_kwargs: dict[str, Any] = {"connect_args": {"timeout": 60}} if url.startswith("sqlite") else {}
    beat: dict[str, Any] = {}
    if heartbeat:
        beat = {
            "heartbeat_interval": HEARTBEAT_S,
            "grace_period": GRACE_S,
            "heartbeat_stale_trial_callback": RetryHeartbeatStaleTrialCallback(),
        }
    for attempt in range(attempts):
        try:
            return RDBStorage(url, engine_kwargs=engine_kwargs, **beat)
        except Exception as exc:
            racing = any(word in str(exc).lower() for word in ("already exists", "unique", "duplicate"))
            if racing and attempt + 1 < attempts:
                time.sleep(0.2 * (attempt + 1))
                continue
            raise StorageError(f"cannot open Optuna storage {url}: {type(exc).__name__}: {exc}") from None
    raise StorageError(f"cannot open Optuna storage {url}")  # pragma: no cover


def make_sampler(definition: SweepDefinition, trial_number: int | None = None) -> BaseSampler:
    """Optuna's grid, random or TPE sampler, seeded from ``definition.seed`` and ``trial_number`` so a trial draws
    the same values in any worker."""
    from optuna.samplers import GridSampler, RandomSampler, TPESampler

    seed = definition.seed
    if trial_number is not None:
        seed = int(hashlib.sha256(f"{seed}:{trial_number}".encode()).hexdigest()[:8], 16)
    if definition.method == "grid":

        class EnqueuedGrid(GridSampler):
            """GridSampler whose end-of-trial bookkeeping skips enqueued points, as every grid trial is: they carry no
            ``grid_id``, which Optuna's ``after_trial`` read at the end of a one-point grid (``KeyError``)."""

            def after_trial(self, study: Any, trial: Any, state: Any, values: Any) -> None:
                if "grid_id" in trial.system_attrs:
                    super().after_trial(study, trial, state, values)

        return EnqueuedGrid(definition.search_space(), seed=definition.seed)
    if definition.method == "random":
        return RandomSampler(seed=seed)
    return TPESampler(seed=seed)


def make_pruner(definition: SweepDefinition) -> BasePruner:
    """Optuna's NopPruner, MedianPruner or HyperbandPruner for ``definition.pruner``; steps are epochs."""
    from optuna.pruners import HyperbandPruner, MedianPruner, NopPruner

    if definition.pruner == "median":
        return MedianPruner(
            n_startup_trials=definition.pruner_startup_trials, n_warmup_steps=definition.pruner_warmup_epochs
        )
    if definition.pruner == "hyperband":
        return HyperbandPruner(min_resource=max(1, definition.pruner_warmup_epochs))
    return NopPruner()

"""The MLflow side of a sweep: parent run, child runs, resume records, best trial.

Uses :class:`mlflow.tracking.MlflowClient` only; mlflow is imported inside functions.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runner.errors import TrackingError, UsageError
from runner.tools.sweep_space import SweepDefinition, SweepReport, Trial, TrialResult


@dataclass(frozen=True)
class SweepParent:
    """A sweep's parent run as recorded."""

    run_id: str
    definition: SweepDefinition
    overrides: list[str]
    spec_sha256: str | None


class SweepStore:
    """The sweep's MLflow side: parent run, children, best trial. Uses MlflowClient only."""

    def __init__(self, uri: str, experiment: str):
        self.uri, self.experiment = uri, experiment
        self._client: Any = None

    @property
    def client(self) -> Any:
        """The MlflowClient, made on first use (nothing touches the store before trials validate)."""
        if self._client is None:
            from mlflow.tracking import MlflowClient

            self._client = MlflowClient(tracking_uri=self.uri)
        return self._client

    @classmethod
    def for_spec(cls, spec: Any) -> SweepStore:
        from runner.tracking.runs import resolve_tracking_uri

        return cls(resolve_tracking_uri(spec), spec.tracking.experiment or spec.name)

    def check(self) -> None:
        """Raise TrackingError when the store cannot be used."""
        from runner.tracking.runs import check_reachable

        check_reachable(self.uri)

    def experiment_id(self) -> str:
        from mlflow.exceptions import MlflowException

        exp = self.client.get_experiment_by_name(self.experiment)
        if exp is None:
            try:
                return self.client.create_experiment(self.experiment)
            except MlflowException:
                exp = self.client.get_experiment_by_name(self.experiment)  # created meanwhile by another process
                if exp is None:
                    raise
        if exp.lifecycle_stage == "deleted":
            raise TrackingError(
                f"MLflow experiment {self.experiment!r} at {self.uri} is deleted: restore it or use another name"
            )
        return exp.experiment_id

    def create_parent(
        self, base: Any, overrides: Sequence[str], definition: SweepDefinition, trials: Sequence[Trial]
    ) -> str:
        from mlflow.entities import Param
        from mlflow.utils.validation import MAX_TAG_VAL_LENGTH

        spec = base.spec
        recorded = json.dumps(definition.to_json(), default=str)
        tags = {
            "runner.sweep": "parent",
            "runner.sweep.overrides": json.dumps(list(overrides)),
            "runner.spec.path": str(base.path),
            "runner.spec.sha256": base.sha256,
            "mlflow.source.name": str(base.path),
            "mlflow.source.type": "LOCAL",
        }
        if len(recorded) <= MAX_TAG_VAL_LENGTH:
            tags["runner.sweep.definition"] = recorded
        params = {
            "sweep.method": definition.method,
            "sweep.seed": str(definition.seed),
            "sweep.metric": definition.metric,
            "sweep.goal": definition.goal,
            "sweep.num_trials": str(len(trials)),
        }
        params.update({mlflow_key(f"sweep.params.{k}"): definition.describe(k)[:6000] for k, _ in definition.params})
        try:
            run = self.client.create_run(self.experiment_id(), tags=tags, run_name=f"{spec.name}-sweep")
        except Exception as exc:
            raise TrackingError(f"could not create the sweep's parent run at {self.uri}: {exc}") from exc
        run_id = run.info.run_id
        try:
            self.client.log_batch(run_id, params=[Param(k, v) for k, v in params.items()], synchronous=True)
            sweep_json = {
                "spec": str(base.path),
                "overrides": list(overrides),
                "definition": definition.to_json(),
                "trials": [{"index": t.index, "values": t.values, "overrides": t.overrides()} for t in trials],
            }
            self.client.log_text(run_id, json.dumps(sweep_json, indent=2, default=str) + "\n", "sweep.json")
            self.client.log_text(run_id, base.source_text, f"spec/{base.path.name}")
        except Exception as exc:
            self.client.set_terminated(run_id, "FAILED")
            raise TrackingError(f"could not record sweep {run_id} at {self.uri}: {exc}") from exc
        return run_id

    def sweep_parent(self, run_id: str) -> SweepParent:
        """Read an earlier sweep's parent run (``--resume``)."""
        from mlflow.exceptions import MlflowException

        try:
            run = self.client.get_run(run_id)
        except MlflowException:
            raise UsageError(
                f"--resume {run_id}: no such run at {self.uri} (copy the parent run id from the sweep's output)"
            ) from None
        tags = run.data.tags
        if tags.get("runner.sweep") != "parent":
            raise UsageError(
                f'--resume {run_id}: not the parent run of a sweep (tag runner.tools.sweep = "parent" missing)'
            )
        if run.info.experiment_id != self.experiment_id():
            raise UsageError(
                f"--resume {run_id}: the sweep belongs to another MLflow experiment than {self.experiment!r}"
            )
        try:
            if "runner.sweep.definition" in tags:
                recorded = json.loads(tags["runner.sweep.definition"])
            else:  # too long for a tag: read the artifact
                local = self.client.download_artifacts(run_id, "sweep.json")
                recorded = json.loads(Path(local).read_text(encoding="utf-8"))["definition"]
            definition = SweepDefinition.from_json(recorded)
        except (MlflowException, OSError, ValueError, KeyError) as exc:
            raise UsageError(f"--resume {run_id}: cannot read the sweep's recorded definition: {exc}") from None
        return SweepParent(
            run_id, definition, json.loads(tags.get("runner.sweep.overrides", "[]")), tags.get("runner.spec.sha256")
        )

    def children(self, parent_id: str) -> list[Any]:
        """Every child run of ``parent_id``, oldest first."""
        runs, token = [], None
        while True:
            page = self.client.search_runs(
                [self.experiment_id()],
                filter_string=f"tags.mlflow.parentRunId = '{parent_id}'",
                order_by=["attributes.start_time ASC"],
                page_token=token,
            )
            runs += list(page)
            token = page.token
            if not token:
                return runs

    def finished_trials(self, parent_id: str, trials: Sequence[Trial], metric: str) -> dict[int, TrialResult]:
        """Trials with a FINISHED child run of the same index and values."""
        found: dict[int, TrialResult] = {}
        by_index = {t.index: t for t in trials}
        for run in self.children(parent_id):
            trial = by_index.get(_int(run.data.tags.get("runner.sweep.trial")))
            if trial is None or run.info.status != "FINISHED" or _values(run) != trial.values:
                continue
            found[trial.index] = TrialResult(
                trial.index, trial.values, run.info.run_id, "FINISHED", run.data.metrics.get(metric), reused=True
            )
        return found

    def fill_run_ids(self, parent_id: str, results: Sequence[TrialResult], since_ms: int) -> None:
        """Fill in the run of trials that failed without reporting it (children started since ``since_ms``).

        A child that a dead trial process left RUNNING is ended FAILED.
        """
        from runner.tracking.runs import end_run

        missing = {r.index: r for r in results if r.run_id is None}
        if not missing:
            return
        for run in self.children(parent_id):
            result = missing.get(_int(run.data.tags.get("runner.sweep.trial")))
            if result is None or run.info.start_time < since_ms or _values(run) != result.values:
                continue
            result.run_id = run.info.run_id  # the newest matching child wins (oldest first)
            if run.info.status == "RUNNING":
                end_run(self.uri, run.info.run_id, "FAILED", result.error or "the trial process died")

    def reopen(self, run_id: str) -> None:
        self.client.update_run(run_id, status="RUNNING")

    def end(self, run_id: str, status: str, error: str | None, report: SweepReport) -> None:
        """Record the best trial and the report on the parent run, then end it with ``status``."""
        from runner.tracking.runs import end_run

        best = report.best if report.trials else None
        if best is not None:
            self.client.log_metric(run_id, mlflow_key(f"best/{report.definition.metric}"), float(best.metric_value))  # type: ignore[arg-type]
            self.client.set_tag(run_id, "runner.sweep.best_run_id", best.run_id or "")
            self.client.set_tag(run_id, "runner.sweep.best_trial", str(best.index))
        self.client.set_tag(run_id, "runner.sweep.failed", str(report.failed))
        self.client.log_text(run_id, json.dumps(report.to_json(), indent=2, default=str) + "\n", "sweep_report.json")
        end_run(self.uri, run_id, status, error)

    def end_quietly(self, run_id: str, status: str, error: str | None, report: SweepReport) -> None:
        """:meth:`end` while another error is on its way up: a tracking failure must not hide it."""
        try:
            self.end(run_id, status, error, report)
        except Exception as exc:
            print(f"runner: could not end sweep run {run_id} with status {status}: {exc}", file=sys.stderr, flush=True)


def mlflow_key(key: str) -> str:
    """Replace characters MLflow rejects in param, tag and metric names with ``_``."""
    return "".join(c if c.isalnum() or c in "_-./ :" else "_" for c in key)


def _values(run: Any) -> Any:
    try:
        return json.loads(run.data.tags.get("runner.sweep.values", "null"))
    except ValueError:
        return None


def _int(text: str | None) -> int | None:
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None

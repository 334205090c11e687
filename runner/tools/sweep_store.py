"""What a sweep records in MLflow: its parent run, the trials' child runs, the best trial and Optuna's plots.

The MLflow calls are :mod:`runner.tracking.parents` and :mod:`runner.tracking.runs`; this
module decides only the sweep's names, tags, params and texts.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from runner.tools.sweep_report import SweepReport
from runner.tools.sweep_space import SweepDefinition
from runner.tracking import parents
from runner.tracking.tags import source_tags
from runner.tracking.values import max_param_chars, max_tag_chars, safe_key

if TYPE_CHECKING:
    from runner.spec.loading import LoadedSpec
    from runner.spec.schema import ExperimentSpec

PRUNED_TAG = "runner.sweep.pruned"


class SweepStore:
    """The sweep's runs in one tracking store and experiment.

    Nothing touches the store before a method that needs it is called, so trials can be
    validated before anything is written.

    Args:
        uri: Tracking URI.
        experiment: Experiment name.
    """

    def __init__(self, uri: str, experiment: str):
        self.uri, self.experiment = uri, experiment

    @classmethod
    def for_spec(cls, spec: ExperimentSpec) -> SweepStore:
        """The store and experiment the spec's runs are recorded in."""
        from runner.tracking.uri import resolve_tracking_uri

        return cls(resolve_tracking_uri(spec), spec.tracking.experiment or spec.name)

    def check(self) -> None:
        """Raise TrackingError when the store cannot be used."""
        from runner.tracking.uri import check_reachable

        check_reachable(self.uri)

    def experiment_id(self) -> str:
        """Id of the sweep's experiment (created when missing)."""
        return parents.experiment_id(self.uri, self.experiment)

    def create_parent(
        self, base: LoadedSpec, overrides: Sequence[str], definition: SweepDefinition, study: str, storage: str
    ) -> str:
        """Create the parent run: the definition as params (and tag), the study, ``sweep.json`` and the spec file.

        Args:
            base: The base spec.
            overrides: Its ``--set`` strings.
            definition: What the sweep searches.
            study: The Optuna study name (tag ``runner.sweep.study``).
            storage: The storage URL without password (tag ``runner.sweep.storage``).
        """
        recorded = json.dumps(definition.to_json(), default=str)
        tags = {
            "runner.sweep": "parent",
            "runner.sweep.study": study,
            "runner.sweep.storage": storage,
            "runner.sweep.overrides": json.dumps(list(overrides)),
            "runner.sweep.unset": json.dumps(list(base.unset)),
            "runner.spec.path": str(base.path),
            "runner.spec.sha256": base.sha256,
            **source_tags(str(base.path)),
        }
        if len(recorded) <= max_tag_chars():
            tags["runner.sweep.definition"] = recorded
        params = {
            "sweep.method": definition.method,
            "sweep.seed": str(definition.seed),
            "sweep.metric": definition.metric,
            "sweep.goal": definition.goal,
            "sweep.trials": str(definition.trials),
            "sweep.pruner": definition.pruner,
        }
        limit = max_param_chars()
        params.update({safe_key(f"sweep.params.{k}"): definition.describe(k)[:limit] for k, _ in definition.params})
        sweep_json = {
            "spec": str(base.path),
            "overrides": list(overrides),
            "unset": list(base.unset),
            "study": study,
            "storage": storage,
            "definition": definition.to_json(),
        }
        texts = {
            "sweep.json": json.dumps(sweep_json, indent=2, default=str) + "\n",
            f"spec/{base.path.name}": base.source_text,
        }
        return parents.create_parent_run(
            self.uri,
            self.experiment,
            run_name=parent_run_name(base.spec.name),
            tags=tags,
            params=params,
            texts=texts,
            what="the sweep's parent run",
        )

    def delete(self, run_id: str) -> None:
        """Delete a parent run whose study could not be set up (no trial ever pointed at it)."""
        from runner.tracking.runs import delete_run

        delete_run(self.uri, run_id)

    def reopen(self, run_id: str) -> None:
        """Mark the parent RUNNING again when a worker joins a stopped sweep."""
        record = parents.find_run(self.uri, run_id)
        if record is not None and record.status != "RUNNING":
            parents.mark_running(self.uri, run_id)

    def trial_run(self, parent_id: str, number: int) -> str | None:
        """The child run of Optuna trial ``number`` (for a trial whose training raised), or ``None``."""
        runs = parents.child_runs(
            self.uri, self.experiment_id(), parent_id, tags={"runner.sweep.optuna_trial": str(number)}
        )
        return runs[-1].run_id if runs else None

    def kill_taken_over(self, parent_id: str, numbers: Sequence[int]) -> None:
        """End KILLED the runs of trials whose worker died (the trials run again under a new run)."""
        from runner.tracking.runs import end_run

        for number in numbers:
            runs = parents.child_runs(
                self.uri, self.experiment_id(), parent_id, tags={"runner.sweep.optuna_trial": str(number)}
            )
            for run in runs:
                if run.status == "RUNNING":
                    why = f"trial {number} was taken over by another worker: its worker stopped sending heartbeats"
                    end_run(self.uri, run.run_id, "KILLED", why)

    def mark_pruned(self, run_id: str, epoch: int) -> None:
        """Tag a trial's run as pruned after ``epoch`` (its status stays FINISHED; docs/design.md §16)."""
        parents.record_summary(self.uri, run_id, tags={PRUNED_TAG: "true", "runner.sweep.pruned_epoch": str(epoch)})

    def end(self, run_id: str, status: str, error: str | None, report: SweepReport, plots: Sequence[Path] = ()) -> None:
        """Record the best trial, the report and the plots on the parent run, then end it with ``status``."""
        from runner.tracking.runs import end_run

        best = report.best if report.trials else None
        metrics: dict[str, float] = {}
        tags = {"runner.sweep.failed": str(report.failed), "runner.sweep.pruned_trials": str(report.pruned)}
        if best is not None and best.metric_value is not None:
            metrics[safe_key(f"best/{report.definition.metric}")] = float(best.metric_value)
            tags["runner.sweep.best_run_id"] = best.run_id or ""
            tags["runner.sweep.best_trial"] = str(best.index)
        texts = {"sweep_report.json": json.dumps(report.to_json(), indent=2, default=str) + "\n"}
        parents.record_summary(
            self.uri, run_id, metrics=metrics, tags=tags, texts=texts, files=list(plots), files_dir="plots"
        )
        end_run(self.uri, run_id, status, error)

    def end_quietly(self, run_id: str, status: str, error: str | None, report: SweepReport) -> None:
        """:meth:`end` while another error is on its way up: a tracking failure must not hide it."""
        try:
            self.end(run_id, status, error, report)
        except Exception as exc:
            print(f"runner: could not end sweep run {run_id} with status {status}: {exc}", file=sys.stderr, flush=True)


def parent_run_name(name: str) -> str:
    """The sweep's parent run name: the spec name with ``-sweep`` appended, unless it already ends with it."""
    return name if name.endswith("-sweep") else f"{name}-sweep"

"""What a sweep records: its parent run, the trials' child runs, resume records and the best trial.

The MLflow calls are :mod:`runner.tracking.parents` and :mod:`runner.tracking.runs`; this
module decides only the sweep's names, tags, params and texts.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from runner.errors import TrackingError, UsageError
from runner.tools.sweep_report import SweepReport
from runner.tools.sweep_space import SweepDefinition, Trial, TrialResult
from runner.tracking import parents
from runner.tracking.tags import source_tags
from runner.tracking.values import max_param_chars, max_tag_chars, safe_key

if TYPE_CHECKING:
    from runner.spec.loading import LoadedSpec
    from runner.spec.schema import ExperimentSpec
    from runner.tracking.parents import RunRecord


@dataclass(frozen=True)
class SweepParent:
    """A sweep's parent run as recorded."""

    run_id: str
    definition: SweepDefinition
    overrides: list[str]
    spec_sha256: str | None


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
        self, base: LoadedSpec, overrides: Sequence[str], definition: SweepDefinition, trials: Sequence[Trial]
    ) -> str:
        """Create the parent run: definition as params (and tag), ``sweep.json`` and the spec file as artifacts."""
        recorded = json.dumps(definition.to_json(), default=str)
        tags = {
            "runner.sweep": "parent",
            "runner.sweep.overrides": json.dumps(list(overrides)),
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
            "sweep.num_trials": str(len(trials)),
        }
        limit = max_param_chars()
        params.update({safe_key(f"sweep.params.{k}"): definition.describe(k)[:limit] for k, _ in definition.params})
        sweep_json = {
            "spec": str(base.path),
            "overrides": list(overrides),
            "definition": definition.to_json(),
            "trials": [{"index": t.index, "values": t.values, "overrides": t.overrides()} for t in trials],
        }
        texts = {
            "sweep.json": json.dumps(sweep_json, indent=2, default=str) + "\n",
            f"spec/{base.path.name}": base.source_text,
        }
        return parents.create_parent_run(
            self.uri,
            self.experiment,
            run_name=f"{base.spec.name}-sweep",
            tags=tags,
            params=params,
            texts=texts,
            what="the sweep's parent run",
        )

    def sweep_parent(self, run_id: str) -> SweepParent:
        """Read an earlier sweep's parent run (``--resume``).

        Raises:
            UsageError: No such run, not a sweep's parent, another experiment's, or its
                recorded definition cannot be read.
        """
        run = parents.find_run(self.uri, run_id)
        if run is None:
            raise UsageError(
                f"--resume {run_id}: no such run at {self.uri} (copy the parent run id from the sweep's output)"
            )
        tags = run.tags
        if tags.get("runner.sweep") != "parent":
            raise UsageError(
                f'--resume {run_id}: not the parent run of a sweep (tag runner.tools.sweep = "parent" missing)'
            )
        if run.experiment_id != self.experiment_id():
            raise UsageError(
                f"--resume {run_id}: the sweep belongs to another MLflow experiment than {self.experiment!r}"
            )
        try:
            if "runner.sweep.definition" in tags:
                recorded = json.loads(tags["runner.sweep.definition"])
            else:  # too long for a tag: read the artifact
                recorded = json.loads(parents.read_text_artifact(self.uri, run_id, "sweep.json"))["definition"]
            definition = SweepDefinition.from_json(recorded)
        except (TrackingError, ValueError, KeyError) as exc:
            raise UsageError(f"--resume {run_id}: cannot read the sweep's recorded definition: {exc}") from None
        return SweepParent(
            run_id, definition, json.loads(tags.get("runner.sweep.overrides", "[]")), tags.get("runner.spec.sha256")
        )

    def children(self, parent_id: str) -> list[RunRecord]:
        """Every child run of ``parent_id``, oldest first."""
        return parents.child_runs(self.uri, self.experiment_id(), parent_id)

    def finished_trials(self, parent_id: str, trials: Sequence[Trial], metric: str) -> dict[int, TrialResult]:
        """Trials with a FINISHED child run of the same index and values."""
        found: dict[int, TrialResult] = {}
        by_index = {t.index: t for t in trials}
        for run in self.children(parent_id):
            index = _trial_index(run)
            trial = None if index is None else by_index.get(index)
            if trial is None or run.status != "FINISHED" or _values(run) != trial.values:
                continue
            found[trial.index] = TrialResult(
                trial.index, trial.values, run.run_id, "FINISHED", run.metrics.get(metric), reused=True
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
            index = _trial_index(run)
            result = None if index is None else missing.get(index)
            if result is None or run.start_time_ms < since_ms or _values(run) != result.values:
                continue
            result.run_id = run.run_id  # the newest matching child wins (oldest first)
            if run.status == "RUNNING":
                end_run(self.uri, run.run_id, "FAILED", result.error or "the trial process died")

    def reopen(self, run_id: str) -> None:
        """Mark the parent RUNNING again for a resumed sweep."""
        parents.mark_running(self.uri, run_id)

    def end(self, run_id: str, status: str, error: str | None, report: SweepReport) -> None:
        """Record the best trial and the report on the parent run, then end it with ``status``."""
        from runner.tracking.runs import end_run

        best = report.best if report.trials else None
        metrics: dict[str, float] = {}
        tags = {"runner.sweep.failed": str(report.failed)}
        if best is not None and best.metric_value is not None:
            metrics[safe_key(f"best/{report.definition.metric}")] = float(best.metric_value)
            tags["runner.sweep.best_run_id"] = best.run_id or ""
            tags["runner.sweep.best_trial"] = str(best.index)
        texts = {"sweep_report.json": json.dumps(report.to_json(), indent=2, default=str) + "\n"}
        parents.record_summary(self.uri, run_id, metrics=metrics, tags=tags, texts=texts)
        end_run(self.uri, run_id, status, error)

    def end_quietly(self, run_id: str, status: str, error: str | None, report: SweepReport) -> None:
        """:meth:`end` while another error is on its way up: a tracking failure must not hide it."""
        try:
            self.end(run_id, status, error, report)
        except Exception as exc:
            print(f"runner: could not end sweep run {run_id} with status {status}: {exc}", file=sys.stderr, flush=True)


def _values(run: RunRecord) -> object:
    """The trial values recorded on a child run (``None`` when unreadable)."""
    try:
        return json.loads(run.tags.get("runner.sweep.values", "null"))
    except ValueError:
        return None


def _trial_index(run: RunRecord) -> int | None:
    """The trial index recorded on a child run (``None`` when missing or unreadable)."""
    try:
        return int(run.tags["runner.sweep.trial"])
    except (KeyError, ValueError):
        return None

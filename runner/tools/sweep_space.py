"""What a sweep searches and what it records: the definition, its Optuna search space, the trials, their results,
and the sweep's runs in MLflow (parent, children, best trial, plots).

The definition (built by ``runner.tools.sweep_trials``) says which Optuna sampler and pruner
search which keys, how many trials there are in total and which metric ranks them
(docs/design.md §16): it is the spec's ``[sweep]`` table (``SweepSpec``) with the command line merged in and
the trial budget known, so it validates, and reads back from the study, as that table does. ``SweepDefinition.suggest``
turns an Optuna trial into the values of
one ``Trial``; nothing here opens a study. ``SweepStore`` records the sweep in MLflow through
``runner.tracking.runs``, deciding only the sweep's names, tags, params and texts.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import math
import tomllib
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import Field

from runner.errors import first_line, toml_value
from runner.spec.dump import trial_run_name
from runner.spec.schema import SweepSpec
from runner.tracking import runs
from runner.tracking.runs import RunRecord
from runner.tracking.stored import search_runs
from runner.tracking.tags import max_param_chars, max_tag_chars, safe_key
from runner.tracking.uri import ui_line

if TYPE_CHECKING:
    import optuna
    from optuna.trial import FrozenTrial

    from runner.spec.loading import LoadedSpec


_PRIMITIVE = (str, int, float, bool, type(None))


class SweepDefinition(SweepSpec):
    """What a sweep searches: the spec's ``[sweep]`` merged with the command line, its trial budget known. Where it
    runs (``storage``, ``study``) is no part of it: left out of its JSON and digest."""

    trials: int = Field(ge=1)

    def describe(self, key: str) -> str:
        """Return the definition of one swept key, e.g. ``[0.1, 0.01]`` or ``log_uniform(1e-05, 0.01)``."""
        param = self.params[key]
        if param.values is not None:
            return json.dumps(param.values, default=str)
        return f"{param.distribution}({param.low!r}, {param.high!r})"

    def to_json(self) -> dict[str, Any]:
        """JSON-able form; ``model_validate`` reads it back (pydantic's ValidationError, a ValueError, otherwise)."""
        return self.model_dump(mode="json", exclude={"storage", "study"}, exclude_none=True)

    def digest(self) -> str:
        """Hex SHA-256 of :meth:`to_json`: two definitions search the same trials iff their digests match."""
        return hashlib.sha256(json.dumps(self.to_json(), sort_keys=True, default=str).encode()).hexdigest()

    def grid_points(self) -> list[dict[str, Any]]:
        """The first :attr:`trials` points of the grid: the cartesian product in key order, the last key fastest."""
        keys = list(self.params)
        product = itertools.product(*(p.values or [] for p in self.params.values()))
        return [dict(zip(keys, point, strict=True)) for point in itertools.islice(product, self.trials)]

    def search_space(self) -> dict[str, list[Any]]:
        """Optuna's view of the grid: dotted key -> the choices as Optuna stores them (see :func:`encode_choices`)."""
        return {k: encode_choices(p.values or []) for k, p in self.params.items()}

    def suggest(self, trial: optuna.Trial) -> dict[str, Any]:
        """One trial's values asked of Optuna key by key: explicit values categorical (lists and tables as TOML
        text), ranges float, ``int_uniform`` int over ``[ceil(low), floor(high)]``."""
        values: dict[str, Any] = {}
        for key, param in self.params.items():
            if param.values is not None:
                choices = encode_choices(param.values)
                values[key] = decode_choice(param.values, trial.suggest_categorical(key, choices))
            elif param.distribution == "int_uniform":
                values[key] = trial.suggest_int(key, math.ceil(param.low or 0), math.floor(param.high or 0))
            else:
                log = param.distribution == "log_uniform"
                values[key] = trial.suggest_float(key, float(param.low or 0), float(param.high or 0), log=log)
        return values


@dataclass(frozen=True)
class Trial:
    """One point of a sweep: its number in the study (kept when run again) and its values in key order."""

    index: int
    values: dict[str, Any]

    def overrides(self) -> list[str]:
        """The ``--set`` strings that make the base spec this trial, e.g. ``["optim.lr=0.1"]``."""
        return [f"{key}={toml_value(value)}" for key, value in self.values.items()]

    def run_name(self) -> str:
        """The MLflow run name: the values, e.g. ``lr=0.1 seed=0`` (:func:`runner.spec.dump.trial_run_name`)."""
        return trial_run_name(self.values)

    def label(self) -> str:
        """Short text for messages: ``trial 3 (optim.lr=0.01, seed=2)``; ``values (...)`` for a check's point (-1)."""
        inner = ", ".join(f"{k}={toml_value(v)}" for k, v in self.values.items())
        return f"trial {self.index} ({inner})" if self.index >= 0 else f"values ({inner})"


@dataclass
class TrialResult:
    """Outcome of one trial: its run (``None`` when it failed first), status, the metric's last value, the error,
    whether it was ``reused`` from an earlier run, and whether and after which epoch it was pruned."""

    index: int
    values: dict[str, Any]
    run_id: str | None
    status: str
    metric_value: float | None = None
    error: str | None = None
    reused: bool = False
    pruned: bool = False
    pruned_epoch: int | None = None


def encode_choices(values: Sequence[Any]) -> list[Any]:
    """Optuna's categorical choices for explicit values: as they are, or all as TOML text when one is a list or
    table."""
    if all(isinstance(v, _PRIMITIVE) for v in values):
        return list(values)
    return [toml_value(v) for v in values]


def decode_choice(values: Sequence[Any], choice: Any) -> Any:
    """The value a choice of :func:`encode_choices` stands for."""
    if all(isinstance(v, _PRIMITIVE) for v in values):
        return choice
    return tomllib.loads(f"v = {choice}")["v"]


def study_name(spec_name: str, trial_spec_sha256: str, definition: SweepDefinition) -> str:
    """``<spec name>-<12 hex>`` from the trial spec and the definition, so workers with the same flags join one
    study."""
    digest = hashlib.sha256(f"{trial_spec_sha256}\n{definition.digest()}".encode()).hexdigest()
    return f"{spec_name}-{digest[:12]}"


PLOTS = ("optimization_history.png", "param_importances.png")


@dataclass
class SweepReport:
    """Outcome of a sweep: the definition, one result per trial, the Optuna storage URL (masked by the sinks)."""

    definition: SweepDefinition
    trials: list[TrialResult]
    parent_run_id: str
    tracking_uri: str
    experiment: str
    notes: list[str] = field(default_factory=list)
    study: str = ""
    storage: str = ""
    experiment_id: str = ""

    @property
    def failed(self) -> int:
        """Number of trials that ended and did not finish (trials still running elsewhere do not count)."""
        return sum(t.status not in ("FINISHED", "RUNNING", "WAITING") for t in self.trials)

    @property
    def pruned(self) -> int:
        """Number of trials the pruner stopped early."""
        return sum(t.pruned for t in self.trials)

    @property
    def best(self) -> TrialResult | None:
        """The finished trial with the best metric (lowest index on ties), or ``None``."""
        ranked = [
            t
            for t in self.trials
            if t.status == "FINISHED" and t.metric_value is not None and not math.isnan(t.metric_value)
        ]
        if not ranked:
            return None
        sign = -1.0 if self.definition.goal == "max" else 1.0
        return min(ranked, key=lambda t: (sign * float(t.metric_value), t.index))  # type: ignore[arg-type]

    def table(self) -> str:
        """Terminal table: trial, swept values, metric, status; the best trial marked ``*``."""
        d = self.definition
        keys = list(d.params)
        best = self.best
        header = ["trial", *keys, d.metric, "status"]
        rows = []
        for t in self.trials:
            mark = "*" if best is not None and t.index == best.index else ""
            status = t.status + (f" (pruned after epoch {t.pruned_epoch})" if t.pruned else "")
            status += " (earlier run)" if t.reused else ""
            metric = "-" if t.metric_value is None else f"{t.metric_value:.6g}"
            rows.append([f"{t.index}{mark}", *(_show(t.values.get(k)) for k in keys), metric, status])
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
        lines = [
            f"sweep {self.parent_run_id} (experiment {self.experiment!r}, study {self.study!r}): {d.method}, "
            f"{len(self.trials)} trials, {d.metric} ({d.goal}), pruner {d.pruner}",
            "  ".join(h.ljust(w) for h, w in zip(header, widths, strict=False)).rstrip(),
        ]
        lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=False)).rstrip() for r in rows]
        if best is not None:
            lines.append(f"* best: trial {best.index}, {d.metric} = {best.metric_value:.6g} (run {best.run_id})")
        else:
            lines.append(f"no finished trial logged {d.metric}")
        for t in self.trials:
            if t.status != "FINISHED" and t.error:
                lines.append(f"trial {t.index} {t.status}: {first_line(t.error)}")
        lines += [f"note: {n}" for n in self.notes]
        if self.experiment_id:
            lines.append(ui_line(self.tracking_uri, self.experiment_id, what="the trials (tick them, then Compare)"))
        else:
            lines.append(f"compare the trials: mlflow ui --backend-store-uri {self.tracking_uri}")
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        """JSON-able summary (``runner sweep --json``; artifact ``sweep_report.json`` of the parent)."""
        best, plain = self.best, dataclasses.asdict(self)  # the trials as dicts, copies of the lists
        totals = {"failed": self.failed, "pruned": self.pruned, "best": best and dataclasses.asdict(best)}
        return {**plain, "definition": self.definition.to_json(), **totals}


def _show(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    return "-" if value is None else (value if isinstance(value, str) else toml_value(value))


def write_plots(trials: Sequence[FrozenTrial], goal: str, folder: Path) -> tuple[list[Path], list[str]]:
    """Optuna's history and importance plots as PNGs; ``(files, notes)`` with a note for each it cannot draw."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import optuna
    from optuna.visualization import matplotlib as plots

    study = optuna.create_study(direction="maximize" if goal == "max" else "minimize")
    study.add_trials([t for t in trials if t.state.is_finished()])
    files = []
    notes = []
    drawers: tuple[Callable[[optuna.Study], Any], ...] = (plots.plot_optimization_history, plots.plot_param_importances)
    for name, draw in zip(PLOTS, drawers, strict=True):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # Optuna marks its matplotlib plots experimental
                axes = draw(study)
            figure = axes.figure if hasattr(axes, "figure") else plt.gcf()
            figure.savefig(folder / name, dpi=100, bbox_inches="tight")
            files.append(folder / name)
        except Exception as exc:
            notes.append(f"no {name}: {type(exc).__name__}: {first_line(str(exc))}")
        finally:
            plt.close("all")
    return files, notes


PRUNED_TAG = "runner.sweep.pruned"


class SweepStore:
    """The sweep's runs in one store and experiment; nothing touches the store before a method needs it."""

    def __init__(self, uri: str, experiment: str):
        self.uri = uri
        self.experiment = experiment

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
        parent = runs.TrackedRun(self.uri, run.run_id)
        try:
            parent.log(params=params, texts=texts)
        except BaseException:
            parent.delete()
            raise
        return run.run_id

    def reopen(self, run_id: str) -> None:
        """Mark the parent RUNNING again when a worker joins a stopped sweep."""
        parent = runs.TrackedRun(self.uri, run_id)
        record = parent.find()
        if record is not None and record.status != "RUNNING":
            parent.reopen(resumed=False)

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
                    runs.TrackedRun(self.uri, run.run_id).end("KILLED", why)

    def mark_pruned(self, run_id: str, epoch: int) -> None:
        """Tag a trial's run as pruned after ``epoch`` (its status stays FINISHED; docs/design.md §16)."""
        runs.TrackedRun(self.uri, run_id).log(tags={PRUNED_TAG: "true", "runner.sweep.pruned_epoch": str(epoch)})

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
        parent = runs.TrackedRun(self.uri, run_id)
        parent.log(metrics=metrics, tags=tags, texts=texts, files=list(plots), files_dir="plots")
        parent.end(status, error)


def parent_run_name(name: str) -> str:
    """The sweep's parent run name: the spec name with ``-sweep`` appended, unless it already ends with it."""
    return name if name.endswith("-sweep") else f"{name}-sweep"

"""The outcome of a sweep: one result per trial, the best trial, a terminal table, a JSON summary and Optuna's plots."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from runner.tools.sweep_space import SweepDefinition, TrialResult, toml_value

if TYPE_CHECKING:
    from optuna.trial import FrozenTrial

PLOTS = ("optimization_history.png", "param_importances.png")


@dataclass
class SweepReport:
    """Outcome of a sweep.

    Attributes:
        definition: What was swept (method, keys, budget, seed, metric, goal).
        trials: One result per trial, by index.
        storage: The Optuna storage URL (without password).
    """

    definition: SweepDefinition
    trials: list[TrialResult]
    parent_run_id: str
    tracking_uri: str
    experiment: str
    notes: list[str] = field(default_factory=list)
    study: str = ""
    storage: str = ""

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
        keys = [k for k, _ in d.params]
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
        lines.append(f"compare the trials: mlflow ui --backend-store-uri {self.tracking_uri}")
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        """JSON-able summary (``runner sweep --json``; artifact ``sweep_report.json`` of the parent)."""
        best = self.best
        return {
            "parent_run_id": self.parent_run_id,
            "tracking_uri": self.tracking_uri,
            "experiment": self.experiment,
            "study": self.study,
            "storage": self.storage,
            "definition": self.definition.to_json(),
            "failed": self.failed,
            "pruned": self.pruned,
            "best": None if best is None else best.to_json(),
            "trials": [t.to_json() for t in self.trials],
            "notes": list(self.notes),
        }


def _show(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    return "-" if value is None else (value if isinstance(value, str) else toml_value(value))


def first_line(text: str) -> str:
    """One line of an error: its first, or the last of a dead process's output (where the error is)."""
    lines = [line for line in text.strip().splitlines() if line.strip()]
    if not lines:
        return ""
    return lines[-1] if lines[0].startswith("trial process exited") else lines[0]


def write_plots(trials: Sequence[FrozenTrial], goal: str, folder: Path) -> tuple[list[Path], list[str]]:
    """Optuna's optimization-history and parameter-importance plots as PNG files (``optuna.visualization.matplotlib``).

    Args:
        goal: ``"max"`` or ``"min"``.

    Returns:
        ``(files written, notes)``: a plot Optuna cannot draw (e.g. importances with fewer than
        two finished trials) is left out with a note.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import optuna
    from optuna.visualization import matplotlib as plots

    study = optuna.create_study(direction="maximize" if goal == "max" else "minimize")
    study.add_trials([t for t in trials if t.state.is_finished()])
    files, notes = [], []
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

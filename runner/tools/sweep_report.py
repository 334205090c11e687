"""The outcome of a sweep: one result per trial, the best trial, a terminal table and a JSON summary."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from runner.tools.sweep_space import SweepDefinition, TrialResult, toml_value


@dataclass
class SweepReport:
    """Outcome of a sweep.

    Attributes:
        definition: What was swept (method, keys, budget, seed, metric, goal).
        trials: One result per trial, by index.
        parent_run_id: The parent MLflow run.
        tracking_uri: Where the runs are stored.
        experiment: MLflow experiment name.
        notes: Things worth telling the user.
    """

    definition: SweepDefinition
    trials: list[TrialResult]
    parent_run_id: str
    tracking_uri: str
    experiment: str
    notes: list[str] = field(default_factory=list)

    @property
    def failed(self) -> int:
        """Number of trials that did not finish."""
        return sum(t.status != "FINISHED" for t in self.trials)

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
            status = t.status + (" (earlier run)" if t.reused else "")
            metric = "-" if t.metric_value is None else f"{t.metric_value:.6g}"
            rows.append([f"{t.index}{mark}", *(_show(t.values.get(k)) for k in keys), metric, status])
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
        lines = [
            f"sweep {self.parent_run_id} (experiment {self.experiment!r}): {d.method}, {len(self.trials)} trials, "
            f"{d.metric} ({d.goal})",
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
            "definition": self.definition.to_json(),
            "failed": self.failed,
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

"""Watching a metric across evaluations: when a value improves on the best, and early stopping's patience.

A watched value is one of an epoch's metrics, reduced over the ranks before it is logged, so it is the same on every
rank and every rank decides alike without a collective. What the watching remembers is plain numbers, in the loop's
state and in each checkpoint's ``meta.pt``, so a resumed run decides as the uninterrupted one would have.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from runner.spec.schema_loop import EarlyStoppingSpec


def improves(value: float, best: float | None, goal: str, min_delta: float = 0.0) -> bool:
    """Whether ``value`` beats ``best`` by more than ``min_delta`` in the direction of ``goal`` ("min" or "max"); a NaN
    never improves, anything improves on no best yet."""
    if math.isnan(value):
        return False
    if best is None:
        return True
    return value < best - min_delta if goal == "min" else value > best + min_delta


def early_stop(
    spec: EarlyStoppingSpec, metrics: dict[str, float], step: int, record: dict[str, float] | None
) -> tuple[dict[str, float] | None, str | None]:
    """Early stopping after an epoch's ``metrics`` logged at ``step``: the new record (the best value, its step, the
    evaluations since) and, when ``patience`` evaluations in a row did not improve, why training stops. An epoch that
    did not log the metric (no evaluation due) changes nothing."""
    value = metrics.get(spec.metric)
    if value is None:
        return record, None
    if record is None or improves(value, record["best"], spec.goal, spec.min_delta):
        return {"best": value, "step": step, "bad": 0}, None
    record = {**record, "bad": record["bad"] + 1}
    if record["bad"] < spec.patience:
        return record, None
    return record, (
        f"early stopping: {spec.metric} did not improve by more than {spec.min_delta:g} ({spec.goal}) for "
        f"{spec.patience} evaluation(s); best {record['best']:.6g} at step {int(record['step'])}"
    )

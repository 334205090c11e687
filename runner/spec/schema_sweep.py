"""The ``[sweep]`` table and its ``[sweep.params]`` entries: the trials ``runner sweep`` searches (docs/design.md §16).

Read by :mod:`runner.tools.sweep_define`; ``runner exec`` ignores the table.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from runner.spec import rules
from runner.spec.table import UINT32_LIMIT, SpecTable


class SweepParam(SpecTable):
    """One swept key in ``[sweep.params]``: explicit values or a numeric range."""

    values: list[Any] | None = Field(default=None, min_length=1, description="Explicit values to try.")
    low: float | None = Field(default=None, description="Lower bound of a sampled range (random and tpe).")
    high: float | None = Field(default=None, description="Upper bound of a sampled range (random and tpe).")
    distribution: Literal["uniform", "log_uniform", "int_uniform"] = Field(
        default="uniform", description="How a range is sampled. Default: uniform."
    )

    rule = rules.check_sweep_param


class SweepSpec(SpecTable):
    """``[sweep]``: many trials of one spec, searched by Optuna (see ``runner sweep``, docs/design.md §16)."""

    method: Literal["grid", "random", "tpe"] = Field(
        default="grid",
        description="Optuna sampler: grid (GridSampler, every combination), random (RandomSampler) or tpe "
        "(TPESampler). Default: grid.",
    )
    trials: int | None = Field(
        default=None,
        ge=1,
        description="Trials in total, over every worker (random and tpe: required; grid: at most the grid size). "
        "Default: the grid size.",
    )
    seed: int = Field(
        default=0,
        ge=0,
        lt=UINT32_LIMIT,
        description="Seed of the sampler; 0 <= seed < 2**32 (Optuna's samplers seed NumPy's RandomState). Default: 0.",
    )
    metric: str = Field(default="val/accuracy", description="Metric that ranks trials. Default: val/accuracy.")
    goal: Literal["max", "min"] = Field(
        default="max", description="Whether a larger or smaller metric is better. Default: max."
    )
    pruner: Literal["none", "median", "hyperband"] = Field(
        default="none",
        description="Stop poor trials early on the per-epoch metric: none, median (MedianPruner) or hyperband "
        "(HyperbandPruner). Default: none.",
    )
    pruner_startup_trials: int = Field(
        default=5, ge=0, description="median only: trials that finish before any is pruned. Default: 5."
    )
    pruner_warmup_epochs: int = Field(
        default=0, ge=0, description="Epochs every trial trains before it may be pruned. Default: 0."
    )
    storage: str | None = Field(
        default=None,
        description="Optuna storage URL of the study, shared by every worker, e.g. "
        "`postgresql+psycopg://user@host/db`. Default: sqlite `optuna.db` next to the MLflow store.",
    )
    study: str | None = Field(
        default=None,
        description="Optuna study name; workers with the same name and storage share one sweep. "
        "Default: the spec name and a hash of the trial spec and the sweep.",
    )
    params: dict[str, SweepParam] = Field(
        default_factory=dict,
        description='Dotted spec key -> values or range, e.g. `"optim.lr" = { values = [0.1, 0.01] }`.',
    )

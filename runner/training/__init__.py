"""What one rank does. :class:`WorkerResult` lives here, free of torch: it crosses to the driver.

The driver imports this package's light names (the result of a rank, the startup metric) without torch; every
module that needs torch is imported by the worker alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from runner.spec.schema import ExperimentSpec

STARTUP_METRIC = "time_to_first_step_s"
"""Seconds from the command's start (``ExecOptions.started_at``) to the end of the first optimizer step."""


def flops_uncounted(spec: ExperimentSpec, timed: bool) -> str | None:
    """Why a run's processes do not count a step's FLOPs (the reason its ``runner.mfu`` tag gives), or ``None`` when
    they do: dp's replicas run in threads a dispatch mode does not see, compiled kernels pass it by, and bench's
    ``timed`` steps run plain."""
    from runner.spec.schema_parallel import MODES

    if MODES[spec.parallel.mode].replicas:
        return "dp's replicas run in threads"
    return "train.compile" if spec.train.compile else "timed steps" if timed else None


@dataclass
class WorkerResult:
    """What a worker returns (the driver uses the logging rank's): steps, history, notes, each step's time and data
    wait, peak memory of the rank and of each GPU it drove (bytes), the device, ``stopped_after_epoch`` (a sweep's
    pruner), ``stop_reason`` and ``best``,
    :data:`STARTUP_METRIC` and one step's FLOPs (``None`` when not counted)."""

    rank: int
    metrics: dict[str, float] = field(default_factory=dict)
    global_step: int = 0
    history: list[tuple[int, dict[str, float]]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    step_times_s: list[float] = field(default_factory=list)
    data_wait_s: list[float] = field(default_factory=list)
    peak_memory_bytes: int = 0
    device: str = "cpu"
    device_peaks: list[int] = field(default_factory=list)
    stopped_after_epoch: int | None = None
    stop_reason: str | None = None  # why training ended before its last step (early stopping), when it did
    best: tuple[str, float, int] | None = None  # checkpoint.monitor's best checkpoint: (metric, value, step)
    startup_s: float | None = None
    step_flops: int | None = None

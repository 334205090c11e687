"""What one rank does. :class:`WorkerResult` lives here, free of torch: it crosses to the driver."""

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
    """What a worker returns (only the logging rank's is used by the driver).

    Attributes:
        global_step: Optimizer steps taken at the end.
        history: ``(step, metrics)`` pairs, for tests and ``runner bench``.
        resumed_from: Checkpoint file the run continued from, if any.
        notes: Things the user should know (e.g. damaged checkpoints skipped).
        step_times_s: Wall time of each optimizer step, seconds.
        data_wait_s: Seconds of each step spent waiting for data.
        peak_memory_bytes: Peak memory of this rank: CUDA allocator peak on its device, else
            the process's peak resident set size.
        device: The device this rank trained on, e.g. ``cuda:0`` or ``cpu``.
        device_peaks: CUDA allocator peak of each GPU this process drove, in the run's device order (dp's one
            process drives every GPU of the run; a ddp or fsdp rank its own), bytes; empty on CPU.
        stopped_after_epoch: The epoch after which ``epoch_end`` stopped training, or ``None``.
        startup_s: :data:`STARTUP_METRIC` of this rank, or ``None`` (no step, or no start time given).
        step_flops: FLOPs of one optimizer step of this process (its share of the global batch), or ``None``:
            not counted (dp, ``train.compile``, ``runner bench``).
    """

    rank: int
    metrics: dict[str, float] = field(default_factory=dict)
    global_step: int = 0
    history: list[tuple[int, dict[str, float]]] = field(default_factory=list)
    resumed_from: str | None = None
    notes: list[str] = field(default_factory=list)
    step_times_s: list[float] = field(default_factory=list)
    data_wait_s: list[float] = field(default_factory=list)
    peak_memory_bytes: int = 0
    device: str = "cpu"
    device_peaks: list[int] = field(default_factory=list)
    stopped_after_epoch: int | None = None
    startup_s: float | None = None
    step_flops: int | None = None

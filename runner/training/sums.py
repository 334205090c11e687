"""The loop's running tallies: loss, non-finite steps and samples on the device, and the train metrics beside them."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from runner.training.metrics import MetricSet

if TYPE_CHECKING:
    from runner.strategies.base import Strategy
    from runner.training.batches import Batch, BatchIO, ModelOutput
    from runner.training.metrics import MetricRecipe
    from runner.training.nonfinite import NonFiniteGuard
    from runner.training.state import MetricStates


class RunningSums:
    """Running sums ``[loss sum, non-finite steps, samples]`` kept on the device (float64); reduced on demand.

    The middle entry counts the optimizer steps whose loss or gradient norm was not finite
    (:mod:`runner.training.nonfinite`): it is reduced with the loss, so reading it costs nothing more.

    Args:
        device: Where the sums live (the strategy's ``output_device``).
        start: Rank-reduced sums restored from a checkpoint (rank 0 only).
    """

    def __init__(self, device: torch.device, start: list[float] | None = None):
        self.sums = torch.zeros(3, dtype=torch.float64, device=device)
        if start is not None:  # rank-reduced sums restored from a checkpoint, held by rank 0 only
            self.sums += torch.tensor(start[:3], dtype=torch.float64, device=device)

    def add(self, loss_sum: torch.Tensor, count: int) -> None:
        """Add one micro-batch: its summed loss (a scalar) and its sample count."""
        self.sums[0] += loss_sum.to(torch.float64)
        self.sums[2] += count

    def add_bad(self, bad: torch.Tensor | None) -> None:
        """Add one step's non-finite flag (``1.0`` or ``0.0`` on the device; ``None``: not checked)."""
        if bad is not None:
            self.sums[1] += bad

    def reduced_sums(self, strategy: Strategy) -> list[float]:
        """``[loss sum, non-finite steps, samples]`` summed over ranks (a collective)."""
        return strategy.all_reduce_sum(self.sums.clone()).tolist()

    def reduce(self, strategy: Strategy) -> tuple[float, float]:
        """``(mean loss, non-finite steps)`` over all ranks (a collective); the mean is ``nan`` without samples."""
        loss, bad, count = self.reduced_sums(strategy)
        return (loss / count if count else math.nan), bad


@dataclass
class Tally:
    """What the loop adds up: since the last ``train/loss`` log (across epochs) and over the epoch in progress.

    Attributes:
        window: Sums since the last log.
        window_metrics: Train metrics since the last log (``train/step_<name>``).
        epoch_metrics: Train metrics of the epoch (``train/<name>``).
        guard: Flags non-finite losses and gradient norms (``train.on_nonfinite``).
        epoch: Sums of the epoch in progress; ``None`` between epochs.
        epoch_samples: Global samples of this run's steps of the epoch.
    """

    window: RunningSums
    window_metrics: MetricSet
    epoch_metrics: MetricSet
    guard: NonFiniteGuard
    epoch: RunningSums | None = None
    epoch_samples: int = 0

    def start_epoch(self, sums: RunningSums) -> None:
        self.epoch = sums
        self.epoch_samples = 0

    @classmethod
    def start(
        cls,
        recipes: Sequence[MetricRecipe],
        guard: NonFiniteGuard,
        window_sums: list[float] | None,
        metric_states: MetricStates | None,
        *,
        held: bool,
    ) -> Tally:
        """Fresh sums and train metrics on the guard's device; the rank that ``held`` them restores their states."""
        device = guard.device
        tally = cls(
            RunningSums(device, window_sums if held else None),
            MetricSet(recipes, "train/step_", device),
            MetricSet(recipes, "train/", device),
            guard,
        )
        saved = (metric_states or {}) if held else {}
        tally.window_metrics.load_state(saved.get("window") or {})
        tally.epoch_metrics.load_state(saved.get("epoch") or {})
        return tally

    def add(self, loss_sum: torch.Tensor, batch: Batch, out: ModelOutput, io: BatchIO) -> None:
        """Add a micro-batch (its summed loss, samples, and the prediction in forward's ``out``) to window and epoch."""
        self.guard.observe_loss(loss_sum)
        self.window.add(loss_sum, batch.size)
        if self.epoch is not None:
            self.epoch.add(loss_sum, batch.size)
        if self.window_metrics:
            self.window_metrics.add(out, batch, io)
            self.epoch_metrics.add(out, batch, io)

    def end_step(self, grad_norm: torch.Tensor | None) -> None:
        """Close an optimizer step: its non-finite flag goes into the window's and the epoch's sums."""
        bad = self.guard.end_step(grad_norm)
        self.window.add_bad(bad)
        if self.epoch is not None:
            self.epoch.add_bad(bad)

    def metric_states(self) -> MetricStates:
        """The train metrics' states, summed over ranks (a collective): ``{"window": ..., "epoch": ...}``."""
        epoch = self.epoch_metrics.state() if self.epoch is not None else None
        return {"window": self.window_metrics.state(), "epoch": epoch}

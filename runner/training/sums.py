"""The loop's running tallies: loss, non-finite steps and samples on the device, and the train metrics beside them."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from runner.training.metrics import MetricPlan, MetricSet

if TYPE_CHECKING:
    from runner.strategies.base import Strategy
    from runner.training.batches import Batch, BatchIO, ModelOutput
    from runner.training.nonfinite import NonFiniteGuard
    from runner.training.state import MetricStates


class RunningSums:
    """Running sums kept on the device (float64) and reduced on demand, in one collective.

    Entries: ``[loss sum, clipped gradient-norm sum, samples, correct predictions, predicted
    targets]``. The norm sum is non-finite once a step's norm was (:mod:`runner.training.nonfinite`
    reads it, and the loss sum, where they are reduced anyway); the last two give the default
    ``train/accuracy`` without a metric object (``MetricPlan.counted_accuracy``).

    Args:
        device: Where the sums live (the strategy's ``output_device``).
        start: Rank-reduced sums restored from a checkpoint (rank 0 only; a shorter list fills the first entries).
    """

    SIZE = 5

    def __init__(self, device: torch.device, start: list[float] | None = None):
        self.sums = torch.zeros(self.SIZE, dtype=torch.float64, device=device)
        if start:  # rank-reduced sums restored from a checkpoint, held by rank 0 only
            kept = start[: self.SIZE]
            self.sums[: len(kept)] += torch.tensor(kept, dtype=torch.float64, device=device)

    def add(self, loss_sum: torch.Tensor, count: int) -> None:
        """Add one micro-batch: its summed loss (a scalar) and its sample count."""
        self.sums[0] += loss_sum.to(torch.float64)
        self.sums[2] += count

    def add_norm(self, norm: torch.Tensor) -> None:
        """Add one step's (clipped) gradient norm, a scalar on the device."""
        self.sums[1] += norm

    def add_correct(self, correct: torch.Tensor, total: int) -> None:
        """Add one micro-batch's correct predictions (a scalar on the device) out of ``total`` targets."""
        self.sums[3] += correct
        self.sums[4] += total

    def reduced_sums(self, strategy: Strategy) -> list[float]:
        """The sums over ranks (a collective), as floats."""
        return strategy.all_reduce_sum(self.sums.clone()).tolist()


def mean_loss(sums: list[float]) -> float:
    """``loss sum / samples`` of reduced sums (``nan`` without samples)."""
    return sums[0] / sums[2] if sums[2] else math.nan


def count_correct(prediction: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Correct class predictions of a batch, a scalar on the device: classes on dim 1 of ``prediction``, as
    torchmetrics' multiclass accuracy reads logits ``(B, C, ...)`` against labels ``(B, ...)``."""
    return (prediction.detach().argmax(1) == target).sum()


def accuracy_of(sums: list[float]) -> float:
    """``correct / total`` of reduced sums (``nan`` without predictions)."""
    return sums[3] / sums[4] if sums[4] else math.nan


@dataclass
class Tally:
    """What the loop adds up: since the last ``train/loss`` log (across epochs) and over the epoch in progress.

    Attributes:
        window_metrics: Train metrics since the last log (``train/step_<name>``).
        epoch_metrics: Train metrics of the epoch (``train/<name>``).
        guard: Checks for non-finite losses and gradient norms (``train.on_nonfinite``).
        counted_accuracy: Whether the default ``train/accuracy`` is counted in the sums.
        epoch: Sums of the epoch in progress; ``None`` between epochs.
        epoch_samples: Global samples of this run's steps of the epoch.
    """

    window: RunningSums
    window_metrics: MetricSet
    epoch_metrics: MetricSet
    guard: NonFiniteGuard
    counted_accuracy: bool = False
    epoch: RunningSums | None = None
    epoch_samples: int = 0

    def start_epoch(self, sums: RunningSums) -> None:
        self.epoch = sums
        self.epoch_samples = 0

    @classmethod
    def start(
        cls,
        plan: MetricPlan,
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
            MetricSet(plan.train, "train/step_", device),
            MetricSet(plan.train, "train/", device),
            guard,
            plan.counted_accuracy,
        )
        saved = (metric_states or {}) if held else {}
        tally.window_metrics.load_state(saved.get("window") or {})
        tally.epoch_metrics.load_state(saved.get("epoch") or {})
        return tally

    def add(self, loss_sum: torch.Tensor, batch: Batch, out: ModelOutput, io: BatchIO) -> None:
        """Add a micro-batch (its summed loss, samples, and the prediction in forward's ``out``) to window and epoch.

        Only device work: no host read, no collective.
        """
        sums = (self.window, self.epoch) if self.epoch is not None else (self.window,)
        for running in sums:
            running.add(loss_sum, batch.size)
        if self.counted_accuracy and batch.target is not None:
            target = batch.target
            correct = count_correct(io.prediction(out), target)
            for running in sums:
                running.add_correct(correct, target.numel())
        if self.window_metrics:
            self.window_metrics.add(out, batch, io)
            self.epoch_metrics.add(out, batch, io)

    def end_step(self, grad_norm: torch.Tensor | None) -> None:
        """Close an optimizer step: the clipping's gradient norm (if checked) joins the sums; the guard notes it."""
        if grad_norm is not None and self.guard.check_grads:
            self.window.add_norm(grad_norm)
            if self.epoch is not None:
                self.epoch.add_norm(grad_norm)
        self.guard.end_step(self.window.sums)

    def accuracy(self, sums: list[float], prefix: str) -> dict[str, float]:
        """``{prefix + "accuracy": value}`` from reduced sums when the accuracy is counted, else ``{}``."""
        return {f"{prefix}accuracy": accuracy_of(sums)} if self.counted_accuracy else {}

    def metric_states(self) -> MetricStates:
        """The train metrics' states, summed over ranks (a collective): ``{"window": ..., "epoch": ...}``."""
        epoch = self.epoch_metrics.state() if self.epoch is not None else None
        return {"window": self.window_metrics.state(), "epoch": epoch}

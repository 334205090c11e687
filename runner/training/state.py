"""What the training loop carries: its state (saved in checkpoints), what it returns, and the parts it is given.

:class:`TrainState` is what a checkpoint stores about where training stands, :class:`FitResult`
what :func:`runner.training.loop.fit` returns on every rank, :class:`LoopParts` everything the
loop needs, built by :mod:`runner.training.setup`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from runner.training.batches import BatchIO
from runner.training.metrics import MetricPlan

if TYPE_CHECKING:
    from torch.optim.lr_scheduler import LRScheduler

    from runner.strategies.base import Precision, Strategy
    from runner.tracking.trackers import Tracker
    from runner.training.loaders import Loaders
    from runner.training.losses import Loss

MetricStates = dict[str, dict[str, dict[str, Any]] | None]
"""Train metric states by window (``"window"``, ``"epoch"``), then metric, then torchmetrics state (tensor or list)."""


@dataclass
class TrainState:
    """Where training stands; saved in checkpoints so a resumed run continues exactly.

    Attributes:
        epoch: Index of the epoch in progress (0-based).
        global_step: Optimizer steps taken so far, over all epochs.
        batch_in_epoch: Global batches of ``epoch`` already consumed.
        epoch_sums: Rank-reduced running sums (:class:`~runner.training.sums.RunningSums`) of the batches of
            ``epoch`` consumed so far, so that epoch metrics of a resumed epoch cover the whole epoch.
        window_sums: The same for the steps since the last ``train/loss`` log.
        metric_states: Rank-reduced train metric states, ``{"window": ..., "epoch": ...}`` (:meth:`MetricSet.state`).
    """

    epoch: int = 0
    global_step: int = 0
    batch_in_epoch: int = 0
    epoch_sums: list[float] | None = None
    window_sums: list[float] | None = None
    metric_states: MetricStates | None = None


@dataclass
class FitResult:
    """What :func:`fit` returns on every rank.

    Attributes:
        metrics: Last value of every metric (rank-reduced), e.g. ``val/accuracy``.
        history: ``(step, metrics)`` pairs in logging order (kept for tests and bench).
        step_times_s: Wall time of each optimizer step of this run, in seconds (data included).
        data_wait_s: Of each step's time, seconds spent waiting for the DataLoader.
        stopped_after_epoch: The epoch after which ``LoopParts.epoch_end`` stopped training
            (e.g. a sweep's pruner), or ``None`` when it ran to the end.
    """

    state: TrainState
    metrics: dict[str, float] = field(default_factory=dict)
    history: list[tuple[int, dict[str, float]]] = field(default_factory=list)
    step_times_s: list[float] = field(default_factory=list)
    data_wait_s: list[float] = field(default_factory=list)
    stopped_after_epoch: int | None = None


@dataclass
class LoopParts:
    """Everything the loop needs, built by :mod:`runner.training.setup`; the loop builds nothing itself.

    Attributes:
        model: The wrapped module (``strategy.wrap`` already applied).
        strategy: The parallel strategy (collectives, devices, ``no_sync``, the stop decision).
        optimizer: A ``torch.optim.Optimizer`` over the model's parameters.
        scheduler: Optional LR scheduler; ``scheduler_interval`` says when it steps.
        scheduler_interval: ``"step"`` (after every optimizer step) or ``"epoch"``.
        loss: The summed loss of a micro-batch, ``loss(out, batch, io) -> scalar`` (:mod:`runner.training.losses`).
        tracker: Where rank 0 sends metrics (a ``NullTracker`` on other ranks).
        total_steps: Optimizer steps of the whole run: ``min(steps_per_epoch * epochs, max_steps)``.
        precision: Autocast and gradient scaling (:class:`runner.strategies.base.Precision`).
        io: How batches reach the model and where the prediction is in its output.
        metrics: The train and validation metrics (:class:`~runner.training.metrics.MetricPlan`).
        on_checkpoint: Called as ``on_checkpoint(state, reason)`` at checkpoint boundaries (all ranks).
        should_stop: Returns True when a stop signal arrived on this rank.
        sync_timing: Synchronise the device at the end of every step so that step times are
            exact on CUDA (``runner bench``); costs a little throughput, so off by default.
        epoch_end: Called on every rank after each complete epoch (its metrics logged, its
            checkpoint written) as ``epoch_end(epoch, metrics)``; returning True ends training
            there, normally. Every rank must return the same answer.
    """

    model: nn.Module
    strategy: Strategy
    optimizer: torch.optim.Optimizer
    scheduler: LRScheduler | None
    scheduler_interval: str
    loss: Loss
    loaders: Loaders
    tracker: Tracker
    total_steps: int
    precision: Precision
    io: BatchIO = field(default_factory=lambda: BatchIO(None, None, model_loss=False))
    metrics: MetricPlan = field(default_factory=MetricPlan)
    on_checkpoint: Callable[[TrainState, str], None] | None = None
    should_stop: Callable[[], bool] = lambda: False
    sync_timing: bool = False
    epoch_end: Callable[[int, dict[str, float]], bool] | None = None

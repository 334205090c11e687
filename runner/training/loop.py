"""The training loop: steps, evaluation and metric reduction, identical for every parallel mode.

The loop reads top to bottom in the order zero_grad -> forward -> loss -> backward ->
clip -> step -> schedule -> log. It never asks which parallel mode it runs under: the
:class:`runner.strategies.base.Strategy` supplies wrapping, ``no_sync`` and the collectives, and
it imports neither mlflow nor the CLI (metrics go to a ``Tracker``).

Loss normalisation (DESIGN §2-§3): every micro-batch loss is computed with
``reduction="sum"`` and divided by ``G / world_size`` where ``G`` is the number of samples
in the whole optimizer step across all ranks and micro-batches. DDP averages gradients over
ranks, so the gradient is exactly that of the mean loss over the global batch, also for
uneven final batches and with gradient accumulation. This is what makes ``none`` and
``ddp`` runs of one spec agree step by step.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from runner.errors import Interrupted
from runner.training.progress import Progress
from runner.training.sampling import rank_batch_size


@dataclass
class TrainState:
    """Where training stands; saved in checkpoints so a resumed run continues exactly.

    Attributes:
        epoch: Index of the epoch in progress (0-based).
        global_step: Optimizer steps taken so far, over all epochs.
        batch_in_epoch: Global batches of ``epoch`` already consumed.
        epoch_sums: Rank-reduced ``[loss sum, correct, samples]`` of the batches of ``epoch``
            consumed so far, so that epoch metrics of a resumed epoch cover the whole epoch.
        window_sums: The same for the steps since the last ``train/loss`` log.
    """

    epoch: int = 0
    global_step: int = 0
    batch_in_epoch: int = 0
    epoch_sums: list[float] | None = None
    window_sums: list[float] | None = None


@dataclass
class FitResult:
    """What :func:`fit` returns on every rank.

    Attributes:
        state: The final :class:`TrainState`.
        metrics: Last value of every metric (rank-reduced), e.g. ``val/accuracy``.
        history: ``(step, metrics)`` pairs in logging order (kept for tests and bench).
        step_times_s: Wall time of each optimizer step of this run, in seconds (data included).
        data_wait_s: Of each step's time, seconds spent waiting for the DataLoader.
    """

    state: TrainState
    metrics: dict[str, float] = field(default_factory=dict)
    history: list[tuple[int, dict[str, float]]] = field(default_factory=list)
    step_times_s: list[float] = field(default_factory=list)
    data_wait_s: list[float] = field(default_factory=list)


@dataclass
class LoopParts:
    """Everything the loop needs, built by the worker; the loop builds nothing itself.

    Attributes:
        model: The wrapped module (``strategy.wrap`` already applied).
        strategy: The parallel strategy (collectives, devices, ``no_sync``).
        optimizer: A ``torch.optim.Optimizer`` over the model's parameters.
        scheduler: Optional LR scheduler; ``scheduler_interval`` says when it steps.
        loss_fn: Per-sample loss with ``reduction="sum"``: ``(logits (B, C), target (B,)) -> scalar``.
        loaders: The :class:`runner.training.data.Loaders` of this rank.
        tracker: Where rank 0 sends metrics (a ``NullTracker`` on other ranks).
        scaler: ``torch.amp.GradScaler`` for fp16, else ``None``.
        autocast_dtype: ``torch.bfloat16`` / ``torch.float16`` for AMP, else ``None``.
        classification: Whether accuracy is computed (targets are class indices).
        on_checkpoint: Called as ``on_checkpoint(state, reason)`` at checkpoint boundaries (all ranks).
        should_stop: Returns True when a stop signal arrived on this rank.
        sync_timing: Synchronise the device at the end of every step so that step times are
            exact on CUDA (``runner bench``); costs a little throughput, so off by default.
    """

    model: nn.Module
    strategy: Any
    optimizer: torch.optim.Optimizer
    scheduler: Any
    scheduler_interval: str
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    loaders: Any
    tracker: Any
    scaler: Any = None
    autocast_dtype: torch.dtype | None = None
    classification: bool = True
    on_checkpoint: Callable[[TrainState, str], None] | None = None
    should_stop: Callable[[], bool] = lambda: False
    sync_timing: bool = False


def fit(parts: LoopParts, train_spec: Any, state: TrainState | None = None, checkpoint_spec: Any = None) -> FitResult:
    """Train for ``train_spec.epochs`` epochs (or ``max_steps`` optimizer steps).

    Args:
        parts: The model, strategy, optimizer, data and tracker (see :class:`LoopParts`).
        train_spec: The ``[train]`` table (:class:`runner.spec.schema.TrainSpec`).
        state: Where to start; ``None`` starts from scratch. A resumed state skips the global
            batches of the current epoch that were already consumed.
        checkpoint_spec: The ``[checkpoint]`` table, for ``every_n_epochs`` / ``every_n_steps``.

    Returns:
        A :class:`FitResult`; metrics are reduced over ranks and identical on every rank.

    Raises:
        Interrupted: A stop signal arrived; the current step finished and ``on_checkpoint``
            ran with reason ``"signal"`` first.
        RuntimeError: Whatever the model, optimizer or a collective raises.
    """
    state = state or TrainState()
    result = FitResult(state=state)
    strategy, model, loaders = parts.strategy, parts.model, parts.loaders
    device = strategy.device
    world = strategy.world_size
    steps_per_epoch = len(loaders.global_batch_sizes)
    total_steps = steps_per_epoch * train_spec.epochs
    if train_spec.max_steps is not None:
        total_steps = min(total_steps, train_spec.max_steps)
    progress = Progress(train_spec.progress, total_steps, enabled=strategy.is_main, initial=state.global_step)
    log_every = train_spec.log_every_n_steps
    window = _Window(strategy.output_device, state.window_sums if strategy.rank == 0 else None)
    resumed_epoch_sums = state.epoch_sums if strategy.rank == 0 else None

    def log(metrics: dict[str, float], step: int) -> None:
        result.metrics.update(metrics)
        result.history.append((step, dict(metrics)))
        parts.tracker.log_metrics(metrics, step=step)  # a NullTracker except on the logging rank

    try:
        while state.epoch < train_spec.epochs and state.global_step < total_steps:
            epoch_start = time.perf_counter()
            epoch_samples = 0
            epoch_window = _Window(strategy.output_device, resumed_epoch_sums)
            resumed_epoch_sums = None
            loaders.train_sampler.set_epoch(state.epoch)
            loaders.train_sampler.set_start_batch(state.batch_in_epoch)
            model.train()
            batches = iter(loaders.train)
            while state.batch_in_epoch < steps_per_epoch and state.global_step < total_steps:
                global_size = loaders.global_batch_sizes[state.batch_in_epoch]
                share = rank_batch_size(global_size, world, strategy.rank)
                denom = global_size / world
                step_start = time.perf_counter()
                waited = 0.0
                parts.optimizer.zero_grad(set_to_none=True)
                consumed = 0
                while consumed < share:
                    fetch_start = time.perf_counter()
                    x, y = next(batches)
                    waited += time.perf_counter() - fetch_start
                    n = int(y.shape[0])
                    last_micro = consumed + n >= share
                    x = x.to(device, non_blocking=True)
                    y = y.to(strategy.output_device, non_blocking=True)
                    sync = contextlib.nullcontext() if last_micro else strategy.no_sync(model)
                    with sync:
                        with _autocast(device, parts.autocast_dtype):
                            out = model(x)
                            loss_sum = parts.loss_fn(out, y)
                        loss = loss_sum / denom
                        if parts.scaler is not None:
                            parts.scaler.scale(loss).backward()
                        else:
                            loss.backward()
                    correct = _correct(out, y) if parts.classification else None
                    window.add(loss_sum.detach(), correct, n)
                    epoch_window.add(loss_sum.detach(), correct, n)
                    consumed += n
                if train_spec.clip_grad_norm is not None:
                    if parts.scaler is not None:
                        parts.scaler.unscale_(parts.optimizer)
                    torch.nn.utils.clip_grad_norm_(model.parameters(), train_spec.clip_grad_norm)
                if parts.scaler is not None:
                    parts.scaler.step(parts.optimizer)
                    parts.scaler.update()
                else:
                    parts.optimizer.step()
                if parts.scheduler is not None and parts.scheduler_interval == "step":
                    parts.scheduler.step()
                if parts.sync_timing and device.type == "cuda":
                    torch.cuda.synchronize(device)
                result.step_times_s.append(time.perf_counter() - step_start)
                result.data_wait_s.append(waited)
                state.global_step += 1
                state.batch_in_epoch += 1
                epoch_samples += global_size
                progress.update(1)
                if state.global_step % log_every == 0:
                    loss_mean, acc = window.reduce(strategy)
                    metrics = {"train/loss": loss_mean, "lr": parts.optimizer.param_groups[0]["lr"]}
                    if acc is not None:
                        metrics["train/step_accuracy"] = acc
                    log(metrics, state.global_step)
                    progress.show(epoch=state.epoch, loss=loss_mean)
                    window = _Window(strategy.output_device)
                if (
                    checkpoint_spec is not None
                    and checkpoint_spec.every_n_steps
                    and state.global_step % checkpoint_spec.every_n_steps == 0
                ):
                    _checkpoint(parts, state, "step", epoch_window, window)
                if _any(strategy, parts.should_stop()):
                    _checkpoint(parts, state, "signal", epoch_window, window)
                    raise Interrupted()
            epoch_done = state.batch_in_epoch >= steps_per_epoch
            epoch_time = time.perf_counter() - epoch_start
            loss_mean, acc = epoch_window.reduce(strategy)
            epoch_metrics = {
                "train/epoch_loss": loss_mean,
                "epoch": float(state.epoch),
                "epoch_time_s": epoch_time,
                "samples_per_s": epoch_samples / epoch_time if epoch_time > 0 else 0.0,
            }
            if acc is not None:
                epoch_metrics["train/accuracy"] = acc
            if loaders.val is not None and (
                (state.epoch + 1) % train_spec.eval_every_n_epochs == 0
                or not epoch_done
                or state.epoch + 1 == train_spec.epochs
            ):
                epoch_metrics.update(evaluate(parts, strategy))
            log(epoch_metrics, state.global_step)
            progress.show(epoch=state.epoch, **{k: v for k, v in epoch_metrics.items() if k.startswith("val/")})
            if parts.scheduler is not None and parts.scheduler_interval == "epoch" and epoch_done:
                parts.scheduler.step()
            if not epoch_done:
                break  # max_steps reached mid-epoch
            state.epoch += 1
            state.batch_in_epoch = 0
            if checkpoint_spec is not None and state.epoch % checkpoint_spec.every_n_epochs == 0:
                _checkpoint(parts, state, "epoch", None, window)
            if _any(strategy, parts.should_stop()):
                _checkpoint(parts, state, "signal", None, window)
                raise Interrupted()
    finally:
        progress.close()
    return result


@torch.no_grad()
def evaluate(parts: LoopParts, strategy: Any) -> dict[str, float]:
    """Evaluate on this rank's validation shard and reduce over ranks.

    Every validation sample is counted exactly once across ranks (the eval sampler never
    pads), and the means are computed once from reduced sums: ``sum(loss) / count``.

    Returns:
        ``{"val/loss": float, "val/accuracy": float}`` (accuracy only for classification).
    """
    module = strategy.eval_module(parts.model)
    module.eval()
    window = _Window(strategy.output_device)
    for x, y in parts.loaders.val:
        x = x.to(strategy.device, non_blocking=True)
        y = y.to(strategy.output_device, non_blocking=True)
        with _autocast(strategy.device, parts.autocast_dtype):
            out = module(x)
            loss_sum = parts.loss_fn(out, y)
        window.add(loss_sum, _correct(out, y) if parts.classification else None, int(y.shape[0]))
    parts.model.train()
    loss_mean, acc = window.reduce(strategy)
    metrics = {"val/loss": loss_mean}
    if acc is not None:
        metrics["val/accuracy"] = acc
    return metrics


class _Window:
    """Running sums (loss, correct, count) kept on the device; reduced over ranks on demand."""

    def __init__(self, device: torch.device, start: list[float] | None = None):
        self.sums = torch.zeros(3, dtype=torch.float64, device=device)
        self.has_correct = False
        if start is not None:  # rank-reduced sums restored from a checkpoint, held by rank 0 only
            self.sums += torch.tensor(start[:3], dtype=torch.float64, device=device)
            self.has_correct = bool(start[3]) if len(start) > 3 else False

    def add(self, loss_sum: torch.Tensor, correct: torch.Tensor | None, count: int) -> None:
        self.sums[0] += loss_sum.to(torch.float64)
        if correct is not None:
            self.sums[1] += correct
            self.has_correct = True
        self.sums[2] += count

    def reduced_sums(self, strategy: Any) -> list[float]:
        """``[loss sum, correct, samples, has_correct]`` summed over ranks (a collective)."""
        return [*strategy.all_reduce_sum(self.sums.clone()).tolist(), 1.0 if self.has_correct else 0.0]

    def reduce(self, strategy: Any) -> tuple[float, float | None]:
        loss, correct, count = strategy.all_reduce_sum(self.sums.clone()).tolist()
        if count == 0:
            return math.nan, None
        return loss / count, (correct / count if self.has_correct else None)


def _correct(out: Any, y: torch.Tensor) -> torch.Tensor:
    logits = out[0] if isinstance(out, (tuple, list)) else out
    return (logits.argmax(dim=1) == y).sum()


def _autocast(device: torch.device, dtype: torch.dtype | None):
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def _any(strategy: Any, flag: bool) -> bool:
    """True on every rank when any rank has ``flag`` set (one small all-reduce)."""
    if strategy.world_size == 1:
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=strategy.device)
    return bool(strategy.all_reduce_sum(t).item() > 0)


def _checkpoint(
    parts: LoopParts, state: TrainState, reason: str, epoch_window: _Window | None, window: _Window
) -> None:
    """Record the running sums in ``state`` (collectives on every rank), then save."""
    if parts.on_checkpoint is None:
        return
    state.epoch_sums = epoch_window.reduced_sums(parts.strategy) if epoch_window is not None else None
    state.window_sums = window.reduced_sums(parts.strategy)
    parts.on_checkpoint(state, reason)

"""The training loop: steps, evaluation and metric reduction, identical for every parallel mode.

The loop reads top to bottom in the order zero_grad -> forward -> loss -> backward ->
clip -> step -> schedule -> log. It never asks which parallel mode it runs under: the
``runner.strategies.base.Strategy`` supplies wrapping, ``no_sync``, the collectives and
the stop decision, the ``runner.strategies.base.Precision`` supplies autocast and
gradient scaling, and it imports neither mlflow nor the CLI (metrics go to a ``Tracker``).

Loss normalisation (docs/design.md §3): every micro-batch loss is a sum with the count PyTorch's
mean would divide it by (``runner.training.losses``: a mean-returning loss is multiplied by the
micro-batch's samples, which are its count); a step fetches its micro-batches first, knows the
global count ``C`` of the whole optimizer step across all ranks and micro-batches (a collective only
where labels are ignored, weighted or per position), and divides each sum by ``C / world_size``.
DDP averages gradients over ranks, so the gradient is exactly that of the mean loss over the
global batch, also for uneven final batches and with gradient accumulation. This is what makes
``none`` and ``ddp`` runs of one spec agree step by step. Batches and forward: ``runner.training.batches``; metrics:
``runner.training.metrics``; ``train.on_nonfinite``: ``runner.training.sums``.

Steady state: between ``train/loss`` logs a step makes no collective (but the count's, for a loss
whose labels are ignored, weighted or per position) and reads nothing back from the device; the
running sums, the non-finite check and the default train accuracy stay on the device until a log step, a checkpoint or
the epoch's end reduces them in one collective.

Stopping: after every optimizer step the loop asks
``runner.strategies.base.Strategy.reduce_stop_decision`` whether to stop, settling it (the
ranks agree, a collective where there are peers) only at log steps, step checkpoints and the end
of an epoch's steps. At a log step the ranks' requests ride in the logged sums' reduction, so the
decision's own collective runs there only when some rank asked. A request seen after step ``k``
(e.g. SIGTERM during step ``k``) stops a single process after step ``k``, and several processes at
the first of those points from step ``k`` on. The decision is settled again at the epoch boundary
(after evaluation and the epoch checkpoint), so a request during an epoch's last step stops before
its evaluation, as one during evaluation stops at the boundary. Stopping first logs the log step
whose reduction still runs beside the next step (several ranks: a log step's values are reduced
while the next step trains), then writes a ``"signal"`` checkpoint, then raises
``runner.errors.Interrupted``: a stop settled at a log step used to checkpoint without that step's
values, and the resume began after it, so its ``train/loss`` and ``lr`` were lost.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from runner.errors import Interrupted, stop_origin
from runner.training import STARTUP_METRIC, WorkerResult
from runner.training.batches import Batch, BatchIO, CollatedBatch, shape_error
from runner.training.metrics import MetricPlan, MetricSet
from runner.training.sampling import rank_batch_size
from runner.training.sums import (
    NonFiniteGuard,
    Progress,
    RunningSums,
    Tally,
    accuracy_of,
    check_lr,
    count_correct,
    mean_loss,
)
from runner.training.watch import early_stop

if TYPE_CHECKING:
    from torch.optim.lr_scheduler import LRScheduler
    from torch.utils.data import Dataset

    from runner.spec.schema import CheckpointSpec
    from runner.spec.schema_loop import EarlyStoppingSpec, TrainSpec
    from runner.strategies.base import Precision, Strategy
    from runner.tracking.trackers import Tracker
    from runner.training.callbacks import Callbacks
    from runner.training.data import DatasetInfo
    from runner.training.ema import Ema
    from runner.training.losses import Loss
    from runner.training.metrics import MetricStates
    from runner.training.sampling import Loaders


@dataclass
class TrainState:
    """Where training stands, saved in checkpoints so a resumed run continues exactly.

    ``batch_in_epoch`` counts global batches of ``epoch`` consumed; ``epoch_sums``, ``window_sums`` and
    ``metric_states`` are rank-reduced running sums, so a resumed epoch's metrics cover the whole epoch.
    """

    epoch: int = 0
    global_step: int = 0
    batch_in_epoch: int = 0
    epoch_sums: list[float] | None = None
    window_sums: list[float] | None = None
    metric_states: MetricStates | None = None
    stopping: dict[str, float] | None = None  # early stopping's record: the best value, its step, evaluations since
    evaluated: dict[str, float] | None = None  # the last epoch's metrics, logged at step ``evaluated_at``
    evaluated_at: int = -1


@dataclass
class TrainingParts:
    """What :func:`runner.training.setup.build_parts` makes from the spec on one rank (``model`` wrapped,
    ``raw_model`` the user's); ``loss(out, batch, io)`` is a micro-batch's summed loss; ``total_steps`` is
    ``min(steps_per_epoch * epochs, max_steps)``; ``scheduler_monitor`` is the metric a plateau scheduler steps
    on; ``ema`` the weights' moving average."""

    model: nn.Module
    raw_model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: LRScheduler | None
    scheduler_interval: str
    precision: Precision
    loss: Loss
    loaders: Loaders
    total_steps: int
    train_set: Dataset
    io: BatchIO = field(default_factory=lambda: BatchIO(None, None, model_loss=False))
    metrics: MetricPlan = field(default_factory=MetricPlan)
    data: DatasetInfo | None = None
    scheduler_monitor: str | None = None
    early_stopping: EarlyStoppingSpec | None = None
    ema: Ema | None = None
    callbacks: Callbacks | None = None

    def example_input(self) -> Any:
        """One training input with a batch dimension, ``(1, *input_shape)``, or a dict of them, for a signature."""
        sample = self.train_set[0]
        if isinstance(sample, dict):
            return {
                k: v.unsqueeze(0) for k, v in sample.items() if isinstance(v, torch.Tensor) and k != self.io.target_key
            }
        return sample[0].unsqueeze(0)


@dataclass(kw_only=True)
class LoopParts(TrainingParts):
    """The built parts and what the run adds; the loop builds nothing itself.

    ``on_checkpoint(state, reason)`` runs on all ranks; ``should_stop`` is 0 or a stop code; ``sync_timing`` makes
    CUDA step times exact (bench); ``epoch_end(epoch, metrics)`` ends training when True on every rank;
    ``after_step`` follows each step's timing (the profiler); from ``started_at`` the loop logs
    ``time_to_first_step_s``; ``count_flops`` counts one step with ``FlopCounterMode``.
    """

    strategy: Strategy
    tracker: Tracker
    on_checkpoint: Callable[[TrainState, str], None] | None = None
    should_stop: Callable[[], int] = lambda: 0
    sync_timing: bool = False
    epoch_end: Callable[[int, dict[str, float]], bool] | None = None
    after_step: Callable[[], object] | None = None
    started_at: float | None = None
    count_flops: bool = False


def fit(
    parts: LoopParts,
    train_spec: TrainSpec,
    state: TrainState | None = None,
    checkpoint_spec: CheckpointSpec | None = None,
) -> WorkerResult:
    """Train ``train_spec.epochs`` epochs, at most ``parts.total_steps`` steps, from ``state`` (``None``: scratch).

    Without ``checkpoint_spec`` no step or epoch checkpoints are written. Metrics are reduced, the same on every rank;
    the result holds them, the logged history, each step's time and data wait (seconds), the epoch ``epoch_end``
    stopped after, ``startup_s`` and one step's FLOPs (``state`` is where training ended).
    Raises Interrupted: A stop signal (the module docstring), after ``on_checkpoint(..., "signal")``.
    TrainingError: A non-finite loss or norm under ``on_nonfinite = "stop"``, or an output that does not fit."""
    state = state or TrainState()
    strategy, loaders = parts.strategy, parts.loaders
    progress = Progress(train_spec.progress, parts.total_steps, enabled=strategy.is_main, initial=state.global_step)
    report = _Report(WorkerResult(rank=strategy.rank), parts.tracker, progress)
    if parts.count_flops:  # the second step of this job: the first pays for imports and the optimizer's state
        report.count_at = min(1, parts.total_steps - state.global_step - 1)
    held = strategy.rank == 0  # running sums restored from a checkpoint are held by rank 0 only
    every_n_logs = train_spec.log_every_n_steps
    guard = NonFiniteGuard(
        train_spec.on_nonfinite, strategy.output_device, state.global_step, parts.precision.scaling, every_n_logs
    )
    tally = Tally.start(parts.metrics, guard, state.window_sums, state.metric_states, held=held)
    resumed_epoch_sums = state.epoch_sums if held else None
    every_n_steps = checkpoint_spec.every_n_steps if checkpoint_spec is not None else None
    _hook(parts, "on_train_start", state, {})
    try:
        while state.epoch < train_spec.epochs and state.global_step < parts.total_steps:
            progress.start_epoch()
            tally.start_epoch(RunningSums(strategy.output_device, resumed_epoch_sums))
            resumed_epoch_sums = None
            batches = _start_epoch(parts, state)
            while state.batch_in_epoch < loaders.steps_per_epoch and state.global_step < parts.total_steps:
                _step(parts, batches, state, tally, report, train_spec, every_n_steps)
            report.finish_pending()
            _stop_if_asked(parts, state, tally, report, settle=True)
            if not end_epoch(parts, train_spec, state, tally, report):
                break  # max_steps reached mid-epoch
            _hook(parts, "on_epoch_end", state, report.result.history[-1][1])
            state.epoch += 1
            state.batch_in_epoch = 0
            tally.epoch = None
            if checkpoint_spec is not None and state.epoch % checkpoint_spec.every_n_epochs == 0:
                _checkpoint(parts, state, "epoch", tally)
            _stop_if_asked(parts, state, tally, report, settle=True)
            if parts.epoch_end is not None and parts.epoch_end(state.epoch - 1, report.result.history[-1][1]):
                report.result.stopped_after_epoch = state.epoch - 1
                break
            if report.result.stop_reason is not None:  # early stopping: the same step on every rank
                break
        if report.result.step_times_s and state.global_step % train_spec.log_every_n_steps:
            tally.window, _ = _log_window(parts, state, tally, report)  # the last step, when its log was not due
    finally:
        progress.close()
    report.result.global_step = state.global_step
    _hook(parts, "on_train_end", state, report.result.metrics)
    return report.result


def train_step(
    parts: LoopParts,
    batches: Iterator[CollatedBatch],
    global_size: int,
    clip_grad_norm: float | None,
    tally: Tally,
) -> float:
    """One optimizer step over this rank's micro-batches of a global batch: fetch them all and know the global count
    the loss's mean divides by (agreed by one small collective only where labels are ignored or weighted, as
    torchtitan agrees on a step's tokens), then accumulate under ``no_sync`` each summed loss divided by ``count /
    world_size`` (DDP averages the gradients over ranks), clip, step, schedule. Returns the seconds waited for
    data."""
    strategy, model, io = parts.strategy, parts.model, parts.io
    share = rank_batch_size(global_size, strategy.world_size, strategy.rank)
    waited = 0.0
    micro: list[Batch] = []
    while sum(batch.size for batch in micro) < share:
        fetch_start = time.perf_counter()
        raw = next(batches)
        waited += time.perf_counter() - fetch_start
        micro.append(io.prepare(raw, strategy.device, strategy.output_device))
    counts = [parts.loss.count(batch) for batch in micro]
    local = sum(counts)
    if parts.loss.counts_vary(micro[0]):  # ignored or weighted labels: the ranks agree on the global count
        total = torch.as_tensor(local, dtype=torch.float64, device=strategy.output_device)
        denom: torch.Tensor | float = (strategy.all_reduce_sum(total) / strategy.world_size).float()
    else:  # every sample counts alike on every rank: no collective
        denom = local / share * global_size / strategy.world_size
    parts.optimizer.zero_grad(set_to_none=True)
    for index, (batch, count) in enumerate(zip(micro, counts, strict=True)):
        with contextlib.nullcontext() if index == len(micro) - 1 else strategy.no_sync(model):
            try:
                with parts.precision.autocast():
                    out = io.forward(model, batch)
                    loss_sum = parts.loss(out, batch, io)
            except (RuntimeError, ValueError) as exc:  # shapes that point at the data name its key
                located = shape_error(exc, batch)
                if located is None:
                    raise
                raise located from exc
            parts.precision.backward(loss_sum / denom)
        tally.add(loss_sum.detach(), count, batch, out, io)
    norm = None
    if clip_grad_norm is not None:
        parts.precision.unscale_(parts.optimizer)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip_grad_norm)
        if isinstance(norm, DTensor):  # fsdp: the norm over sharded gradients, made whole (every rank takes part)
            norm = norm.full_tensor()
    parts.precision.step(parts.optimizer)
    if parts.ema is not None:
        parts.ema.update()
    tally.end_step(norm)
    if parts.scheduler is not None and parts.scheduler_interval == "step":
        parts.scheduler.step()
        check_lr(parts.optimizer, parts.scheduler)
    if parts.sync_timing and strategy.device.type == "cuda":
        torch.cuda.synchronize(strategy.device)
    return waited


def end_epoch(
    parts: LoopParts,
    train_spec: TrainSpec,
    state: TrainState,
    tally: Tally,
    report: _Report,
) -> bool:
    """Log the epoch's metrics at ``state.global_step`` (evaluating when due), judge early stopping on them and step
    a per-epoch scheduler.

    Returns whether the epoch is complete. Raises TrainingError for a non-finite step under ``on_nonfinite = "stop"``.
    """
    epoch_done = state.batch_in_epoch >= parts.loaders.steps_per_epoch
    assert tally.epoch is not None  # set by Tally.start_epoch
    sums = tally.epoch.reduced_sums(parts.strategy)
    tally.guard.check(sums, parts.strategy, f"the end of epoch {state.epoch}")
    metrics = {
        "train/epoch_loss": mean_loss(sums),
        "epoch": float(state.epoch),
        "epoch_time_s": report.progress.epoch_seconds,
        "samples_per_s": report.progress.samples_per_s,  # the progress line's figure: one definition
    }
    metrics.update(tally.accuracy(sums, "train/"))
    metrics.update(tally.epoch_metrics.compute())
    if parts.loaders.val is not None and (
        (state.epoch + 1) % train_spec.eval_every_n_epochs == 0
        or not epoch_done
        or state.epoch + 1 == train_spec.epochs
    ):
        with report.progress.phase("validating"), parts.ema.applied() if parts.ema else contextlib.nullcontext():
            validated = evaluate(parts)
        metrics.update(validated)
        _hook(parts, "on_validation_end", state, metrics, validated)
    report.log(metrics, state.global_step)
    report.progress.show(epoch=state.epoch, **{k: v for k, v in metrics.items() if k.startswith("val/")})
    state.evaluated = metrics  # a checkpoint at this step records checkpoint.monitor's value
    state.evaluated_at = state.global_step
    if parts.early_stopping is not None:
        state.stopping, report.result.stop_reason = early_stop(
            parts.early_stopping, metrics, state.global_step, state.stopping
        )
    if parts.scheduler is not None and parts.scheduler_interval == "epoch" and epoch_done:
        _step_scheduler(parts, metrics)
    return epoch_done


def _hook(parts: LoopParts, hook: str, state: TrainState, metrics: dict[str, float], *args: Any) -> None:
    """Call ``hook`` of the user's callbacks, if any, at the state's step and epoch with ``metrics``."""
    if parts.callbacks is not None:
        parts.callbacks.call(hook, state.global_step, state.epoch, metrics, *args)


def _step_scheduler(parts: LoopParts, metrics: dict[str, float]) -> None:
    """Step a per-epoch scheduler: a plateau scheduler on its monitored metric, when this epoch logged it."""
    assert parts.scheduler is not None
    if parts.scheduler_monitor is None:
        parts.scheduler.step()
    elif (value := metrics.get(parts.scheduler_monitor)) is not None:
        parts.scheduler.step(value)  # type: ignore[arg-type]  # ReduceLROnPlateau.step(metrics)
    check_lr(parts.optimizer, parts.scheduler)


@torch.no_grad()
def evaluate(parts: LoopParts, split: str = "val") -> dict[str, float]:
    """``{"val/loss": ..., "val/<metric>": ...}`` over this rank's shard, reduced over ranks, each sample counted
    once; ``split="test"``: the test split, as ``test/*`` with the validation metrics."""
    strategy, io = parts.strategy, parts.io
    module = strategy.eval_module(parts.model)
    module.eval()
    sums = RunningSums(strategy.output_device)
    metrics = MetricSet(parts.metrics.val, f"{split}/", strategy.output_device)
    counted = parts.metrics.counted_accuracy
    loader = parts.loaders.test if split == "test" else parts.loaders.val
    assert loader is not None
    for raw in loader:
        batch = io.prepare(raw, strategy.device, strategy.output_device)
        with parts.precision.autocast():
            out = io.forward(module, batch)
            loss_sum = parts.loss(out, batch, io)
        sums.add(loss_sum, parts.loss.count(batch))
        if counted and batch.target is not None:
            sums.add_correct(count_correct(io.prediction(out), batch.target), batch.target.numel())
        if metrics:
            metrics.add(out, batch, io)
    parts.model.train()
    reduced = sums.reduced_sums(strategy)
    accuracy = {f"{split}/accuracy": accuracy_of(reduced)} if counted else {}
    return {f"{split}/loss": mean_loss(reduced), **accuracy, **metrics.compute()}


class _Report:
    """Where metrics go: the result (last values, history), the tracker and the progress display."""

    def __init__(self, result: WorkerResult, tracker: Tracker, progress: Progress):
        self.result = result
        self.tracker = tracker
        self.progress = progress
        self.count_at = -1  # the step of this job (0-based) whose FLOPs are counted; -1: none
        self.pending: Callable[[], bool] | None = None  # a log step whose reduction runs while the next step trains

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.result.metrics.update(metrics)
        self.result.history.append((step, dict(metrics)))
        self.tracker.log_metrics(metrics, step=step)  # a NullTracker except on the logging rank

    def finish_pending(self) -> bool:
        """Log the log step whose reduction ran meanwhile, if any; returns whether a rank was asked to stop."""
        pending, self.pending = self.pending, None
        return pending() if pending is not None else False


def _step(
    parts: LoopParts,
    batches: Iterator[CollatedBatch],
    state: TrainState,
    tally: Tally,
    report: _Report,
    train_spec: TrainSpec,
    every_n_steps: int | None,
) -> None:
    """One optimizer step of :func:`fit` and what follows it: its timing, the log, the checkpoint, the stop check."""
    global_size = parts.loaders.global_batch_sizes[state.batch_in_epoch]
    counting = len(report.result.step_times_s) == report.count_at
    step_start = time.perf_counter()
    with _flop_counter() if counting else contextlib.nullcontext() as counter:
        waited = train_step(parts, batches, global_size, train_spec.clip_grad_norm, tally)
    report.result.step_times_s.append(time.perf_counter() - step_start)
    if counter is not None:
        report.result.step_flops = int(counter.get_total_flops())
    report.result.data_wait_s.append(waited)
    if parts.after_step is not None:
        parts.after_step()
    if len(report.result.step_times_s) == 1 and parts.started_at is not None:
        # from the command's start to the end of the first step; not in the history (it differs between equal runs)
        report.result.startup_s = time.time() - parts.started_at
        parts.tracker.log_metrics({STARTUP_METRIC: report.result.startup_s}, step=state.global_step + 1)
    state.global_step += 1
    state.batch_in_epoch += 1
    report.progress.update(1, samples=global_size)
    asked = report.finish_pending()  # whether some rank had been asked to stop by a log step's reduction
    saved = bool(every_n_steps and state.global_step % every_n_steps == 0)
    if state.global_step % train_spec.log_every_n_steps == 0:  # overlapped with the next step, unless one follows
        overlap = parts.strategy.world_size > 1 and not saved and state.global_step < parts.total_steps
        tally.window, now = _log_window(parts, state, tally, report, overlap)
        asked = asked or now
    if saved:
        _checkpoint(parts, state, "step", tally)
    _stop_if_asked(parts, state, tally, report, settle=asked or saved)


def _start_epoch(parts: LoopParts, state: TrainState) -> Iterator[CollatedBatch]:
    """Position the sampler at ``state`` (epoch, batches already consumed) and return the batch iterator."""
    parts.loaders.train_sampler.set_epoch(state.epoch)
    parts.loaders.train_sampler.set_start_batch(state.batch_in_epoch)
    parts.model.train()
    return iter(parts.loaders.train)


def _flop_counter() -> contextlib.AbstractContextManager[Any]:
    """torch's ``FlopCounterMode`` (forward and backward FLOPs), imported for the one counted step, not every step."""
    from torch.utils.flop_counter import FlopCounterMode

    return FlopCounterMode(display=False)


def _log_window(
    parts: LoopParts, state: TrainState, tally: Tally, report: _Report, overlap: bool = False
) -> tuple[RunningSums, bool]:
    """Log the step metrics since the last log; return fresh sums and whether a rank asked (False: ``overlap``)."""
    step, lr, stop_asked = state.global_step, parts.optimizer.param_groups[0]["lr"], bool(parts.should_stop())
    shown_epoch = state.epoch - (state.batch_in_epoch == 0 and state.epoch > 0)  # the last step's, after its epoch
    window_metrics = tally.window_metrics.compute()
    closed = tally.guard.new_window()
    reduce = tally.window.reduce_async(parts.strategy, stop_asked)  # read at once below unless ``overlap``

    def log() -> bool:
        sums = reduce()
        asked = sums.pop() > 0
        tally.guard.check(sums, parts.strategy, f"the train/loss log of step {step}", closed)
        loss = mean_loss(sums)
        report.log({"train/loss": loss, "lr": lr, **tally.accuracy(sums, "train/step_"), **window_metrics}, step)
        report.progress.show(step, epoch=shown_epoch, loss=loss)
        return asked

    if overlap:
        report.pending = log
        return RunningSums(parts.strategy.output_device), False
    return RunningSums(parts.strategy.output_device), log()


def _stop_if_asked(parts: LoopParts, state: TrainState, tally: Tally, report: _Report, *, settle: bool) -> None:
    """When the strategy's stop decision says so: log the step whose reduction is still running, checkpoint with
    reason ``"signal"``, then raise ``Interrupted``.

    Under several ranks a log step's values are reduced while the next step trains (``report.pending``). A stop
    decided at that log step would otherwise checkpoint without them: the checkpoint's count of recorded values
    would leave them out, the window they came from is already emptied, and a resume starts after that step, so
    its ``train/loss`` and ``lr`` were lost. Every rank has the same pending log, so the reduction it waits for is
    one collective."""
    if parts.strategy.reduce_stop_decision(parts.should_stop(), settle=settle):
        report.finish_pending()
        _checkpoint(parts, state, "signal", tally)
        signum, rank = stop_origin(parts.strategy.stop_code)
        raise Interrupted(signum or 2, rank=rank if parts.strategy.world_size > 1 and signum else None)


def _checkpoint(parts: LoopParts, state: TrainState, reason: str, tally: Tally) -> None:
    """Record the sums and metric states (collectives on every rank), then save; nothing non-finite is saved (§14)."""
    if parts.on_checkpoint is None:
        return
    strategy = parts.strategy
    state.epoch_sums = tally.epoch.reduced_sums(strategy) if tally.epoch is not None else None
    state.window_sums = tally.window.reduced_sums(strategy)
    tally.guard.check(state.window_sums, strategy, f"the {reason} checkpoint of step {state.global_step}")
    if not tally.guard.weights_finite(parts.model.parameters(), strategy, state.global_step):
        return
    state.metric_states = tally.metric_states()
    parts.on_checkpoint(state, reason)

"""The loop's running tallies: loss, non-finite steps and samples on the device, and the train metrics beside them.

Reading a value from the device each step would stall the GPU, and a collective per step would cost as much as
the step on a small model: tallies stay on the device and are reduced only when a value is logged or checked.
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.tensor import DTensor

from runner.errors import TrainingError
from runner.training.metrics import MetricPlan, MetricSet

if TYPE_CHECKING:
    from tqdm import tqdm

    from runner.strategies.base import Strategy
    from runner.training.batches import Batch, BatchIO, ModelOutput
    from runner.training.metrics import MetricStates


class RunningSums:
    """Running float64 sums on ``device`` (``[loss, clipped norm, loss count, correct, predicted]``), reduced in one
    collective; the norm sum turns non-finite with a step's norm; ``start`` restores rank-reduced sums."""

    SIZE = 5

    def __init__(self, device: torch.device, start: list[float] | None = None):
        self.sums = torch.zeros(self.SIZE, dtype=torch.float64, device=device)
        if start:  # rank-reduced sums restored from a checkpoint, held by rank 0 only
            kept = start[: self.SIZE]
            self.sums[: len(kept)] += torch.tensor(kept, dtype=torch.float64, device=device)

    def add(self, loss_sum: torch.Tensor, count: torch.Tensor | float) -> None:
        """Add one micro-batch: its summed loss and what the loss's mean divides it by (scalars)."""
        self.sums[0] += loss_sum.to(torch.float64)
        self.sums[2] += count

    def add_norm(self, norm: torch.Tensor) -> None:
        """Add one step's (clipped) gradient norm, a scalar on the device."""
        self.sums[1] += norm

    def add_correct(self, correct: torch.Tensor, total: int) -> None:
        """Add one micro-batch's correct predictions (a scalar on the device) out of ``total`` targets."""
        self.sums[3] += correct
        self.sums[4] += total

    def reduce_async(self, strategy: Strategy, stop_asked: bool) -> Callable[[], list[float]]:
        """:meth:`reduced_sums` started now and read by calling the result, with one more entry at the end: how many
        ranks were asked to stop (``stop_asked``), in the same collective."""
        result = strategy.all_reduce_sum_async(torch.cat([self.sums, self.sums.new_tensor([float(stop_asked)])]))
        return lambda: result().tolist()

    def reduced_sums(self, strategy: Strategy) -> list[float]:
        """The sums over ranks (a collective), as floats."""
        return strategy.all_reduce_sum(self.sums.clone()).tolist()


def mean_loss(sums: list[float]) -> float:
    """``loss sum / loss count`` of reduced sums: the loss's mean (``nan`` without a count)."""
    return sums[0] / sums[2] if sums[2] else math.nan


def count_correct(prediction: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Correct class predictions of a batch, a scalar on the device: classes on dim 1 of ``prediction``, as
    torchmetrics' multiclass accuracy reads logits ``(B, C, ...)`` against labels ``(B, ...)``."""
    predicted = prediction.detach().argmax(1)  # a sequence model's (tokens, classes) takes its labels flattened
    return (predicted == (target.reshape(predicted.shape) if target.numel() == predicted.numel() else target)).sum()


def accuracy_of(sums: list[float]) -> float:
    """``correct / total`` of reduced sums (``nan`` without predictions)."""
    return sums[3] / sums[4] if sums[4] else math.nan


@dataclass
class Tally:
    """What the loop adds up since the last ``train/loss`` log and over the epoch in progress, with the non-finite
    guard."""

    window: RunningSums
    window_metrics: MetricSet
    epoch_metrics: MetricSet
    guard: NonFiniteGuard
    counted_accuracy: bool = False
    epoch: RunningSums | None = None

    def start_epoch(self, sums: RunningSums) -> None:
        self.epoch = sums

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

    def add(
        self, loss_sum: torch.Tensor, count: torch.Tensor | float, batch: Batch, out: ModelOutput, io: BatchIO
    ) -> None:
        """Add a micro-batch to window and epoch: device work only, no host read, no collective."""
        sums = (self.window, self.epoch) if self.epoch is not None else (self.window,)
        for running in sums:
            running.add(loss_sum, count)
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


class Progress:
    """Training progress on rank 0: ``style`` auto, bar, lines or off; plain lines at most every ``every_s``."""

    def __init__(self, style: str, total: int, *, enabled: bool = True, initial: int = 0, every_s: float = 10.0):
        self.enabled = enabled and style != "off"
        self.total = total
        self.done = initial
        self.every_s = every_s
        self.samples = 0  # global samples of the epoch in progress
        self._start = time.perf_counter()
        self._excluded_s = 0.0  # seconds spent in phases (evaluation), left out of samples/s
        self._last_line = -math.inf  # the first line shows at once, however recently the machine booted
        self._values = ""
        self._bar: tqdm | None = None
        use_bar = style == "bar" or (style == "auto" and sys.stderr.isatty())
        if self.enabled and use_bar:
            from tqdm.auto import tqdm

            self._bar = tqdm(
                total=total,
                initial=initial,
                unit="step",
                dynamic_ncols=True,
                leave=False,
                desc="train",
                file=sys.stderr,
            )

    def start_epoch(self) -> None:
        """Count samples and seconds from here: an epoch's rate is the one definition of samples/s."""
        self.samples, self._start, self._excluded_s = 0, time.perf_counter(), 0.0

    @property
    def epoch_seconds(self) -> float:
        """Seconds of training since :meth:`start_epoch`, phases (evaluation) left out: metric ``epoch_time_s``."""
        return time.perf_counter() - self._start - self._excluded_s

    @property
    def samples_per_s(self) -> float:
        """Global training samples per second of the epoch so far (0 before its first step): the progress line's
        figure and, at the epoch's end, metric ``samples_per_s``."""
        elapsed = self.epoch_seconds
        return self.samples / elapsed if elapsed > 0 and self.samples else 0.0

    def update(self, n: int = 1, *, samples: int = 0) -> None:
        """Advance by ``n`` optimizer steps that trained on ``samples`` global samples."""
        self.done += n
        self.samples += samples
        if self._bar is not None:
            self._bar.set_postfix_str(self._postfix(), refresh=False)
            self._bar.update(n)

    def show(self, step: int | None = None, /, **values: Any) -> None:
        """Display the latest values (loss, epoch, ...): as the bar's postfix or as a plain line labelled with the
        ``step`` they are of (default: the steps done; a log step's values are shown a step later under ddp)."""
        if not self.enabled:
            return
        self._values = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in values.items())
        if self._bar is not None:
            self._bar.set_postfix_str(self._postfix(), refresh=False)
            return
        now = time.monotonic()
        if now - self._last_line >= self.every_s or self.done >= self.total:
            self._last_line = now
            shown = self.done if step is None else step
            print(f"step {shown}/{self.total} {self._postfix()}", file=sys.stderr, flush=True)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Show ``name`` as the phase while the block runs (its time left out of samples/s), then ``train`` again."""
        start = time.perf_counter()
        if self.enabled and self._bar is None:
            print(f"step {self.done}/{self.total} {name}", file=sys.stderr, flush=True)
        if self._bar is not None:
            self._bar.set_description_str(name, refresh=True)
        try:
            yield
        finally:
            self._excluded_s += time.perf_counter() - start
            if self._bar is not None:
                self._bar.set_description_str("train", refresh=True)

    def close(self) -> None:
        """Remove the bar (plain lines need no closing)."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def _postfix(self) -> str:
        rate = f"samples/s={self.samples_per_s:.4g}" if self.samples else ""
        return " ".join(part for part in (self._values, rate) if part)


HINT = (
    'lower optim.lr, set train.clip_grad_norm, use train.amp = "bf16" instead of fp16, or look for inf/nan in '
    'the data; train.on_nonfinite = "warn" goes on regardless'
)


Window = tuple[int, int, "torch.Tensor | None"]  # a closed train/loss window: its first step, steps, trail


class NonFiniteGuard:
    """Finds the first non-finite step of a ``train/loss`` window (docs/design.md §14); no norm check under fp16
    scaling."""

    def __init__(self, mode: str, device: torch.device, step: int, scaling: bool = False, window: int = 1) -> None:
        self.mode = mode
        self.device = device
        self.enabled = mode != "ignore"
        self.check_grads = self.enabled and not scaling
        self._start = step  # global step before the window's first step
        self._taken = 0  # steps of the window in the trail
        self._reported = step  # bad steps up to here were reported (warn)
        if self.enabled:
            self._trail = torch.zeros((max(1, window), 2), dtype=torch.float64, device=device)

    def end_step(self, window_sums: torch.Tensor) -> None:
        """After each optimizer step: keep the window's running ``[loss sum, norm sum]`` (a device copy)."""
        if self.enabled and self._taken < len(self._trail):
            self._trail[self._taken].copy_(window_sums[:2])
        self._taken += 1

    def new_window(self) -> Window:
        """The window's sums start afresh (after a ``train/loss`` log); returns the closed window (its first step,
        steps and trail: a device copy) for a check made after the next window began (:meth:`check`)."""
        closed = (self._start, self._taken, self._trail[: self._taken].clone() if self.enabled else None)
        self._start += self._taken
        self._taken = 0
        return closed

    def _first_bad(self, window: Window | None = None) -> tuple[int, int] | None:
        """``(step, 0 for the loss or 1 for the norm)`` of this rank's first unreported bad step (a host read)."""
        start, taken, trail = window or (self._start, self._taken, self._trail)
        assert trail is not None
        rows = trail[: min(taken, len(trail))].tolist()
        for i, row in enumerate(rows):
            step = start + i + 1
            for what, value in enumerate(row):
                if not math.isfinite(value) and step > self._reported:
                    return step, what
        return None

    def check(self, sums: list[float], strategy: Strategy, where: str, window: Window | None = None) -> None:
        """Act on the reduced sums of the window in progress or a closed ``window``; gathers every rank's first bad
        step only when something was not finite. TrainingError under ``mode = "stop"``, naming it."""
        if not self.enabled or all(math.isfinite(v) for v in sums[:2]):
            return
        firsts = [f for f in strategy.all_gather_object(self._first_bad(window)) if f is not None]
        if not firsts:
            return  # already reported (warn)
        step, kind = min(firsts)
        what = ("the loss", "the gradient norm")[kind]
        if self.mode == "stop":
            raise TrainingError(
                f'train.on_nonfinite = "stop": {what} was not finite at step {step} (found at {where}); '
                f"no checkpoint holds the non-finite weights: {HINT}"
            )
        if strategy.is_main:
            print(
                f'runner: warning: {what} was not finite at step {step} (train.on_nonfinite = "warn")', file=sys.stderr
            )
        self._reported = window[0] + window[1] if window else self._start + self._taken

    def weights_finite(self, parameters: Iterable[torch.Tensor], strategy: Strategy, step: int) -> bool:
        """Whether every weight is finite on every rank (a collective, before a checkpoint); TrainingError under
        ``stop``."""
        if not self.enabled:
            return True
        params = [p.to_local() if isinstance(p, DTensor) else p.detach() for p in parameters]  # this rank's shards
        if not params:
            return True
        local = torch.stack([torch.isfinite(p).all() for p in params]).all().logical_not()
        bad = strategy.all_reduce_sum(local.to(torch.float64).reshape(1)).item() > 0
        if not bad:
            return True
        if self.mode == "stop":
            raise TrainingError(f'train.on_nonfinite = "stop": the weights are not finite at step {step}: {HINT}')
        if strategy.is_main:
            print(
                f"runner: warning: no checkpoint at step {step}: the weights are not finite; the last one is kept",
                file=sys.stderr,
            )
        return False


def lr_problem(optimizer: torch.optim.Optimizer) -> str | None:
    """Why the optimizer's learning rates cannot train (one is negative, inf or nan), or ``None``."""
    for i, group in enumerate(optimizer.param_groups):
        lr = float(group["lr"])  # a Python float, or a 0-d tensor for a tensor lr: no device sync on the CPU
        if not math.isfinite(lr) or lr < 0:
            return f"the learning rate of parameter group {i} became {lr:g}: it must stay finite and >= 0"
    return None


def check_lr(optimizer: torch.optim.Optimizer, scheduler: object) -> None:
    """TrainingError naming the scheduler when it drove a learning rate negative or non-finite."""
    problem = lr_problem(optimizer)
    if problem is not None:
        epoch = getattr(scheduler, "last_epoch", "?")
        raise TrainingError(f"{type(scheduler).__name__} after {epoch} step(s): {problem}; check scheduler.kwargs")

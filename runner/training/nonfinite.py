"""``train.on_nonfinite``: a non-finite loss or gradient norm, found in the running sums where the loop reads them.

A non-finite value stays non-finite in a sum, so the loop's running sums (:mod:`runner.training.sums`)
carry the check at no cost: the loss sum holds every micro-batch's loss, and the gradient-norm sum
every step's norm where one is computed anyway (``train.clip_grad_norm``). They are reduced over ranks
and read at every ``train/loss`` log, every checkpoint and every epoch end, so the ranks agree
without an extra collective (docs/design.md §14). Between those points the guard only copies the
window's two running sums into a small device buffer after each step (one device copy, no host
read), from which the first bad step is found when something was not finite. There:

* ``stop`` (the default) raises :class:`~runner.errors.TrainingError` naming the first bad
  step, before anything non-finite is logged or checkpointed (exit 1, the run FAILED);
* ``warn`` prints the step once and goes on;
* ``ignore`` checks nothing.

No gradient norm is computed for the check alone: without clipping, non-finite gradients show as a
non-finite loss one step later (the weights they made are not finite), and under fp16 gradient
scaling the norm is not checked (the scaler skips inf steps by design). Before each checkpoint
(``stop`` and ``warn``) the weights themselves are checked, so a checkpoint of non-finite weights
never replaces a good one.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
from torch.distributed.tensor import DTensor

from runner.errors import TrainingError

if TYPE_CHECKING:
    from runner.strategies.base import Strategy

HINT = (
    'lower optim.lr, set train.clip_grad_norm, use train.amp = "bf16" instead of fp16, or look for inf/nan in '
    'the data; train.on_nonfinite = "warn" goes on regardless'
)


class NonFiniteGuard:
    """Finds the first non-finite step of a ``train/loss`` window (see the module docstring).

    Args:
        mode: ``train.on_nonfinite``: ``"stop"``, ``"warn"`` or ``"ignore"``.
        device: Where the window's sums live (the strategy's output device).
        step: Optimizer steps taken before this run of the loop (``TrainState.global_step``).
        scaling: fp16 gradient scaling is on: the gradient norm is not checked (the scaler skips inf steps).
        window: Most steps between two ``train/loss`` logs (``train.log_every_n_steps``).
    """

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

    def new_window(self) -> None:
        """The window's sums start afresh (after a ``train/loss`` log)."""
        self._start += self._taken
        self._taken = 0

    def _first_bad(self) -> tuple[int, int] | None:
        """``(step, 0 for the loss or 1 for the norm)`` of this rank's first unreported bad step (a host read)."""
        rows = self._trail[: min(self._taken, len(self._trail))].tolist()
        for i, row in enumerate(rows):
            step = self._start + i + 1
            for what, value in enumerate(row):
                if not math.isfinite(value) and step > self._reported:
                    return step, what
        return None

    def check(self, sums: list[float], strategy: Strategy, where: str) -> None:
        """Act on reduced running sums (``[loss, norm sum, ...]``, the same on every rank).

        Gathers every rank's first bad step (a collective, only when something was not finite).

        Raises:
            TrainingError: ``mode = "stop"``; names the first non-finite step and what was not finite.
        """
        if not self.enabled or all(math.isfinite(v) for v in sums[:2]):
            return
        firsts = [f for f in strategy.all_gather_object(self._first_bad()) if f is not None]
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
        self._reported = self._start + self._taken

    def weights_finite(self, parameters: Iterable[torch.Tensor], strategy: Strategy, step: int) -> bool:
        """Whether every weight is finite on every rank (a collective); before a checkpoint.

        Raises:
            TrainingError: ``mode = "stop"`` and some weight is not finite.
        """
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
    """Stop training when the scheduler drove a learning rate negative or non-finite (every ``on_nonfinite``).

    Raises:
        TrainingError: Naming the scheduler and the learning rate (exit 1, the run FAILED).
    """
    problem = lr_problem(optimizer)
    if problem is not None:
        epoch = getattr(scheduler, "last_epoch", "?")
        raise TrainingError(f"{type(scheduler).__name__} after {epoch} step(s): {problem}; check scheduler.kwargs")

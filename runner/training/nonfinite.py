"""``train.on_nonfinite``: a non-finite loss or gradient norm, flagged on the device, read where the loop already syncs.

Every step the guard records on the device whether a micro-batch loss or the step's gradient
norm was not finite, and the first such step (no host-device synchronisation: a few tiny
kernels). The flag rides in the loop's running sums (their middle entry), which are reduced
over ranks and read anyway at every ``train/loss`` log, every checkpoint and every epoch end,
so the ranks agree on it without an extra collective (docs/design.md §14). There:

* ``stop`` (the default) raises :class:`~runner.errors.TrainingError` naming the first bad
  step, before anything non-finite is logged or checkpointed (exit 1, the run FAILED);
* ``warn`` prints the step once and goes on;
* ``ignore`` checks nothing.

Before each checkpoint (``stop`` and ``warn``) the weights themselves are checked, so a
checkpoint of non-finite weights never replaces a good one. Under fp16 gradient scaling the
gradient norm is not checked: the scaler skips steps with inf gradients by design.
"""

from __future__ import annotations

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
    """Device-side flags of non-finite losses and gradient norms (see the module docstring).

    Args:
        mode: ``train.on_nonfinite``: ``"stop"``, ``"warn"`` or ``"ignore"``.
        device: Where the flags live (the strategy's output device).
        step: Optimizer steps taken before this run of the loop (``TrainState.global_step``).
        scaling: fp16 gradient scaling is on: the gradient norm is not checked (the scaler skips inf steps).
    """

    def __init__(self, mode: str, device: torch.device, step: int, scaling: bool = False) -> None:
        self.mode = mode
        self.device = device
        self.enabled = mode != "ignore"
        self.check_grads = self.enabled and not scaling
        if self.enabled:
            self._step = torch.tensor(step, dtype=torch.int64, device=device)
            self._loss_bad = torch.zeros((), dtype=torch.bool, device=device)
            self._first = torch.full((2,), -1, dtype=torch.int64, device=device)  # first bad step: (loss, grad)

    def observe_loss(self, loss: torch.Tensor) -> None:
        """Note one micro-batch's loss (a scalar on the device)."""
        if self.enabled:
            self._loss_bad |= ~torch.isfinite(loss.detach())

    def end_step(self, grad_norm: torch.Tensor | None) -> torch.Tensor | None:
        """Close an optimizer step; returns ``1.0`` (float64, on the device) if it was non-finite, else ``0.0``."""
        if not self.enabled:
            return None
        if isinstance(grad_norm, DTensor):  # fsdp: a norm over sharded gradients (a collective, on every rank)
            grad_norm = grad_norm.full_tensor()
        grad_bad = (
            ~torch.isfinite(grad_norm)
            if grad_norm is not None and self.check_grads
            else torch.zeros_like(self._loss_bad)
        )
        self._step += 1
        bad = torch.stack([self._loss_bad, grad_bad])
        self._first = torch.where((self._first < 0) & bad, self._step, self._first)
        self._loss_bad = torch.zeros_like(self._loss_bad)
        return bad.any().to(torch.float64)

    def check(self, bad_steps: float, strategy: Strategy, where: str) -> None:
        """Act on ``bad_steps`` (non-finite steps, summed over ranks) read from the running sums.

        Call on every rank with the same value (it comes from a reduction). Gathers the first bad
        steps of every rank (a collective, only when something was non-finite).

        Raises:
            TrainingError: ``mode = "stop"``; names the first non-finite step and what was not finite.
        """
        if not self.enabled or bad_steps <= 0:
            return
        firsts = strategy.all_gather_object([int(v) for v in self._first.tolist()])
        loss_at = min((f[0] for f in firsts if f[0] >= 0), default=None)
        grad_at = min((f[1] for f in firsts if f[1] >= 0), default=None)
        if loss_at is None and grad_at is None:
            return  # already reported (warn)
        step = min(s for s in (loss_at, grad_at) if s is not None)
        what = "the loss" if loss_at == step else "the gradient norm"
        if self.mode == "stop":
            raise TrainingError(
                f'train.on_nonfinite = "stop": {what} was not finite at step {step} (found at {where}); '
                f"no checkpoint holds the non-finite weights: {HINT}"
            )
        if strategy.is_main:
            print(
                f'runner: warning: {what} was not finite at step {step} (train.on_nonfinite = "warn")', file=sys.stderr
            )
        self._first.fill_(-1)

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


def grad_norm(parameters: Iterable[torch.Tensor]) -> torch.Tensor | None:
    """Global L2 norm of the gradients (a scalar on their device, no host sync), or ``None`` without gradients."""
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return None
    total_norm = getattr(torch.nn.utils, "get_total_norm", None)  # torch >= 2.6
    if total_norm is not None:
        return total_norm(grads, 2.0)
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.detach()) for g in grads]))

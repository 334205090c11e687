"""Build the optimizer and LR scheduler named by a spec (losses: :mod:`runner.training.losses`; amp: ``precision``)."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from runner.errors import SpecError, SpecIssue, first_line

if TYPE_CHECKING:
    from torch.optim.lr_scheduler import LRScheduler

    from runner.spec.schema import OptimSpec, SchedulerSpec

_Built = TypeVar("_Built")

_OPTIMIZERS = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}
_SCHEDULERS = {
    "step": torch.optim.lr_scheduler.StepLR,
    "multistep": torch.optim.lr_scheduler.MultiStepLR,
    "exponential": torch.optim.lr_scheduler.ExponentialLR,
    "cosine": torch.optim.lr_scheduler.CosineAnnealingLR,
    "onecycle": torch.optim.lr_scheduler.OneCycleLR,
    "linear": torch.optim.lr_scheduler.LinearLR,
}


def build_optimizer(
    optim_spec: OptimSpec, params: Iterable[torch.nn.Parameter] | Iterable[dict[str, Any]]
) -> torch.optim.Optimizer:
    """Create the ``torch.optim`` optimizer of ``[optim]`` over ``params``.

    Args:
        params: Parameters (or parameter groups) of the unwrapped model.

    Returns:
        The optimizer; ``lr`` is the base learning rate.

    Raises:
        SpecError: ``optim.kwargs`` holds an argument the optimizer does not take.
    """
    cls = _OPTIMIZERS[optim_spec.name]
    kwargs: dict[str, Any] = {"lr": optim_spec.lr, "weight_decay": optim_spec.weight_decay}
    if optim_spec.name == "sgd":
        kwargs["momentum"] = optim_spec.momentum
    kwargs.update({k: tuple(v) if isinstance(v, list) else v for k, v in optim_spec.kwargs.items()})
    return _construct(cls, "optim.kwargs", params, **kwargs)


def build_scheduler(
    scheduler_spec: SchedulerSpec | None, optimizer: torch.optim.Optimizer, total_steps: int, epochs: int
) -> LRScheduler | None:
    """Create the LR scheduler of ``[scheduler]``, or ``None`` when there is none.

    ``cosine`` defaults ``T_max`` to the number of scheduler calls in the run (epochs or
    optimizer steps, per ``interval``); ``onecycle`` defaults ``max_lr`` to the optimizer's
    lr and ``total_steps`` to the run's optimizer steps (it always steps per batch).

    Raises:
        SpecError: ``scheduler.kwargs`` holds an argument the scheduler does not take or lacks a required one.
    """
    if scheduler_spec is None:
        return None
    cls = _SCHEDULERS[scheduler_spec.name]
    kwargs = dict(scheduler_spec.kwargs)
    calls = total_steps if scheduler_spec.interval == "step" else epochs
    if scheduler_spec.name == "cosine":
        kwargs.setdefault("T_max", max(1, calls))
    if scheduler_spec.name == "onecycle":
        kwargs.setdefault("max_lr", optimizer.param_groups[0]["lr"])
        kwargs.setdefault("total_steps", max(1, total_steps))
    return _construct(cls, "scheduler.kwargs", optimizer, **kwargs)


def scheduler_class(scheduler_spec: SchedulerSpec) -> type:
    """The ``torch.optim.lr_scheduler`` class of ``[scheduler]`` (e.g. ``StepLR`` for ``name = "step"``)."""
    cls: type = _SCHEDULERS[scheduler_spec.name]
    return cls


def scheduler_interval(scheduler_spec: SchedulerSpec | None) -> str:
    """``"step"`` or ``"epoch"``: when the scheduler steps (``onecycle`` always per step)."""
    if scheduler_spec is None:
        return "epoch"
    return "step" if scheduler_spec.name == "onecycle" else scheduler_spec.interval


def _construct(cls: Callable[..., _Built], key: str, first: object, **kwargs: Any) -> _Built:  # kwargs: TOML values
    try:
        return cls(first, **kwargs)
    except TypeError as exc:
        sig = inspect.signature(cls.__init__)
        raise SpecError(SpecIssue(None, None, key, f"{first_line(exc)}; {cls.__name__} takes {sig}")) from None
    except ValueError as exc:
        raise SpecError(SpecIssue(None, None, key, f"{cls.__name__}: {first_line(exc)}")) from None

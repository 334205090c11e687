"""The Strategy interface: how one process runs the model (device, wrapping, collectives, the stop decision).

The training loop talks only to :class:`Strategy`; everything that differs
between modes lives in one file per mode:

========  ==========================  ==================  ========================
mode      model                       inputs go to        collectives
========  ==========================  ==================  ========================
none      as is, on ``device``        ``device``          identity
dp        ``torch.nn.DataParallel``   ``cuda:0``          identity (one process)
ddp       ``DistributedDataParallel`` ``cuda:LOCAL_RANK`` torch.distributed
                                      or cpu
========  ==========================  ==================  ========================

Device indices are those after :func:`runner.devices.env.apply_device_env` has
narrowed ``CUDA_VISIBLE_DEVICES``: the chosen GPUs are ``cuda:0 .. cuda:n-1``.

A strategy is built from its own settings (the resolved
:class:`~runner.devices.resolve.DevicePlan`, the ``[parallel]`` table, the launcher's
environment) and assumes them valid: the rules that tie them together are checked once,
by the schema and by device resolution.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, ClassVar, TypeVar

import torch
from torch import nn

from runner.strategies.state_dicts import unwrap

if TYPE_CHECKING:
    from types import TracebackType

    from runner.devices.resolve import DevicePlan

T = TypeVar("T")


class Strategy(ABC):
    """How one process runs the model: device, wrapping, collectives, the stop decision.

    Use as ``strategy.setup()`` ... ``strategy.teardown()`` (or ``with strategy:``).
    Modelled on Lightning Fabric's ``Strategy`` (``strategies/strategy.py``).

    Attributes:
        mode: ``"none"``, ``"dp"`` or ``"ddp"``.
        plan: The resolved device plan.
        device: Where inputs go.
        output_device: Where model outputs land (put loss targets here).
    """

    mode: ClassVar[str]

    def __init__(self, plan: DevicePlan) -> None:
        self.plan = plan
        self.device = torch.device("cuda", 0) if plan.accelerator == "cuda" else torch.device("cpu")
        self.output_device = self.device

    # process layout -------------------------------------------------------
    @property
    @abstractmethod
    def rank(self) -> int:
        """Global rank of this process (0 .. world_size-1)."""

    @property
    @abstractmethod
    def local_rank(self) -> int:
        """Rank of this process on its node."""

    @property
    @abstractmethod
    def world_size(self) -> int:
        """Number of processes."""

    @property
    def is_main(self) -> bool:
        """Whether this is rank 0 (the process that logs and saves)."""
        return self.rank == 0

    # lifecycle ------------------------------------------------------------
    @abstractmethod
    def setup(self) -> None:
        """Prepare this process (join the process group, pick the device)."""

    @abstractmethod
    def teardown(self) -> None:
        """Release what :meth:`setup` took; safe to call twice."""

    def __enter__(self) -> Strategy:
        self.setup()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.teardown()

    # model ----------------------------------------------------------------
    @abstractmethod
    def wrap(self, module: nn.Module) -> nn.Module:
        """Move ``module`` to :attr:`device` and wrap it for this mode.

        Args:
            module: The user's model.

        Returns:
            The module to train with.
        """

    def unwrap(self, module: nn.Module) -> nn.Module:
        """Return the user's model inside the wrapper (for state dicts and optimizers' views)."""
        return unwrap(module)

    @abstractmethod
    def eval_module(self, wrapped: nn.Module) -> nn.Module:
        """Return the module to evaluate with (the wrapped one unless collectives would get in the way)."""

    @abstractmethod
    def no_sync(self, wrapped: nn.Module) -> contextlib.AbstractContextManager[object]:
        """Context for micro-batches before the last one of a gradient-accumulation step (no gradient sync)."""

    # collectives ----------------------------------------------------------
    @abstractmethod
    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` (any shape) over all processes; returns a new tensor on ``tensor``'s device."""

    @abstractmethod
    def barrier(self) -> None:
        """Wait for every process."""

    @abstractmethod
    def broadcast_object(self, obj: T) -> T:
        """Return rank 0's ``obj`` (picklable) on every process."""

    @abstractmethod
    def all_gather_object(self, obj: T) -> list[T]:
        """Return every rank's ``obj`` (picklable), indexed by rank."""

    @abstractmethod
    def reduce_stop_decision(self, flag: bool, *, settle: bool = False) -> bool:
        """Whether every rank stops now, given this rank's stop ``flag`` (True on all ranks or on none).

        Like Lightning Fabric's ``reduce_boolean_decision`` with ``all=False`` (any rank's
        True counts), but never on the hot path where there are peers to ask.

        Args:
            flag: Whether a stop was requested on this rank (e.g. a signal arrived).
            settle: False after a step between log steps: a strategy with peers answers from what
                was agreed so far, without a collective. True at log steps, checkpoints and epoch
                boundaries: answer for this ``flag`` on every rank before returning.

        Returns:
            The same value on every rank.
        """

"""``mode = "none"``: one process, one device; every collective is the identity."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, TypeVar

import torch
from torch import nn

from runner.strategies.base import Strategy, find_blocks, transform_blocks

if TYPE_CHECKING:
    from runner.spec.schema import TrainSpec

T = TypeVar("T")


class SingleDevice(Strategy):
    """``mode = "none"``: one process, one device (``cuda:0`` after narrowing, or cpu).

    There are no peers: the collectives return their input and the stop decision is
    answered at once (a request seen after step ``k`` stops training after step ``k``).

    Args:
        plan: The resolved device plan (its accelerator picks ``cuda:0`` or cpu).
    """

    mode = "none"

    @property
    def rank(self) -> int:
        """Always 0."""
        return 0

    @property
    def local_rank(self) -> int:
        """Always 0."""
        return 0

    @property
    def world_size(self) -> int:
        """Always 1."""
        return 1

    def setup(self) -> None:
        """Nothing to prepare for one process."""

    def teardown(self) -> None:
        """Nothing to release."""

    def wrap(self, module: nn.Module, train: TrainSpec | None = None) -> nn.Module:
        """Move ``module`` to :attr:`device`; no wrapper. Checkpoints its blocks and compiles it as ``train`` asks."""
        module = module.to(self.device)
        transform_blocks(find_blocks(module, None), train, compile_blocks=False)
        if train is not None and train.compile:
            module.compile(backend=train.compile_backend)
        return module

    def eval_module(self, wrapped: nn.Module) -> nn.Module:
        """The model itself."""
        return wrapped

    def no_sync(self, wrapped: nn.Module) -> contextlib.AbstractContextManager[object]:
        """Nothing to skip: a null context."""
        return contextlib.nullcontext()

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` itself (the sum over one process)."""
        return tensor

    def barrier(self) -> None:
        """Nothing to wait for."""

    def broadcast_object(self, obj: T) -> T:
        """``obj`` itself."""
        return obj

    def all_gather_object(self, obj: T) -> list[T]:
        """``[obj]``."""
        return [obj]

    def reduce_stop_decision(self, flag: bool, *, settle: bool = False) -> bool:
        """``flag`` itself, at once, whatever ``settle`` says."""
        return flag

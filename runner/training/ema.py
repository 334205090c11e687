"""An exponential moving average of the weights (``train.ema_decay``): updated after every optimizer step,
validated with, checkpointed and resumed.

The average is torch's (``torch.optim.swa_utils.get_ema_multi_avg_fn``: one ``_foreach_lerp_`` over the
parameters). It is kept beside each parameter in the parameter's own layout: under fsdp each rank averages only its
shard, so the average costs one more copy of the rank's parameters, not of the whole model, and a checkpoint saves
it through ``torch.distributed.checkpoint`` as the shards of the model are saved (resharded on load, like them).
Its keys are the parameters' names without wrapper infixes (compile, activation checkpointing), the same in every
mode, so a checkpoint's average loads into any mode and ``runner export --ema`` pairs it with the model's buffers.
Buffers (BatchNorm's running statistics) are not averaged: validation takes the live model's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
from torch import nn
from torch.distributed.tensor import DTensor

_WRAPPER_INFIXES = ("_orig_mod.", "_checkpoint_wrapped_module.")  # torch.compile's and checkpoint_wrapper's


def clean_name(name: str) -> str:
    """A parameter's name without the infixes that wrappers add, as ``get_state_dict`` names it."""
    for infix in _WRAPPER_INFIXES:
        name = name.replace(infix, "")
    return name


class Ema:
    """The moving average of ``model``'s parameters with ``decay``, started at their current values."""

    def __init__(self, model: nn.Module, decay: float) -> None:
        from torch.optim.swa_utils import get_ema_multi_avg_fn

        named = [(clean_name(name), param) for name, param in model.named_parameters()]
        self.names = [name for name, _ in named]
        self.params = [param for _, param in named]
        self.average = [param.detach().clone() for param in self.params]
        self._update = get_ema_multi_avg_fn(decay)

    @torch.no_grad()
    def update(self) -> None:
        """Move the average towards the parameters after an optimizer step."""
        self._update(_local(self.average), _local(self.params), None)

    def state(self) -> dict[str, torch.Tensor]:
        """The average by parameter name, for DCP to save, or to fill in place on load."""
        return dict(zip(self.names, self.average, strict=True))

    @contextlib.contextmanager
    def applied(self) -> Iterator[None]:
        """The model holds the average inside the block (validation), its own parameters again after it."""
        kept = [param.detach().clone() for param in self.params]
        self.copy_to_model()
        try:
            yield
        finally:
            with torch.no_grad():
                torch._foreach_copy_(_local(self.params), _local(kept))

    @torch.no_grad()
    def copy_to_model(self) -> None:
        """Give the model the average for good (the model logged at the end)."""
        torch._foreach_copy_(_local(self.params), _local(self.average))


def _local(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Each tensor itself, or this rank's shard of a DTensor (fsdp's parameters), to update in place."""
    return [t.to_local() if isinstance(t, DTensor) else t for t in tensors]

"""The Strategy interface: how one process runs the model (device, wrapping, collectives).

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

Device indices are those after :func:`runner.devices.resolve.apply_device_env` has
narrowed ``CUDA_VISIBLE_DEVICES``: the chosen GPUs are ``cuda:0 .. cuda:n-1``.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

from runner.devices.resolve import DevicePlan
from runner.strategies.state_dicts import unwrap


class Strategy:
    """How one process runs the model: device, wrapping, collectives. Base: one process, no peers.

    Use as ``strategy.setup()`` ... ``strategy.teardown()`` (or ``with strategy:``).

    Attributes:
        mode: ``"none"``, ``"dp"`` or ``"ddp"``.
        plan: The resolved device plan.
        device: Where inputs go.
        output_device: Where model outputs land (put loss targets here).
    """

    mode = "none"

    def __init__(self, spec: Any, plan: DevicePlan):
        self.spec = spec
        self.plan = plan
        self.device = torch.device("cuda", 0) if plan.accelerator == "cuda" else torch.device("cpu")
        self.output_device = self.device

    # process layout -------------------------------------------------------
    @property
    def rank(self) -> int:
        """Global rank of this process (0 .. world_size-1)."""
        return 0

    @property
    def local_rank(self) -> int:
        """Rank of this process on its node."""
        return 0

    @property
    def world_size(self) -> int:
        """Number of processes."""
        return 1

    @property
    def is_main(self) -> bool:
        """Whether this is rank 0 (the process that logs and saves)."""
        return self.rank == 0

    # lifecycle ------------------------------------------------------------
    def setup(self) -> None:
        """Prepare this process (nothing for one process)."""

    def teardown(self) -> None:
        """Release what :meth:`setup` took; safe to call twice."""

    def __enter__(self) -> Strategy:
        self.setup()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.teardown()

    # model ----------------------------------------------------------------
    def wrap(self, module: nn.Module) -> nn.Module:
        """Move ``module`` to :attr:`device` and wrap it for this mode.

        Args:
            module: The user's model.

        Returns:
            The module to train with.
        """
        return module.to(self.device)

    def unwrap(self, module: nn.Module) -> nn.Module:
        """Return the user's model inside the wrapper (for state dicts and optimizers' views)."""
        return unwrap(module)

    def eval_module(self, wrapped: nn.Module) -> nn.Module:
        """Return the module to evaluate with (the wrapped one unless collectives would get in the way)."""
        return wrapped

    def no_sync(self, wrapped: nn.Module) -> contextlib.AbstractContextManager:
        """Context for micro-batches before the last one of a gradient-accumulation step (no gradient sync)."""
        return contextlib.nullcontext()

    # collectives ----------------------------------------------------------
    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over all processes; returns a tensor on ``tensor``'s device (identity here)."""
        return tensor

    def barrier(self) -> None:
        """Wait for every process (no-op here)."""

    def broadcast_object(self, obj: Any) -> Any:
        """Return rank 0's ``obj`` on every process (identity here)."""
        return obj

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Return every rank's ``obj``, indexed by rank (``[obj]`` here)."""
        return [obj]

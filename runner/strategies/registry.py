"""Pick the strategy of a parallel mode: ``none``, ``dp`` or ``ddp``."""

from __future__ import annotations

from typing import Any

from runner.devices.resolve import DevicePlan
from runner.strategies.base import Strategy
from runner.strategies.ddp import DDPStrategy
from runner.strategies.dp import DataParallelStrategy
from runner.strategies.single import SingleDevice

_STRATEGIES: dict[str, type[Strategy]] = {"none": SingleDevice, "dp": DataParallelStrategy, "ddp": DDPStrategy}


def make_strategy(spec: Any, plan: DevicePlan) -> Strategy:
    """Build the strategy for ``plan.mode``.

    Args:
        spec: The validated :class:`~runner.spec.schema.ExperimentSpec`.
        plan: From :func:`runner.devices.resolve.resolve_devices` (already applied to the environment).

    Returns:
        A :class:`Strategy`; call ``setup()`` before use and ``teardown()`` in ``finally``.

    Raises:
        DeviceError: The plan's accelerator cannot run the mode (dp on CPU, nccl on CPU).
    """
    return _STRATEGIES[plan.mode](spec, plan)

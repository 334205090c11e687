"""How the model is wrapped and how ranks talk: one strategy per parallel mode, picked by :func:`make_strategy`.

:data:`STRATEGIES` is the one table of modes outside the spec's traits: a new mode is a strategy class and one line
here (docs/design.md, package map).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from runner.devices.environment import LauncherEnvironment
from runner.strategies.base import DataParallelStrategy, SingleDevice, Strategy
from runner.strategies.distributed import DDPStrategy, FSDPStrategy

if TYPE_CHECKING:
    from runner.devices.resolve import DevicePlan
    from runner.spec.schema_parallel import ParallelSpec

STRATEGIES: dict[str, type[Strategy]] = {
    "none": SingleDevice,
    "dp": DataParallelStrategy,
    "ddp": DDPStrategy,
    "fsdp": FSDPStrategy,
}


def make_strategy(
    parallel: ParallelSpec, plan: DevicePlan, env: LauncherEnvironment | None = None, amp: str = "no"
) -> Strategy:
    """The strategy of ``plan.mode``; ``setup()`` it before use and ``teardown()`` it in ``finally``.

    ``env`` ``None`` stands for a process no launcher started (ddp's ``setup`` refuses); fsdp gathers in ``amp``'s
    dtype.
    """
    launcher = LauncherEnvironment.detect({}) if env is None else env
    return STRATEGIES[plan.mode].create(parallel, plan, launcher, amp)

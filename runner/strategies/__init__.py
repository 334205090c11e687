"""How the model is wrapped and how ranks talk: one strategy per parallel mode, picked by :func:`make_strategy`."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from runner.launch.environment import LauncherEnvironment
from runner.strategies.base import DataParallelStrategy, SingleDevice, Strategy
from runner.strategies.distributed import DDPStrategy, FSDPStrategy

if TYPE_CHECKING:
    from runner.devices.resolve import DevicePlan
    from runner.spec.schema_parallel import ParallelSpec

_Builder = Callable[["ParallelSpec", "DevicePlan", LauncherEnvironment, str], Strategy]


STRATEGIES: dict[str, _Builder] = {
    "none": lambda parallel, plan, env, amp: SingleDevice(plan),
    "dp": lambda parallel, plan, env, amp: DataParallelStrategy(plan, parallel),
    "ddp": lambda parallel, plan, env, amp: DDPStrategy(plan, parallel, env),
    "fsdp": lambda parallel, plan, env, amp: FSDPStrategy(plan, parallel, env, amp),
}


def make_strategy(
    parallel: ParallelSpec, plan: DevicePlan, env: LauncherEnvironment | None = None, amp: str = "no"
) -> Strategy:
    """The strategy of ``plan.mode``; ``setup()`` it before use and ``teardown()`` it in ``finally``.

    ``env`` ``None`` stands for a process no launcher started (ddp's ``setup`` refuses); fsdp gathers in ``amp``'s
    dtype.
    """
    launcher = LauncherEnvironment.detect({}) if env is None else env
    return STRATEGIES[plan.mode](parallel, plan, launcher, amp)

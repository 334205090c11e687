"""Pick the strategy of a parallel mode (``none``, ``dp``, ``ddp``, ``fsdp``) and build it from its own settings."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from runner.launch.environment import LauncherEnvironment
from runner.strategies.base import Strategy
from runner.strategies.ddp import DDPStrategy
from runner.strategies.dp import DataParallelStrategy
from runner.strategies.single import SingleDevice

if TYPE_CHECKING:
    from runner.devices.resolve import DevicePlan
    from runner.spec.schema_parallel import ParallelSpec

_Builder = Callable[["ParallelSpec", "DevicePlan", LauncherEnvironment, str], Strategy]


def _fsdp(parallel: ParallelSpec, plan: DevicePlan, env: LauncherEnvironment, amp: str) -> Strategy:
    """FSDP2, imported here: ``torch.distributed.fsdp`` and ``torch.distributed.checkpoint`` cost the other modes'
    workers about a second of start-up."""
    from runner.strategies.fsdp import FSDPStrategy

    return FSDPStrategy(plan, parallel, env, amp)


STRATEGIES: dict[str, _Builder] = {
    "none": lambda parallel, plan, env, amp: SingleDevice(plan),
    "dp": lambda parallel, plan, env, amp: DataParallelStrategy(plan, parallel),
    "ddp": lambda parallel, plan, env, amp: DDPStrategy(plan, parallel, env),
    "fsdp": _fsdp,
}
MODES = tuple(STRATEGIES)  # every parallel mode, in the order bench and parity show them (none first: the baseline)


def make_strategy(
    parallel: ParallelSpec, plan: DevicePlan, env: LauncherEnvironment | None = None, amp: str = "no"
) -> Strategy:
    """Build the strategy for ``plan.mode``.

    Args:
        parallel: The validated ``[parallel]`` table (:class:`~runner.spec.schema_parallel.ParallelSpec`).
        plan: From :func:`runner.devices.resolve.resolve_devices` (already applied to the environment).
        env: This process's place in its job, from :meth:`LauncherEnvironment.detect`; ``None``
            stands for a process that no launcher started (ddp's ``setup`` then refuses to run).
        amp: ``train.amp`` (fsdp gathers its parameters in that dtype).

    Returns:
        A :class:`Strategy`; call ``setup()`` before use and ``teardown()`` in ``finally``.
    """
    launcher = LauncherEnvironment.detect({}) if env is None else env
    return STRATEGIES[plan.mode](parallel, plan, launcher, amp)

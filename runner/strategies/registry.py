"""Pick the strategy of a parallel mode (``none``, ``dp``, ``ddp``, ``fsdp``) and build it from its own settings."""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.nn.parallel import DataParallel

from runner.errors import DeviceError, TrainingError
from runner.launch.environment import LauncherEnvironment
from runner.strategies.base import Strategy
from runner.strategies.ddp import DDPStrategy

if TYPE_CHECKING:
    from runner.devices.resolve import DevicePlan
    from runner.spec.schema import TrainSpec
    from runner.spec.schema_parallel import ParallelSpec


_Builder = Callable[["ParallelSpec", "DevicePlan", LauncherEnvironment, str], Strategy]


def _fsdp(parallel: ParallelSpec, plan: DevicePlan, env: LauncherEnvironment, amp: str) -> Strategy:
    """FSDP2, imported here: ``torch.distributed.fsdp`` and its checkpoint cost other modes' workers ~1 s to start."""
    from runner.strategies.fsdp import FSDPStrategy

    return FSDPStrategy(plan, parallel, env, amp)


STRATEGIES: dict[str, _Builder] = {
    "none": lambda parallel, plan, env, amp: SingleDevice(plan),
    "dp": lambda parallel, plan, env, amp: DataParallelStrategy(plan, parallel),
    "ddp": lambda parallel, plan, env, amp: DDPStrategy(plan, parallel, env),
    "fsdp": _fsdp,
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


class SingleDevice(Strategy):
    """``mode = "none"``: one process, one device: every method is :class:`Strategy`'s own."""

    mode = "none"


def check_gatherable(output: Any, path: str = "output") -> None:
    """Check DataParallel can gather ``output`` (tensors, ``None``, and dicts, lists, tuples of them); TrainingError
    names the first value it cannot (``output['aux'] is a str``)."""
    if output is None or isinstance(output, torch.Tensor):
        return
    if isinstance(output, dict):
        for key, value in output.items():
            check_gatherable(value, f"{path}[{key!r}]")
        return
    if isinstance(output, (list, tuple)):
        for pos, value in enumerate(output):
            check_gatherable(value, f"{path}[{pos}]")
        return
    raise TrainingError(
        f'{path} is a {type(output).__name__}: parallel.mode = "dp" can only gather tensors (or dicts, lists '
        f'and tuples of tensors) from its replicas; return tensors from forward, or use mode = "none" or "ddp"'
    )


def as_gatherable(output: Any) -> Any:
    """A dataclass output as a dict of its fields (shallow); anything else as it is."""
    if dataclasses.is_dataclass(output) and not isinstance(output, type):
        return {f.name: getattr(output, f.name) for f in dataclasses.fields(output)}
    return output


def combine_replica_losses(losses: Sequence[torch.Tensor], sizes: Sequence[int], device: torch.device) -> torch.Tensor:
    """A micro-batch's mean loss from its replicas' mean losses, ``sum(n_i * loss_i) / sum(n_i)``, on ``device``."""
    total = sum(loss.to(device) * n for loss, n in zip(losses, sizes, strict=True))
    return torch.as_tensor(total, device=device) / sum(sizes)


def _is_scalar(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() == 0


class _GatherCheckedDataParallel(DataParallel):
    """DataParallel with runner's output contract (docs/design.md §13): dataclasses, replica losses, clear errors."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._chunk_sizes: list[int] = []  # samples per replica of the call in progress (set by scatter)

    def scatter(self, inputs: Any, kwargs: Any, device_ids: Sequence[int | torch.device]) -> Any:
        scattered, scattered_kwargs = super().scatter(inputs, kwargs, device_ids)
        self._chunk_sizes = [_chunk_size(i, k, self.dim) for i, k in zip(scattered, scattered_kwargs, strict=False)]
        return scattered, scattered_kwargs

    def gather(self, outputs: Any, output_device: int | torch.device) -> Any:
        outputs = [as_gatherable(o) for o in outputs]
        check_gatherable(outputs[0])
        sizes = self._chunk_sizes if len(self._chunk_sizes) == len(outputs) else [1] * len(outputs)
        device = torch.device("cuda", output_device) if isinstance(output_device, int) else output_device
        if all(_is_scalar(o) for o in outputs):
            return combine_replica_losses(outputs, sizes, device)
        scalars = [k for k, v in outputs[0].items() if _is_scalar(v)] if isinstance(outputs[0], dict) else []
        if scalars and all(isinstance(o, dict) and all(_is_scalar(o.get(k)) for k in scalars) for o in outputs):
            rest = super().gather([{k: v for k, v in o.items() if k not in scalars} for o in outputs], output_device)
            means = {k: combine_replica_losses([o[k] for o in outputs], sizes, device) for k in scalars}
            return {k: means[k] if k in means else rest[k] for k in outputs[0]}
        return super().gather(outputs, output_device)


def _chunk_size(inputs: Any, kwargs: Any, dim: int) -> int:
    """Samples of one replica's chunk: the size along ``dim`` of its first tensor argument."""
    for value in [*inputs, *(kwargs or {}).values()]:
        if isinstance(value, torch.Tensor) and value.dim() > dim:
            return int(value.shape[dim])
    return 1


class DataParallelStrategy(SingleDevice):
    """``mode = "dp"``: one process drives every chosen GPU through ``torch.nn.DataParallel``.

    The micro-batch is loaded on ``cuda:0``, scattered along ``parallel.dim`` and gathered on the output device; one
    device runs unwrapped. Layout, collectives and stop decision are :class:`SingleDevice`'s.
    """

    mode = "dp"

    def __init__(self, plan: DevicePlan, parallel: ParallelSpec) -> None:
        super().__init__(plan)
        self.dim = parallel.dim
        self.num_devices = len(plan.requested_ids)
        self.output_device = torch.device("cuda", plan.output_index)

    @property
    def replicas(self) -> int:
        """The GPUs DataParallel spans."""
        return self.num_devices

    def wrap(self, module: nn.Module, train: TrainSpec | None = None) -> nn.Module:
        """Move ``module`` to ``cuda:0`` and wrap it over every GPU; DeviceError when this process sees fewer than
        planned."""
        module = module.to(self.device)
        if self.num_devices == 1:
            return module
        seen = torch.cuda.device_count()
        if seen < self.num_devices:
            raise DeviceError(
                f"dp planned {self.num_devices} GPUs ({self.plan.selected}) but torch sees {seen}: "
                f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}"
            )
        bn = sum(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in module.modules())
        if bn:
            warnings.warn(
                f"model has {bn} BatchNorm layer(s): under dp their running statistics come from the first "
                f'replica\'s chunk only; use parallel.mode = "ddp" with sync_batchnorm = true for exact statistics',
                UserWarning,
                stacklevel=2,
            )
        return _GatherCheckedDataParallel(
            module,
            device_ids=list(range(self.num_devices)),
            output_device=self.plan.output_index,
            dim=self.dim,
        )

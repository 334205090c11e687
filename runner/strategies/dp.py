"""``mode = "dp"``: one process drives every chosen GPU through ``torch.nn.DataParallel``.

DataParallel and small batches: the micro-batch is split with ``torch.chunk``
along ``parallel.dim``; a batch smaller than the number of devices (e.g. the
last batch of an epoch) runs on fewer replicas, the first devices only. With
``data.drop_last = true`` such a batch never reaches the model.
"""

from __future__ import annotations

import os
import warnings
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.nn.parallel import DataParallel

from runner.errors import DeviceError, TrainingError
from runner.strategies.single import SingleDevice

if TYPE_CHECKING:
    from runner.devices.resolve import DevicePlan
    from runner.spec.schema import ParallelSpec


def check_gatherable(output: Any, path: str = "output") -> None:
    """Check that DataParallel can gather a model output from its replicas.

    Gatherable: a tensor, ``None``, or dicts / lists / tuples (named tuples too)
    of gatherable values.

    Args:
        output: What ``forward`` returned (on one replica).
        path: Name used in the message for ``output`` itself.

    Raises:
        TrainingError: Names the first value that cannot be gathered, e.g.
            ``output['aux'] is a str``.
    """
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


class _GatherCheckedDataParallel(DataParallel):
    """DataParallel that explains an output it cannot gather instead of failing deep inside ``gather``."""

    def gather(self, outputs: Any, output_device: int | torch.device) -> Any:
        check_gatherable(outputs[0])
        return super().gather(outputs, output_device)


def _count_batchnorm(module: nn.Module) -> int:
    return sum(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in module.modules())


class DataParallelStrategy(SingleDevice):
    """``mode = "dp"``: one process drives every chosen GPU through ``torch.nn.DataParallel``.

    The whole micro-batch is loaded on ``cuda:0``; DataParallel scatters it along
    ``parallel.dim`` (``torch.chunk``), runs one replica per chunk and gathers the
    outputs on ``parallel.output_device``. With one device the model runs unwrapped.
    Still one process: the layout, the collectives and the stop decision are those of
    :class:`~runner.strategies.single.SingleDevice`; only the wrapping differs.

    Args:
        plan: The resolved device plan (a CUDA plan: the schema and device resolution
            refuse dp on CPU); ``plan.output_index`` places the gathered outputs.
        parallel: The ``[parallel]`` table (``dim``).
    """

    mode = "dp"

    def __init__(self, plan: DevicePlan, parallel: ParallelSpec) -> None:
        super().__init__(plan)
        self.dim = parallel.dim
        self.num_devices = len(plan.requested_ids)
        self.output_device = torch.device("cuda", plan.output_index)

    def wrap(self, module: nn.Module) -> nn.Module:
        """Move ``module`` to ``cuda:0`` and wrap it in DataParallel over ``cuda:0 .. cuda:n-1``.

        Raises:
            DeviceError: This process sees fewer GPUs than planned (``CUDA_VISIBLE_DEVICES``
                was not narrowed before CUDA started).
        """
        module = module.to(self.device)
        if self.num_devices == 1:
            return module
        seen = torch.cuda.device_count()
        if seen < self.num_devices:
            raise DeviceError(
                f"dp planned {self.num_devices} GPUs ({self.plan.selected}) but torch sees {seen}: "
                f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}"
            )
        bn = _count_batchnorm(module)
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

"""``mode = "fsdp"``: one process per device, ``fully_shard`` (FSDP2) on the blocks and then the root. Details:
docs/design.md, "Module notes"."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from runner.strategies.base import find_blocks, transform_blocks, unwrap
from runner.strategies.ddp import DDPStrategy

if TYPE_CHECKING:
    from runner.devices.resolve import DevicePlan
    from runner.launch.environment import LauncherEnvironment
    from runner.spec.schema import TrainSpec
    from runner.spec.schema_parallel import ParallelSpec

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def mixed_precision(amp: str) -> MixedPrecisionPolicy:
    """FSDP2's policy for ``train.amp``: parameters in its dtype for forward and backward, gradients reduced in fp32."""
    dtype = _DTYPES.get(amp)
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32 if dtype else None)


def shard(
    module: nn.Module, blocks: list[nn.Module], policy: MixedPrecisionPolicy, reshard: bool, mesh: Any = None
) -> None:
    """``fully_shard`` each block, innermost first, then the root (``mesh`` ``None``: the default group's)."""
    kwargs: dict[str, Any] = {"mp_policy": policy, "reshard_after_forward": reshard, "mesh": mesh}
    for block in reversed(blocks):
        fully_shard(block, **kwargs)
    fully_shard(module, **kwargs)


def _meta_copy(module: nn.Module) -> nn.Module:
    """A copy of ``module`` whose parameters and buffers live on the meta device (no storage)."""
    memo: dict[int, Any] = {}
    for p in module.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    for b in module.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    return copy.deepcopy(module, memo)


class FSDPStrategy(DDPStrategy):
    """``mode = "fsdp"``: ``fully_shard`` on ``parallel.fsdp_blocks`` (or each child with parameters), then the root;
    forward and backward in ``amp``'s dtype."""

    mode = "fsdp"

    def __init__(self, plan: DevicePlan, parallel: ParallelSpec, env: LauncherEnvironment, amp: str = "no") -> None:
        super().__init__(plan, parallel, env)
        self.policy = mixed_precision(amp)
        self._replica: nn.Module | None = None  # the evaluation replica, storage-less between evaluations

    def wrap(self, module: nn.Module, train: TrainSpec | None = None) -> nn.Module:
        """Move ``module`` to this rank's device, checkpoint and compile each block (torchtitan's order), shard each,
        then the root; SpecError for an ``fsdp_blocks`` class the model lacks."""
        self._need_setup()
        find_blocks(module, self.parallel.fsdp_blocks)  # names checked before any work
        module = module.to(self.device)
        if self.parallel.sync_batchnorm and self.device.type == "cuda":
            module = nn.SyncBatchNorm.convert_sync_batchnorm(module)
        self._replica = _meta_copy(module)
        blocks = find_blocks(module, self.parallel.fsdp_blocks)
        transform_blocks(blocks, train, compile_blocks=True)
        shard(module, blocks, self.policy, self.parallel.reshard_after_forward)
        return module

    def eval_module(self, wrapped: nn.Module) -> nn.Module:
        """A replica holding the whole model, gathered now (a collective: every rank calls it at the same point)."""
        assert self._replica is not None, "wrap() first"
        full = get_model_state_dict(unwrap(wrapped), options=StateDictOptions(full_state_dict=True))
        self._replica.load_state_dict(full, assign=True)
        for name, buf in unwrap(wrapped).named_buffers():  # non-persistent buffers are in no state dict
            owner, _, leaf = name.rpartition(".")
            self._replica.get_submodule(owner)._buffers[leaf] = buf
        return self._replica

    def full_module(self, wrapped: nn.Module) -> nn.Module:
        """The evaluation replica (:meth:`eval_module`): the whole model on every rank."""
        return self.eval_module(wrapped)

    def no_sync(self, wrapped: nn.Module) -> contextlib.AbstractContextManager[object]:
        """Keep unsharded gradients without reduce-scattering them (micro-batches before the last one)."""
        return _no_gradient_sync(wrapped)


@contextlib.contextmanager
def _no_gradient_sync(wrapped: nn.Module) -> Iterator[None]:
    module = unwrap(wrapped)
    if not isinstance(module, FSDPModule):
        yield
        return
    module.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        module.set_requires_gradient_sync(True)

"""The modes of one process per device over a torch.distributed process group: ``ddp``
(``DistributedDataParallel``) and ``fsdp`` (``fully_shard``, FSDP2, on the blocks and then the root).

Under fsdp, parameters, gradients and optimizer state are sharded over the ranks (dim 0, ``Shard(0)``
DTensors). The process group, the launcher, the collectives and the stop decision are ddp's
(``DDPStrategy``); only the wrapping and the state differ.

* Gradients are reduce-scattered as a mean over ranks, as DDP's all-reduce, so the global batch
  means what it means in every mode (docs/design.md §2, §3).
* ``train.amp`` maps to ``MixedPrecisionPolicy``: ``bf16``/``fp16`` gather the parameters in that
  dtype for forward and backward and reduce gradients in float32; the sharded parameters and the
  optimizer stay in float32.
* Checkpoints stay sharded: each rank writes its own shards of the model and optimizer through
  ``torch.distributed.checkpoint`` into the step's folder (``runner.training.checkpoint.save_checkpoint``);
  no rank holds the whole state. DCP reshards on load, so a run resumes on any process count or mode.
* Evaluation may give the ranks different numbers of batches, which sharded forwards (one
  all-gather per block) cannot follow: it runs on a replica that holds the gathered model for the
  duration of the evaluation, as ddp evaluates its unwrapped replica.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import os
import re
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from runner.errors import DeviceError, TrainingError, UsageError
from runner.strategies.base import StepMemory, Strategy, find_blocks, key_list, transform_blocks, unwrap

if TYPE_CHECKING:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from runner.devices.environment import LauncherEnvironment
    from runner.devices.resolve import DevicePlan
    from runner.spec.schema_loop import TrainSpec
    from runner.spec.schema_parallel import ParallelSpec

T = TypeVar("T")

_UNUSED_NAMES = re.compile(r"Parameters which did not receive grad for rank (\d+): ([^\n]*)")
_UNUSED_INDICES = re.compile(r"Parameter indices which did not receive grad for rank (\d+): ([\d ]+)")


def is_unused_parameters_error(exc: BaseException) -> bool:
    """Whether ``exc`` is DDP's "Expected to have finished reduction in the prior iteration" error."""
    return isinstance(exc, RuntimeError) and "Expected to have finished reduction" in str(exc)


def describe_unused_parameters_error(exc: BaseException, module: nn.Module) -> TrainingError:
    """DDP's unused-parameter RuntimeError as a TrainingError naming the parameters (from DDP's message, else those
    whose ``.grad`` is ``None``)."""
    text = str(exc)
    trainable = [name for name, p in unwrap(module).named_parameters() if p.requires_grad]
    names: list[str] = []
    rank = None
    if match := _UNUSED_NAMES.search(text):
        rank = match.group(1)
        names = [n.strip() for n in match.group(2).split(",") if n.strip()]
    elif match := _UNUSED_INDICES.search(text):
        rank = match.group(1)
        names = [trainable[int(i)] if int(i) < len(trainable) else f"#{i}" for i in match.group(2).split()]
    if not names:
        names = [name for name, p in unwrap(module).named_parameters() if p.requires_grad and p.grad is None]
    where = f" on rank {rank}" if rank is not None else ""
    listed = key_list(names) if names else "(could not tell which)"
    if "static_graph" in text:
        fix = "the set of used parameters changed between steps: set parallel.static_graph = false"
    else:
        fix = (
            "make forward use them (or freeze them with requires_grad = False), "
            "or set parallel.find_unused_parameters = true (slower)"
        )
    return TrainingError(f"ddp: parameters got no gradient in the previous step{where}: {listed}; {fix}")


class DDPStrategy(Strategy):
    """``mode = "ddp"``: one process per device, DistributedDataParallel, a torch.distributed process group.

    The launcher (elastic agent, torchrun, a scheduler) describes the job in ``env``.
    """

    mode = "ddp"

    def __init__(self, plan: DevicePlan, parallel: ParallelSpec, env: LauncherEnvironment) -> None:
        super().__init__(plan)
        self.parallel = parallel
        self.env = env
        self.backend = plan.backend or ("nccl" if plan.accelerator == "cuda" else "gloo")
        self._owns_group = False
        self._flag_group: dist.ProcessGroup | None = None  # CPU gloo group of the stop decision
        self._save_group: Any = None  # CPU gloo group of background checkpoint saves, made when needed
        self._stopping = False  # the stop decision, final once True

    @classmethod
    def create(cls, parallel: ParallelSpec, plan: DevicePlan, env: LauncherEnvironment, amp: str) -> Strategy:
        """A ddp strategy for the process ``env`` describes."""
        return cls(plan, parallel, env)

    @staticmethod
    def memory(step: StepMemory) -> list[dict[str, Any]]:
        """Each device holds a replica and its share's step, plus DDP's gradient buckets (a second copy of the
        gradients unless ``gradient_as_bucket_view``)."""
        bucket = 0 if step.bucket_view else step.local["grad_bytes"]
        local = step.local
        return [{"device": "each", **local, "grads": local["grads"] + bucket, "peak": local["peak"] + bucket}]

    @property
    def rank(self) -> int:
        """Global rank (``RANK``)."""
        return self.env.rank

    @property
    def local_rank(self) -> int:
        """Rank on this node (``LOCAL_RANK``)."""
        return self.env.local_rank

    @property
    def world_size(self) -> int:
        """Processes in the job (``WORLD_SIZE``)."""
        return self.env.world_size

    def setup(self) -> None:
        """Join the process group (``timeout = parallel.timeout_s``; ``cuda:LOCAL_RANK`` under nccl) and make the CPU
        gloo group the stop decision runs on.

        Raises UsageError without the launcher's variables, DeviceError when ``LOCAL_RANK`` has no GPU.
        """
        env = self.env
        if env.missing:
            raise UsageError(
                f'mode = "ddp" worker started without {list(env.missing)}: start it with `runner exec` (which '
                f"launches the workers), torchrun, or a scheduler that sets RANK, LOCAL_RANK, WORLD_SIZE, "
                f"MASTER_ADDR, MASTER_PORT"
            )
        self._place_process()
        timeout = timedelta(seconds=self.parallel.timeout_s)
        if not dist.is_initialized():
            self._init_process_group(timeout)
        # Every rank is a member, so this is a ProcessGroup (not GroupMember.NON_GROUP_MEMBER).
        self._flag_group = cast(dist.ProcessGroup, dist.new_group(backend="gloo", timeout=timeout))

    def _place_process(self) -> None:
        """Pick this rank's device (the worker has already set its CPU threads)."""
        if self.plan.accelerator == "cuda":
            count = torch.cuda.device_count()
            local_rank = self.env.local_rank
            if local_rank >= count:
                raise DeviceError(
                    f"LOCAL_RANK={local_rank} but this process sees {count} GPU(s) "
                    f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}): one process per GPU"
                )
            self.device = torch.device("cuda", local_rank)
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
        self.output_device = self.device

    def _init_process_group(self, timeout: timedelta) -> None:
        """``init_process_group`` over ``env://`` (the launcher's store), one prefix per elastic attempt."""
        kwargs: dict[str, Any] = {"timeout": timeout}
        if self.backend == "nccl":
            kwargs["device_id"] = self.device
        if self.env.restarted:
            # After an elastic restart the workers reuse the agent's store, where the failed
            # attempt's keys (e.g. gloo's peer addresses) are still present: a new rank could
            # read a dead peer's address. A per-attempt prefix keeps attempts apart.
            store, _, _ = next(dist.rendezvous("env://", self.env.rank, self.env.world_size, timeout=timeout))
            kwargs["store"] = dist.PrefixStore(f"runner/attempt_{self.env.restart_count}", store)
        dist.init_process_group(self.backend, rank=self.env.rank, world_size=self.env.world_size, **kwargs)
        self._owns_group = True

    def teardown(self) -> None:
        """Destroy the groups this strategy created; safe to call twice."""
        gc.collect()  # free DDP's reducer and its pending work before the process group goes
        if dist.is_initialized():
            if self._owns_group:
                dist.destroy_process_group()
            else:
                for group in (self._flag_group, self._save_group):
                    if group is not None:
                        dist.destroy_process_group(group)
        self._flag_group = self._save_group = None
        self._owns_group = False

    def wrap(self, module: nn.Module, train: TrainSpec | None = None) -> nn.Module:
        """Move ``module`` to this rank's device, convert BatchNorm if asked, checkpoint blocks, wrap in DDP, then
        compile."""
        module = module.to(self.device)
        par = self.parallel
        if par.sync_batchnorm and self.device.type == "cuda":
            module = nn.SyncBatchNorm.convert_sync_batchnorm(module)
        transform_blocks(find_blocks(module, None), train, compile_blocks=False)
        wrapped = DistributedDataParallel(
            module,
            device_ids=[self.device.index] if self.device.type == "cuda" else None,
            find_unused_parameters=par.find_unused_parameters,
            static_graph=par.static_graph,
            gradient_as_bucket_view=par.gradient_as_bucket_view,
        )
        if train is not None and train.compile:
            wrapped.compile(backend=train.compile_backend)
        return wrapped

    def eval_module(self, wrapped: nn.Module) -> nn.Module:
        """The unwrapped model: evaluation batches may be uneven across ranks, so no DDP hooks."""
        return unwrap(wrapped)

    def no_sync(self, wrapped: nn.Module) -> contextlib.AbstractContextManager[object]:
        """``wrapped.no_sync()`` for DDP models (skip the all-reduce while accumulating)."""
        if isinstance(wrapped, DistributedDataParallel):
            return wrapped.no_sync()
        return contextlib.nullcontext()

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` (any shape) over all ranks: a detached copy on its device; gloo reduces on CPU, nccl on
        this rank's GPU."""
        return self.all_reduce_sum_async(tensor)()

    def all_reduce_sum_async(self, tensor: torch.Tensor) -> Callable[[], torch.Tensor]:
        """The sum started with ``async_op``: the ranks go on training while it runs; calling the result waits."""
        device = torch.device("cpu") if self.backend == "gloo" else self.device  # where the backend reduces
        buf = tensor.detach().to(device, copy=True)
        work = dist.all_reduce(buf, op=dist.ReduceOp.SUM, async_op=True)

        def result() -> torch.Tensor:
            work.wait()
            return buf.to(tensor.device)

        return result

    def save_group(self) -> Any:
        """A gloo group of every rank for background checkpoint saves, created on the first call."""
        if self._save_group is None:
            timeout = timedelta(seconds=self.parallel.timeout_s)
            self._save_group = dist.new_group(backend="gloo", timeout=timeout)
        return self._save_group

    def barrier(self) -> None:
        if self.backend == "nccl":
            dist.barrier(device_ids=[self.device.index])
        else:
            dist.barrier()

    def all_gather_object(self, obj: T) -> list[T]:
        """Return every rank's ``obj`` (picklable), indexed by rank, on every rank."""
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def reduce_stop_decision(self, flag: int, *, settle: bool = False) -> bool:
        """True once any rank passed a flag to a settling call, final from then on; ``settle=True`` reduces on the CPU
        gloo group (the device is never synchronised for it), in the same order on every rank."""
        if settle and not self._stopping:
            buf = torch.tensor([int(flag)], dtype=torch.int64)
            dist.all_reduce(buf, op=dist.ReduceOp.MAX, group=self._flag_group)
            self.stop_code = int(buf.item())
            self._stopping = bool(self.stop_code)
        return self._stopping


_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# torch.distributed.fsdp and its checkpoint are imported where fsdp uses them: they cost other modes ~1 s to start


def mixed_precision(amp: str) -> MixedPrecisionPolicy:
    """FSDP2's policy for ``train.amp``: parameters in its dtype for forward and backward, gradients reduced in fp32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    dtype = _DTYPES.get(amp)
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32 if dtype else None)


def shard(
    module: nn.Module, blocks: list[nn.Module], policy: MixedPrecisionPolicy, reshard: bool, mesh: Any = None
) -> None:
    """``fully_shard`` each block, innermost first, then the root (``mesh`` ``None``: the default group's)."""
    from torch.distributed.fsdp import fully_shard

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

    @classmethod
    def create(cls, parallel: ParallelSpec, plan: DevicePlan, env: LauncherEnvironment, amp: str) -> Strategy:
        """An fsdp strategy for the process ``env`` describes, gathering in ``amp``'s dtype."""
        return cls(plan, parallel, env, amp)

    @staticmethod
    def memory(step: StepMemory) -> list[dict[str, Any]]:
        """Each device holds its shard of parameters, gradients and optimizer state and its share's activations."""
        return [{"device": "each", **step.sharded}]

    def wrap(self, module: nn.Module, train: TrainSpec | None = None) -> nn.Module:
        """Move ``module`` to this rank's device, checkpoint and compile each block (torchtitan's order), shard each,
        then the root; SpecError for an ``fsdp_blocks`` class the model lacks."""
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
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

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
    from torch.distributed.fsdp import FSDPModule

    module = unwrap(wrapped)
    if not isinstance(module, FSDPModule):
        yield
        return
    module.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        module.set_requires_gradient_sync(True)

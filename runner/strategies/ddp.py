"""``mode = "ddp"``: one process per device, DistributedDataParallel, a torch.distributed process group."""

from __future__ import annotations

import contextlib
import os
import re
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from runner.devices.resolve import DevicePlan
from runner.errors import DeviceError, TrainingError, UsageError
from runner.strategies.base import Strategy
from runner.strategies.state_dicts import key_list, unwrap

_UNUSED_NAMES = re.compile(r"Parameters which did not receive grad for rank (\d+): ([^\n]*)")
_UNUSED_INDICES = re.compile(r"Parameter indices which did not receive grad for rank (\d+): ([\d ]+)")


def is_unused_parameters_error(exc: BaseException) -> bool:
    """Whether ``exc`` is DDP's "Expected to have finished reduction in the prior iteration" error."""
    return isinstance(exc, RuntimeError) and "Expected to have finished reduction" in str(exc)


def describe_unused_parameters_error(exc: BaseException, module: nn.Module) -> TrainingError:
    """Turn DDP's unused-parameter RuntimeError into a TrainingError that names the parameters.

    Names come from DDP's message (``TORCH_DISTRIBUTED_DEBUG=INFO`` or ``DETAIL``
    lists them; otherwise indices are mapped to names), else from the
    parameters whose ``.grad`` is ``None``.

    Args:
        exc: The RuntimeError raised by DDP's forward.
        module: The model, wrapped or not.

    Returns:
        The error to raise (``raise describe_unused_parameters_error(e, m) from e``).
    """
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

    Each process is started by torch's elastic launcher (or ``torchrun`` / a
    scheduler), which sets ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
    ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``.
    """

    mode = "ddp"
    _ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")

    def __init__(self, spec: Any, plan: DevicePlan):
        super().__init__(spec, plan)
        self.backend = plan.backend or ("nccl" if plan.accelerator == "cuda" else "gloo")
        if self.backend == "nccl" and plan.accelerator != "cuda":
            raise DeviceError('parallel.backend = "nccl" needs CUDA: use backend = "gloo" on CPU')
        self._layout: tuple[int, int, int, int] | None = None  # rank, local rank, world, local world
        self._owns_group = False

    def _need_setup(self) -> tuple[int, int, int, int]:
        if self._layout is None:
            raise TrainingError("DDPStrategy used before setup(): call strategy.setup() in the worker first")
        return self._layout

    @property
    def rank(self) -> int:
        return self._need_setup()[0]

    @property
    def local_rank(self) -> int:
        return self._need_setup()[1]

    @property
    def world_size(self) -> int:
        return self._need_setup()[2]

    def setup(self) -> None:
        """Join the process group described by the launcher's environment variables.

        Sets the device (``cuda:LOCAL_RANK`` with nccl), caps CPU threads to
        cores / local processes on CPU, and calls ``init_process_group`` with
        ``timeout = parallel.timeout_s``.

        Raises:
            UsageError: The launcher's variables are missing, or ``WORLD_SIZE``
                differs from the plan's world size.
            DeviceError: ``LOCAL_RANK`` has no GPU.
        """
        env = os.environ  # init_process_group's env:// reads the same variables
        missing = [k for k in self._ENV if k not in env]
        if missing:
            raise UsageError(
                f'mode = "ddp" worker started without {missing}: start it with `runner exec` (which launches the '
                f"workers), torchrun, or a scheduler that sets RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT"
            )
        rank, local_rank, world = int(env["RANK"]), int(env["LOCAL_RANK"]), int(env["WORLD_SIZE"])
        local_world = int(env.get("LOCAL_WORLD_SIZE", self.plan.nproc_per_node))
        if world != self.plan.world_size:
            raise UsageError(
                f"the launcher says WORLD_SIZE={world} but the spec resolves to world size {self.plan.world_size} "
                f"(nnodes {self.plan.nnodes} x nproc_per_node {self.plan.nproc_per_node}): make them agree"
            )
        if self.plan.accelerator == "cuda":
            count = torch.cuda.device_count()
            if local_rank >= count:
                raise DeviceError(
                    f"LOCAL_RANK={local_rank} but this process sees {count} GPU(s) "
                    f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}): one process per GPU"
                )
            self.device = torch.device("cuda", local_rank)
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
            cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
            torch.set_num_threads(max(1, cores // max(1, local_world)))
        self.output_device = self.device
        if not dist.is_initialized():
            kwargs: dict[str, Any] = {"timeout": timedelta(seconds=self.spec.parallel.timeout_s)}
            if self.backend == "nccl":
                kwargs["device_id"] = self.device
            restart = int(env.get("TORCHELASTIC_RESTART_COUNT", "0"))
            if restart > 0:
                # After an elastic restart the workers reuse the agent's store, where the failed
                # attempt's keys (e.g. gloo's peer addresses) are still present: a new rank could
                # read a dead peer's address. A per-attempt prefix keeps attempts apart.
                store, _, _ = next(dist.rendezvous("env://", rank, world, timeout=kwargs["timeout"]))
                kwargs["store"] = dist.PrefixStore(f"runner/attempt_{restart}", store)
            dist.init_process_group(self.backend, rank=rank, world_size=world, **kwargs)
            self._owns_group = True
        self._layout = (rank, local_rank, world, local_world)

    def teardown(self) -> None:
        """Destroy the process group this strategy created; safe to call twice."""
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()
        self._owns_group = False

    def wrap(self, module: nn.Module) -> nn.Module:
        """Move ``module`` to this rank's device, convert BatchNorm if asked, wrap in DDP."""
        self._need_setup()
        module = module.to(self.device)
        if self.spec.parallel.sync_batchnorm and self.device.type == "cuda":
            module = nn.SyncBatchNorm.convert_sync_batchnorm(module)
        par = self.spec.parallel
        return DistributedDataParallel(
            module,
            device_ids=[self.device.index] if self.device.type == "cuda" else None,
            find_unused_parameters=par.find_unused_parameters,
            static_graph=par.static_graph,
            gradient_as_bucket_view=par.gradient_as_bucket_view,
        )

    def eval_module(self, wrapped: nn.Module) -> nn.Module:
        """The unwrapped model: evaluation batches may be uneven across ranks, so no DDP hooks."""
        return unwrap(wrapped)

    def no_sync(self, wrapped: nn.Module) -> contextlib.AbstractContextManager:
        """``wrapped.no_sync()`` for DDP models (skip the all-reduce while accumulating)."""
        if isinstance(wrapped, DistributedDataParallel):
            return wrapped.no_sync()
        return contextlib.nullcontext()

    def _collective_device(self) -> torch.device:
        return torch.device("cpu") if self.backend == "gloo" else self.device

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over all ranks (a detached copy; the input is not modified).

        Args:
            tensor: Any shape; gloo reduces on CPU, nccl on this rank's GPU.

        Returns:
            The sum, on ``tensor``'s device.
        """
        self._need_setup()
        buf = tensor.detach().to(self._collective_device(), copy=True)
        dist.all_reduce(buf, op=dist.ReduceOp.SUM)
        return buf.to(tensor.device)

    def barrier(self) -> None:
        """Wait until every rank arrives."""
        self._need_setup()
        if self.backend == "nccl":
            dist.barrier(device_ids=[self.device.index])
        else:
            dist.barrier()

    def broadcast_object(self, obj: Any) -> Any:
        """Return rank 0's ``obj`` (picklable) on every rank."""
        self._need_setup()
        box = [obj]
        dist.broadcast_object_list(box, src=0, device=self._collective_device())
        return box[0]

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Return every rank's ``obj`` (picklable), indexed by rank, on every rank."""
        self._need_setup()
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

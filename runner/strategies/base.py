"""The Strategy interface (device, wrapping, collectives, the stop decision) and the modes of one process: ``none``
and ``dp`` (``DataParallel``).

The training loop talks only to ``Strategy``, whose own methods answer for one process on one
device (mode none); ``SingleDevice`` and ``DataParallelStrategy`` live here too, ddp's and fsdp's
strategies in ``runner.strategies.distributed``:

========  ==========================  ==================  ========================
mode      model                       inputs go to        collectives
========  ==========================  ==================  ========================
none      as is, on ``device``        ``device``          identity
dp        ``torch.nn.DataParallel``   ``cuda:0``          identity (one process)
ddp       ``DistributedDataParallel`` ``cuda:LOCAL_RANK`` torch.distributed
                                      or cpu
fsdp      ``fully_shard`` (FSDP2)     as ddp              as ddp
========  ==========================  ==================  ========================

What the spec and the launcher must know of a mode without torch (how it launches, which
``[parallel]`` keys apply) is its ``runner.spec.schema_parallel.ModeTraits`` entry in
``runner.spec.schema_parallel.MODES``, read here as ``Strategy.traits``.

Device indices are those after ``runner.devices.inventory.apply_device_env`` has
narrowed ``CUDA_VISIBLE_DEVICES``: the chosen GPUs are ``cuda:0 .. cuda:n-1``.

A strategy is built from its own settings (the resolved
``runner.devices.resolve.DevicePlan``, the ``[parallel]`` table, the launcher's
environment) and assumes them valid: the rules that tie them together are checked once,
by the schema and by device resolution.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Literal, TypeVar

import torch
from torch import nn
from torch.distributed._composable import checkpoint
from torch.nn.parallel import DataParallel, DistributedDataParallel

from runner.errors import DeviceError, SpecError, SpecIssue, TrainingError, did_you_mean, with_hint
from runner.spec.schema_parallel import MODES, ModeTraits, ParallelSpec

if TYPE_CHECKING:
    from runner.devices.environment import LauncherEnvironment
    from runner.devices.resolve import DevicePlan
    from runner.spec.schema_loop import TrainSpec


T = TypeVar("T")


def find_blocks(module: nn.Module, names: list[str] | None) -> list[nn.Module]:
    """The modules sharded as one unit each, outermost first (``names``: ``parallel.fsdp_blocks``, or each child).
    Raises SpecError: A name is no module class of the model (with a did-you-mean)."""
    if names is None:  # a child that shares a parameter with another (tied weights) stays with the root's unit
        children = list(_units(module))
        return [child for child in children if not _shares_parameters(child, children)]
    present = sorted({type(m).__name__ for m in module.modules()})
    for name in names:
        if name not in present:
            hint = did_you_mean(name, present, n=3)
            message = with_hint(f"{name!r} is no module class of the model", hint)
            message += f"; its classes are {', '.join(present)}"
            raise SpecError(SpecIssue(None, None, "parallel.fsdp_blocks", message))
        container = next((m for m in module.modules() if type(m).__name__ == name and not _has_forward(m)), None)
        if container is not None:
            items = sorted({type(m).__name__ for m in container.children()})
            message = (
                f"{name!r} is a container without a forward of its own, which fully_shard cannot take as a unit: "
                f"name the class of its items ({', '.join(items) or 'it has none'})"
            )
            raise SpecError(SpecIssue(None, None, "parallel.fsdp_blocks", message))
    wanted = set(names)
    blocks = [m for m in module.modules() if type(m).__name__ in wanted and m is not module]
    for block in blocks:
        others = [
            b for b in blocks if not any(m is b for m in block.modules()) and not any(m is block for m in b.modules())
        ]
        if _shares_parameters(block, others):  # a nested block shares its parent's parameters
            message = (
                f"a {type(block).__name__} block shares a parameter with another block (tied weights), which "
                "FSDP cannot shard apart: leave that class out of fsdp_blocks, or fsdp_blocks = [] shards the model "
                "as one unit"
            )
            raise SpecError(SpecIssue(None, None, "parallel.fsdp_blocks", message))
    return blocks


def _units(module: nn.Module) -> Iterator[nn.Module]:
    """The children of ``module`` that hold parameters, each a unit; a container without a forward of its own
    (``nn.ModuleList``, ``nn.ModuleDict``: the layers of a hand-written transformer) gives its items instead, as
    ``fully_shard`` refuses such a container (torchtitan shards ``model.layers`` item by item)."""
    for child in module.children():
        if not any(True for _ in child.parameters()):
            continue
        if _has_forward(child):
            yield child
        else:
            yield from _units(child)


def _has_forward(module: nn.Module) -> bool:
    """Whether ``module``'s class defines ``forward`` (``nn.ModuleList`` and ``nn.ModuleDict`` do not)."""
    return type(module).forward is not nn.Module.forward


def _shares_parameters(block: nn.Module, others: list[nn.Module]) -> bool:
    """Whether ``block`` holds a parameter that one of ``others`` (``block`` itself aside) holds too."""
    own = {id(p) for p in block.parameters()}
    return any(id(p) in own for other in others if other is not block for p in other.parameters())


def transform_blocks(blocks: list[nn.Module], train: TrainSpec | None, *, compile_blocks: bool) -> None:
    """Apply ``train.activation_checkpointing`` (non-reentrant, composable: parameter names unchanged) to each block
    and, with ``compile_blocks``, ``train.compile`` to each block in place (``nn.Module.compile``)."""
    if train is None:
        return
    for block in blocks:
        if train.activation_checkpointing:
            checkpoint(block)
        if compile_blocks and train.compile:
            block.compile(backend=train.compile_backend)


@dataclasses.dataclass(frozen=True)
class StepMemory:
    """What the fake steps of ``runner plan`` measured (bytes by kind, :func:`runner.training.setup.fake_step`), from
    which each mode's :meth:`Strategy.memory` tells the bytes per device of its step.

    ``whole``: a step of the global batch on one device; ``local``: of one of ``devices`` ranks' share; ``sharded``: of
    that share with parameters, gradients and optimizer state sharded over the ranks; ``bucket_view``: ddp's
    ``gradient_as_bucket_view`` (its gradient buckets alias the gradients).
    """

    whole: dict[str, int]
    local: dict[str, int]
    sharded: dict[str, int]
    devices: int
    bucket_view: bool = False


class Strategy:
    """How one process runs the model: device, wrapping, collectives, the stop decision.

    ``setup()`` ... ``teardown()``; modelled on Lightning Fabric's ``Strategy``. Each method
    answers for one process on one device (mode ``none``); the modes of several processes override them.
    """

    mode: ClassVar[str]

    def __init__(self, plan: DevicePlan) -> None:
        self.plan = plan
        self.device = torch.device("cuda", 0) if plan.accelerator == "cuda" else torch.device("cpu")
        self.output_device = self.device

    @classmethod
    def create(cls, parallel: ParallelSpec, plan: DevicePlan, env: LauncherEnvironment, amp: str) -> Strategy:
        """The strategy of ``plan`` from what :func:`runner.strategies.make_strategy` is given (each takes its part)."""
        return cls(plan)

    @staticmethod
    def memory(step: StepMemory) -> list[dict[str, Any]]:
        """Bytes by kind on each device of one training step, as rows ``{"device": ..., kind: bytes}``: here the one
        device holds the whole step."""
        return [{"device": "0", **step.whole}]

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

    @property
    def traits(self) -> ModeTraits:
        """How this mode launches and which ``[parallel]`` keys apply to it."""
        return MODES[self.mode]

    @property
    def replicas(self) -> int:
        """Devices one process drives: dp's GPUs, else 1."""
        return 1

    # lifecycle ------------------------------------------------------------
    def setup(self) -> None:
        """Prepare this process (join the process group, pick the device)."""

    def teardown(self) -> None:
        """Release what :meth:`setup` took; safe to call twice."""

    # model ----------------------------------------------------------------
    def wrap(self, module: nn.Module, train: TrainSpec | None = None) -> nn.Module:
        """Move ``module`` to :attr:`device` and wrap it, applying ``train``'s checkpointing and compile in this
        mode's order (here: no wrapper, checkpointed blocks, the whole model compiled)."""
        module = module.to(self.device)
        transform_blocks(find_blocks(module, None), train, compile_blocks=False)
        if train is not None and train.compile:
            module.compile(backend=train.compile_backend)
        return module

    def unwrap(self, module: nn.Module) -> nn.Module:
        """Return the user's model inside the wrapper (for state dicts and optimizers' views)."""
        return unwrap(module)

    def full_module(self, wrapped: nn.Module) -> nn.Module:
        """The user's model holding all its parameters (to log it); a collective where they are sharded."""
        return self.unwrap(wrapped)

    def eval_module(self, wrapped: nn.Module) -> nn.Module:
        """Return the module to evaluate with (the wrapped one unless collectives would get in the way)."""
        return wrapped

    def no_sync(self, wrapped: nn.Module) -> contextlib.AbstractContextManager[object]:
        """Context for micro-batches before the last one of a gradient-accumulation step (no gradient sync)."""
        return contextlib.nullcontext()

    # state: torch.distributed.checkpoint's (state_dict.py), as torchtitan's checkpointer uses it ---------------
    def save_group(self) -> Any:
        """The process group of background checkpoint saves (their collectives must not meet training's on the same
        group); ``None`` without a process group. Created on first call: call on every rank."""
        return None

    def checkpoint_state(self, wrapped: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """``{"model", "optimizer"}`` of ``torch.distributed.checkpoint.state_dict.get_state_dict``: this rank's
        shards under fsdp, whole tensors in the other modes (a checkpoint of any mode loads into any)."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optimizer_state = get_state_dict(unwrap(wrapped), optimizer)
        return {"model": model_state, "optimizer": optimizer_state}

    def set_checkpoint_state(self, wrapped: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        """Put :meth:`checkpoint_state`'s dicts, filled from a checkpoint, into the model and the optimizer."""
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(unwrap(wrapped), optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])

    # collectives ----------------------------------------------------------
    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` (any shape) over all processes, on ``tensor``'s device (one process: ``tensor`` itself)."""
        return tensor

    def all_reduce_sum_async(self, tensor: torch.Tensor) -> Callable[[], torch.Tensor]:
        """:meth:`all_reduce_sum` started now and read by calling the result (no collective: at once)."""
        reduced = self.all_reduce_sum(tensor)
        return lambda: reduced

    def barrier(self) -> None:
        """Wait for every process."""

    def all_gather_object(self, obj: T) -> list[T]:
        """Return every rank's ``obj`` (picklable), indexed by rank."""
        return [obj]

    stop_code: int = 0  # the agreed stop: 0, or a runner.errors.stop_code (the signal and the rank it reached)

    def reduce_stop_decision(self, flag: int, *, settle: bool = False) -> bool:
        """Whether every rank stops now, given this rank's ``flag`` (0 or its :func:`stop_code`; the largest is kept),
        as Fabric's ``reduce_boolean_decision(all=False)``: ``settle=True`` agrees on it, ``settle=False`` answers
        without a collective."""
        self.stop_code = max(self.stop_code, int(flag))
        return bool(flag)


AmpMode = Literal["no", "bf16", "fp16"]
_DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16}


class Precision:
    """Autocast and gradient scaling for ``device``, as ``train.amp`` asks.

    ``"no"``: plain calls. ``"bf16"``: autocast to bfloat16, no scaling. ``"fp16"``: autocast to float16 and a
    ``GradScaler``, enabled on CUDA only. ``dtype`` is the autocast dtype or ``None``; ``scaling`` says fp16 on CUDA.
    """

    def __init__(self, amp: AmpMode, device: torch.device) -> None:
        self.amp = amp
        self.device_type = device.type
        self.dtype: torch.dtype | None = _DTYPES.get(amp)
        self.scaling = amp == "fp16" and device.type == "cuda"
        self._scaler = torch.amp.GradScaler(device.type, enabled=self.scaling)

    def autocast(self) -> contextlib.AbstractContextManager[object]:
        """The context to run forward and loss in: ``torch.autocast`` with :attr:`dtype`, else a null context."""
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device_type, dtype=self.dtype)

    def backward(self, loss: torch.Tensor) -> None:
        """Back-propagate ``loss`` (a scalar), scaled first when :attr:`scaling`."""
        self._scaler.scale(loss).backward()

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the gradients by the scale in place, before clipping; at most once a step, a no-op without scaling."""
        self._scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """``optimizer.step()``; with scaling, skipped when the gradients hold ``inf``/``NaN`` (the scale shrinks)."""
        self._scaler.step(optimizer)
        self._scaler.update()

    def state_dict(self) -> dict[str, Any] | None:
        """The scaler's state for a checkpoint, or ``None`` without scaling."""
        return self._scaler.state_dict() if self.scaling else None

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Restore :meth:`state_dict`'s output; ``None`` (a checkpoint without scaling) changes nothing."""
        if state is not None and self.scaling:
            self._scaler.load_state_dict(state)


_WRAPPERS = (DataParallel, DistributedDataParallel)
_MAX_KEYS_SHOWN = 20


def unwrap(module: nn.Module) -> nn.Module:
    """Return the user's model inside DataParallel / DDP / ``torch.compile`` wrappers (itself when unwrapped)."""
    while True:
        if isinstance(module, _WRAPPERS):
            module = module.module
        elif hasattr(module, "_orig_mod") and isinstance(module._orig_mod, nn.Module):
            module = module._orig_mod
        else:
            return module


def key_list(keys: list[str]) -> str:
    """``"a, b, c (+N more)"`` for at most 20 keys; ``"none"`` for no keys."""
    shown = ", ".join(keys[:_MAX_KEYS_SHOWN])
    more = f" (+{len(keys) - _MAX_KEYS_SHOWN} more)" if len(keys) > _MAX_KEYS_SHOWN else ""
    return f"{shown}{more}" if keys else "none"


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

    @classmethod
    def create(cls, parallel: ParallelSpec, plan: DevicePlan, env: LauncherEnvironment, amp: str) -> Strategy:
        """A dp strategy over ``plan``'s GPUs."""
        return cls(plan, parallel)

    @staticmethod
    def memory(step: StepMemory) -> list[dict[str, Any]]:
        """Device 0 holds a replica, the whole batch's inputs and the gathered outputs, and the only optimizer state;
        the other devices a replica and their share's activations and gradients."""
        local = step.local
        first = {"device": "0", **local, "peak": local["peak"] + step.whole["input_bytes"] + step.whole["output_bytes"]}
        others = {**local, "optimizer": 0, "peak": local["peak"] - local["optimizer"]}
        rest = f"1-{step.devices - 1}" if step.devices > 2 else "1"
        return [first, {**others, "device": rest}]

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

"""The Strategy interface: how one process runs the model (device, wrapping, collectives, the stop decision). Details:
docs/design.md, "Module notes"."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar, Literal, TypeVar

import torch
from torch import nn
from torch.distributed._composable import checkpoint
from torch.nn.parallel import DataParallel, DistributedDataParallel

from runner.errors import SpecError, SpecIssue, did_you_mean, with_hint
from runner.spec.schema_parallel import MODES, ModeTraits

if TYPE_CHECKING:
    from runner.devices.resolve import DevicePlan
    from runner.spec.schema import TrainSpec


T = TypeVar("T")


def find_blocks(module: nn.Module, names: list[str] | None) -> list[nn.Module]:
    """The modules sharded as one unit each, outermost first (``names``: ``parallel.fsdp_blocks``, or each child).
    Raises SpecError: A name is no module class of the model (with a did-you-mean)."""
    if names is None:  # a child that shares a parameter with another (tied weights) stays with the root's unit
        children = [child for child in module.children() if any(True for _ in child.parameters())]
        return [child for child in children if not _shares_parameters(child, children)]
    present = sorted({type(m).__name__ for m in module.modules()})
    for name in names:
        if name not in present:
            hint = did_you_mean(name, present, n=3)
            message = with_hint(f"{name!r} is no module class of the model", hint)
            message += f"; its classes are {', '.join(present)}"
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

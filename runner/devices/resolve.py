"""Resolve the accelerator and device ids of a spec against the visible GPUs; narrow CUDA_VISIBLE_DEVICES.

Three steps, kept apart so the middle one is pure and testable without a GPU:

1. :func:`runner.devices.inventory.probe_inventory` lists the GPUs
   visible when runner starts, through ``nvidia-smi`` and an inherited
   ``CUDA_VISIBLE_DEVICES``, without initialising CUDA in this process.
2. :func:`resolve_devices` turns spec + environment + inventory into a
   :class:`DevicePlan` (accelerator, chosen devices, world size, backend,
   per-device batch) or raises :class:`~runner.errors.DeviceError`.
3. :func:`apply_device_env` narrows ``CUDA_VISIBLE_DEVICES`` to the chosen
   devices, so that inside this process and its children they are
   ``cuda:0 .. cuda:n-1``.

Numbering: ``devices.ids`` index the GPUs visible when runner starts (the
user's view, honouring an inherited ``CUDA_VISIBLE_DEVICES``). ``entry`` is the
``CUDA_VISIBLE_DEVICES`` item that selects a device as inherited (an integer
or a ``GPU-``/``MIG-`` UUID); ``physical_index`` is nvidia-smi's index (PCI bus
order, which CUDA follows once ``CUDA_DEVICE_ORDER=PCI_BUS_ID``).
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from runner.devices.inventory import DEFAULT_ORDER, ORDER_VAR, VISIBLE_VAR, Inventory
from runner.errors import DeviceError


@dataclass(frozen=True)
class DevicePlan:
    """Where and how a spec runs on this machine; see :func:`resolve_devices`.

    Attributes:
        accelerator: ``"cuda"`` or ``"cpu"``.
        mode: ``"none"``, ``"dp"`` or ``"ddp"``.
        requested_ids: Chosen visible indices (the user's numbering); empty on CPU.
        visible: ``CUDA_VISIBLE_DEVICES`` entries of every visible GPU (inherited view).
        selected: ``CUDA_VISIBLE_DEVICES`` entries of the chosen GPUs, in order.
        names: Device names of the chosen GPUs.
        uuids: UUIDs of the chosen GPUs (``None`` when unknown).
        nproc_per_node: Processes on this node (1 unless ddp).
        nnodes: Nodes (1 unless ddp).
        world_size: ``nnodes * nproc_per_node``.
        backend: Process-group backend for ddp, else ``None``.
        global_batch: ``data.batch_size``: samples per optimizer step across all devices.
        per_device_batch: Samples each device sees in one forward pass (one
            micro-batch): dp's scatter split, ddp's per-rank batch, or ``[B]``.
        grad_accum_steps: Micro-batches per optimizer step.
        output_index: dp only: position of ``parallel.output_device`` within the chosen ids.
        env: Variables to set in this process and its children.
        notes: Warnings worth showing, e.g. ``"dp with one device runs unwrapped"``.
        physical_indices: nvidia-smi indices of the chosen GPUs (``None`` when unknown).
        total_memory_bytes: Memory of the chosen GPUs in bytes (``None`` when unknown).
    """

    accelerator: Literal["cuda", "cpu"]
    mode: Literal["none", "dp", "ddp"]
    requested_ids: list[int]
    visible: list[str]
    selected: list[str]
    names: list[str]
    uuids: list[str | None]
    nproc_per_node: int
    nnodes: int
    world_size: int
    backend: Literal["nccl", "gloo"] | None
    global_batch: int
    per_device_batch: list[int]
    env: dict[str, str]
    notes: list[str] = field(default_factory=list)
    grad_accum_steps: int = 1
    output_index: int = 0
    physical_indices: list[int | None] = field(default_factory=list)
    total_memory_bytes: list[int | None] = field(default_factory=list)

    def describe(self) -> dict[str, Any]:
        """Return a JSON-able summary for ``runner plan`` and MLflow.

        Returns:
            A dict with the accelerator, mode, one entry per chosen device
            (requested id -> index inside the process after narrowing ->
            ``CUDA_VISIBLE_DEVICES`` entry -> nvidia-smi index -> name -> uuid),
            world size, backend, batch sizes, the environment set and the notes.
        """
        devices = []
        for pos, dev_id in enumerate(self.requested_ids):
            devices.append(
                {
                    "id": dev_id,
                    "cuda_index": pos,
                    "entry": self.selected[pos],
                    "physical_index": _at(self.physical_indices, pos),
                    "name": self.names[pos],
                    "uuid": self.uuids[pos],
                    "total_memory_bytes": _at(self.total_memory_bytes, pos),
                }
            )
        return {
            "accelerator": self.accelerator,
            "mode": self.mode,
            "devices": devices,
            "visible": list(self.visible),
            "nnodes": self.nnodes,
            "nproc_per_node": self.nproc_per_node,
            "world_size": self.world_size,
            "backend": self.backend,
            "global_batch": self.global_batch,
            "grad_accum_steps": self.grad_accum_steps,
            "per_device_batch": list(self.per_device_batch),
            "output_device": self.output_index if self.mode == "dp" else None,
            "env": dict(self.env),
            "notes": list(self.notes),
        }


def _at(values: Sequence[Any], pos: int) -> Any:
    return values[pos] if pos < len(values) else None


# --------------------------------------------------------------------------- resolve


def _visible_text(env: Mapping[str, str]) -> str:
    value = env.get(VISIBLE_VAR)
    return f"{VISIBLE_VAR}={value!r}" if value is not None else f"{VISIBLE_VAR} unset"


def _visible_listing(inventory: Inventory) -> str:
    if not inventory.gpus:
        return "none"
    return "; ".join(g.label() for g in inventory.gpus)


def chunk_sizes(total: int, parts: int) -> list[int]:
    """Sizes ``torch.chunk`` (and so DataParallel's scatter) gives to each of ``parts`` devices.

    Chunks hold ``ceil(total / parts)`` samples; the last one holds the rest, and
    devices past the last chunk get nothing (10 over 4 -> ``[3, 3, 3, 1]``,
    9 over 4 -> ``[3, 3, 3, 0]``).

    Args:
        total: Samples in the batch.
        parts: Devices.

    Returns:
        A list of ``parts`` sizes summing to ``total``.
    """
    size = math.ceil(total / parts)
    out = []
    left = total
    for _ in range(parts):
        take = min(size, left)
        out.append(take)
        left -= take
    return out


def resolve_devices(spec: Any, env: Mapping[str, str], inventory: Inventory) -> DevicePlan:
    """Decide where a spec runs on this machine (pure: reads nothing else).

    Args:
        spec: The validated :class:`~runner.spec.schema.ExperimentSpec`.
        env: The environment runner started with (for ``CUDA_VISIBLE_DEVICES`` and
            ``CUDA_DEVICE_ORDER``).
        inventory: GPUs visible at start, from :func:`probe_inventory` (or a fake one).

    Returns:
        The :class:`DevicePlan`.

    Raises:
        DeviceError: ``accelerator = "cuda"`` without a visible GPU; ids out of
            range; dp without GPUs; nccl, sync_batchnorm or fp16 on CPU; a ddp
            ``nproc_per_node`` that differs from the number of GPUs; a global batch
            that does not divide by ``world_size * grad_accum_steps``.
    """
    dev, par, train = spec.devices, spec.parallel, spec.train
    mode = par.mode
    notes = list(inventory.notes)
    usable = bool(inventory.gpus) and inventory.cuda_available

    if dev.accelerator == "cuda" and not usable:
        if inventory.gpus:
            why = f"{len(inventory.gpus)} GPU(s) are visible but the installed torch is built without CUDA"
        else:
            why = f"no GPU is visible ({_visible_text(env)}; {inventory.source})"
        raise DeviceError(
            f'devices.accelerator = "cuda" but {why}; runner never falls back to CPU silently: '
            f'set devices.accelerator = "cpu" (or "auto"), or run where a GPU is visible'
        )
    accelerator: Literal["cuda", "cpu"] = (
        "cuda" if dev.accelerator == "cuda" or (dev.accelerator == "auto" and usable) else "cpu"
    )
    if dev.accelerator == "auto" and inventory.gpus and not usable:
        notes.append("accelerator = auto chose cpu: GPUs are visible but torch is built without CUDA")

    if accelerator == "cpu":
        if mode == "dp":
            raise DeviceError(
                f'parallel.mode = "dp" needs CUDA GPUs but none is usable ({_visible_text(env)}; {inventory.source}): '
                f'use parallel.mode = "none", or "ddp" (backend gloo runs on CPU)'
            )
        if par.backend == "nccl":
            raise DeviceError(
                'parallel.backend = "nccl" needs CUDA but the run is on cpu: use backend = "gloo" (or "auto")'
            )
        if par.sync_batchnorm:
            raise DeviceError("parallel.sync_batchnorm needs CUDA but the run is on cpu: remove it, or run on GPUs")
        if train.amp == "fp16":
            raise DeviceError('train.amp = "fp16" needs CUDA but the run is on cpu: use amp = "bf16" or "no"')
        ids: list[int] = []
        child_env: dict[str, str] = {}
        if isinstance(dev.ids, list):
            notes.append(f"devices.ids = {dev.ids} is ignored: the run is on cpu")
        if dev.accelerator == "cpu" and inventory.gpus:
            child_env[VISIBLE_VAR] = ""  # hide the GPUs so nothing (cuDNN, libraries) touches them
    else:
        n_visible = len(inventory.gpus)
        ids = list(range(n_visible)) if dev.ids == "all" else list(dev.ids)
        bad = [i for i in ids if i >= n_visible]
        if bad:
            raise DeviceError(
                f"devices.ids = {list(dev.ids)} asks for {bad} but only {n_visible} GPU(s) are visible "
                f"({_visible_text(env)}), numbered 0..{n_visible - 1}: {_visible_listing(inventory)}. "
                f"ids count the visible GPUs, not nvidia-smi's numbering"
            )
        if mode == "none" and len(ids) > 1:
            notes.append(f"mode = none uses only device {ids[0]} of {len(ids)} visible")
            ids = ids[:1]
        if mode == "dp" and len(ids) == 1:
            notes.append("dp with one device runs unwrapped (no DataParallel)")
        child_env = {
            VISIBLE_VAR: ",".join(inventory.gpus[i].visible_entry for i in ids),
            ORDER_VAR: env.get(ORDER_VAR, DEFAULT_ORDER),
        }

    output_index = 0
    if mode == "dp" and par.output_device is not None:
        if par.output_device not in ids:
            raise DeviceError(f"parallel.output_device = {par.output_device} is not one of the chosen devices {ids}")
        output_index = ids.index(par.output_device)

    backend: Literal["nccl", "gloo"] | None = None
    nnodes, nproc = 1, 1
    if mode == "ddp":
        nnodes = par.nnodes
        default_nproc = len(ids) if accelerator == "cuda" else 1
        nproc = par.nproc_per_node if par.nproc_per_node is not None else default_nproc
        if accelerator == "cuda" and nproc != len(ids):
            raise DeviceError(
                f"parallel.nproc_per_node = {nproc} but {len(ids)} GPU(s) are chosen (devices.ids = {dev.ids}): "
                f"ddp runs one process per GPU; set nproc_per_node = {len(ids)} or list {nproc} ids"
            )
        backend = ("nccl" if accelerator == "cuda" else "gloo") if par.backend == "auto" else par.backend
    world = nnodes * nproc

    batch, accum = spec.data.batch_size, train.grad_accum_steps
    per_step = world * accum
    if batch % per_step:
        what = f"world size {world}" + (f" x grad_accum_steps {accum}" if accum > 1 else "")
        raise DeviceError(
            f"data.batch_size = {batch} is not divisible by {what} = {per_step}: "
            f"use a multiple of {per_step}, e.g. {max(per_step, batch - batch % per_step)}"
        )
    micro = batch // per_step
    if mode == "dp" and len(ids) > 1:
        per_device = chunk_sizes(micro, len(ids))
        idle = [ids[k] for k, size in enumerate(per_device) if size == 0]
        if idle:
            notes.append(
                f"a micro-batch of {micro} leaves device(s) {idle} idle under dp (torch.chunk split {per_device})"
            )
    elif mode == "ddp":
        per_device = [micro] * nproc
    else:
        per_device = [micro]

    chosen = [inventory.gpus[i] for i in ids]
    return DevicePlan(
        accelerator=accelerator,
        mode=mode,
        requested_ids=ids,
        visible=[g.visible_entry for g in inventory.gpus],
        selected=[g.visible_entry for g in chosen],
        names=[g.name for g in chosen],
        uuids=[g.uuid for g in chosen],
        nproc_per_node=nproc,
        nnodes=nnodes,
        world_size=world,
        backend=backend,
        global_batch=batch,
        per_device_batch=per_device,
        env=child_env,
        notes=notes,
        grad_accum_steps=accum,
        output_index=output_index,
        physical_indices=[g.physical_index for g in chosen],
        total_memory_bytes=[g.total_memory_bytes for g in chosen],
    )


# --------------------------------------------------------------------------- apply


def cuda_initialized() -> bool:
    """Whether CUDA is initialised in this process (never imports torch to find out)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    cuda = getattr(torch, "cuda", None)
    return bool(cuda is not None and cuda.is_initialized())


def apply_device_env(plan: DevicePlan, environ: MutableMapping[str, str] = os.environ) -> None:
    """Set ``plan.env`` in ``environ`` so this process and its children see only the chosen devices.

    Afterwards the chosen GPUs are ``cuda:0 .. cuda:n-1`` in this process, in
    ``devices.ids`` order.

    Args:
        plan: The resolved plan.
        environ: Environment to change (default: this process's).

    Raises:
        DeviceError: CUDA is already initialised in this process and the plan
            would change ``CUDA_VISIBLE_DEVICES`` or ``CUDA_DEVICE_ORDER``; CUDA
            keeps its first view, so the run would silently use other cards.
    """
    changes = {k: v for k, v in plan.env.items() if environ.get(k) != v}
    if changes and cuda_initialized():
        now = {k: environ.get(k) for k in changes}
        raise DeviceError(
            f"CUDA is already initialised in this process, so setting {changes} (now {now}) would not take effect "
            f"and the run would use other GPUs than planned; resolve and apply devices before anything touches CUDA"
        )
    environ.update(changes)

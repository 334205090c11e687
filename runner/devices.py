"""Resolve the accelerator and device ids of a spec against the visible GPUs; narrow CUDA_VISIBLE_DEVICES.

Three steps, kept apart so the middle one is pure and testable without a GPU:

1. :func:`probe_inventory` lists the GPUs visible when runner starts, through
   ``nvidia-smi`` and an inherited ``CUDA_VISIBLE_DEVICES``, without
   initialising CUDA in this process.
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
import shutil
import subprocess
import sys
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from runner.errors import DeviceError

VISIBLE_VAR = "CUDA_VISIBLE_DEVICES"
ORDER_VAR = "CUDA_DEVICE_ORDER"
DEFAULT_ORDER = "PCI_BUS_ID"
NVIDIA_SMI_QUERY = ("--query-gpu=index,name,uuid,memory.total", "--format=csv,noheader,nounits")


@dataclass(frozen=True)
class GpuInfo:
    """One GPU visible when runner starts.

    Attributes:
        index: Visible index, the number ``devices.ids`` refers to (0-based).
        name: Device name, e.g. ``NVIDIA A100-SXM4-80GB``.
        uuid: ``GPU-...`` UUID, or ``None`` when unknown.
        total_memory_bytes: Device memory in bytes, or ``None`` when unknown.
        entry: The ``CUDA_VISIBLE_DEVICES`` item that selects this device, as
            inherited (``"3"`` or ``"GPU-5a1c..."``); ``None`` means ``str(index)``.
        physical_index: nvidia-smi's index (PCI bus order), or ``None`` when unknown.
    """

    index: int
    name: str
    uuid: Optional[str] = None
    total_memory_bytes: Optional[int] = None
    entry: Optional[str] = None
    physical_index: Optional[int] = None

    @property
    def visible_entry(self) -> str:
        """The ``CUDA_VISIBLE_DEVICES`` item that selects this device."""
        return self.entry if self.entry is not None else str(self.index)

    def label(self) -> str:
        """Return ``"2 -> NVIDIA A100 (CUDA_VISIBLE_DEVICES entry 5)"`` for messages."""
        where = f"CUDA_VISIBLE_DEVICES entry {self.visible_entry}"
        if self.physical_index is not None and str(self.physical_index) != self.visible_entry:
            where += f", nvidia-smi index {self.physical_index}"
        return f"{self.index} -> {self.name} ({where})"


@dataclass(frozen=True)
class Inventory:
    """The GPUs visible when runner starts.

    Attributes:
        gpus: Visible GPUs in visible order; ``gpus[i].index == i``.
        cuda_available: Whether torch is built with CUDA and at least one GPU is visible.
        inherited_visible: ``CUDA_VISIBLE_DEVICES`` as inherited (``None`` when unset).
        source: How the GPUs were found, e.g. ``"nvidia-smi"`` or why none were.
        notes: Things worth telling the user (ignored entries, device order).
    """

    gpus: list[GpuInfo] = field(default_factory=list)
    cuda_available: bool = False
    inherited_visible: Optional[str] = None
    source: str = "none"
    notes: list[str] = field(default_factory=list)


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
    uuids: list[Optional[str]]
    nproc_per_node: int
    nnodes: int
    world_size: int
    backend: Optional[Literal["nccl", "gloo"]]
    global_batch: int
    per_device_batch: list[int]
    env: dict[str, str]
    notes: list[str] = field(default_factory=list)
    grad_accum_steps: int = 1
    output_index: int = 0
    physical_indices: list[Optional[int]] = field(default_factory=list)
    total_memory_bytes: list[Optional[int]] = field(default_factory=list)

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


# --------------------------------------------------------------------------- probe

SmiRunner = Callable[[], Optional[str]]


def _run_nvidia_smi() -> Optional[str]:
    """Return nvidia-smi's CSV output, or ``None`` when it is missing or fails."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        proc = subprocess.run([exe, *NVIDIA_SMI_QUERY], capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout if proc.returncode == 0 else None


def _parse_smi(text: str) -> list[tuple[int, str, Optional[str], Optional[int]]]:
    """Parse ``index, name, uuid, memory.total [MiB]`` rows."""
    rows = []
    for line in text.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 4 or not parts[0].isdigit():
            continue
        index, name, uuid, mem = int(parts[0]), ",".join(parts[1:-2]), parts[-2], parts[-1]
        mem_bytes = int(float(mem.split()[0]) * 2**20) if mem and mem[0].isdigit() else None
        rows.append((index, name, uuid if uuid.startswith(("GPU-", "MIG-")) else None, mem_bytes))
    return rows


def _map_visible(
    value: Optional[str], rows: list[tuple[int, str, Optional[str], Optional[int]]]
) -> tuple[list[GpuInfo], list[str]]:
    """Apply CUDA's ``CUDA_VISIBLE_DEVICES`` rules to nvidia-smi rows.

    CUDA's rules (mirrored by ``torch.cuda._parse_visible_devices``): unset means
    all; an item that matches no device ends the list (so ``""`` and ``-1`` mean
    none); a repeated item hides every device; ``GPU-`` items match a unique
    UUID prefix.
    """
    if value is None:
        return [GpuInfo(pos, name, uuid, mem, str(idx), idx) for pos, (idx, name, uuid, mem) in enumerate(rows)], []
    notes: list[str] = []
    by_index = {r[0]: r for r in rows}
    chosen: list[tuple[str, tuple[int, str, Optional[str], Optional[int]] | None]] = []
    for raw in value.split(","):
        item = raw.strip()
        if item.startswith("MIG-"):
            chosen.append((item, None))
            continue
        if item.startswith("GPU-"):
            matches = [r for r in rows if r[2] is not None and r[2].startswith(item)]
            if len(matches) != 1:
                why = "matches no GPU" if not matches else "matches several GPUs"
                notes.append(f"{VISIBLE_VAR} item {item!r} {why}; CUDA ignores it and every item after it")
                break
            chosen.append((item, matches[0]))
            continue
        digits = item.lstrip("+")
        if not digits.isdigit() or int(digits) not in by_index:
            if item not in ("", "-1"):
                notes.append(f"{VISIBLE_VAR} item {item!r} is not a GPU index on this machine; CUDA ignores it and every item after it")
            break
        chosen.append((item, by_index[int(digits)]))
    keys = [row[0] if row is not None else item for item, row in chosen]
    if len(set(keys)) != len(keys):
        notes.append(f"{VISIBLE_VAR}={value!r} names a device twice; CUDA then shows no device at all")
        return [], notes
    gpus = []
    for pos, (item, row) in enumerate(chosen):
        if row is None:
            gpus.append(GpuInfo(pos, "MIG instance", item, None, item, None))
        else:
            gpus.append(GpuInfo(pos, row[1], row[2], row[3], item, row[0]))
    return gpus, notes


def _torch_has_cuda() -> bool:
    """Whether the installed torch is built with CUDA (imports torch; never initialises CUDA)."""
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.version.cuda) and torch.backends.cuda.is_built()


def probe_inventory(env: Mapping[str, str] = os.environ, run_smi: SmiRunner = _run_nvidia_smi) -> Inventory:
    """List the GPUs visible to runner without initialising CUDA in this process.

    Reads ``nvidia-smi --query-gpu=index,name,uuid,memory.total`` and applies an
    inherited ``CUDA_VISIBLE_DEVICES`` (integer or ``GPU-`` UUID items, comma
    separated; empty or ``-1`` means none). Without nvidia-smi no GPU is reported.
    The environment is only read: :func:`resolve_devices` puts
    ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` (unless the user chose an order) into the plan's
    ``env`` so that CUDA's numbering matches nvidia-smi's.

    Args:
        env: Environment to read ``CUDA_VISIBLE_DEVICES`` and ``CUDA_DEVICE_ORDER`` from.
        run_smi: Returns nvidia-smi's CSV output or ``None``; replaceable in tests.

    Returns:
        The inventory; ``gpus`` is empty on a machine without (visible) NVIDIA GPUs.
    """
    inherited = env.get(VISIBLE_VAR)
    text = run_smi()
    if text is None:
        return Inventory([], False, inherited, "nvidia-smi not found or failed: no GPU reported", [])
    rows = _parse_smi(text)
    gpus, notes = _map_visible(inherited, rows)
    order = env.get(ORDER_VAR)
    if order not in (None, DEFAULT_ORDER) and gpus and any(not g.visible_entry.startswith(("GPU-", "MIG-")) for g in gpus):
        notes.append(
            f"{ORDER_VAR}={order}: CUDA numbers GPUs differently from nvidia-smi, so the names shown may not "
            f"match the devices used; unset it or set {ORDER_VAR}={DEFAULT_ORDER}"
        )
    cuda_ok = bool(gpus) and _torch_has_cuda()
    if gpus and not cuda_ok:
        notes.append("GPUs are visible but the installed torch is built without CUDA")
    return Inventory(gpus, cuda_ok, inherited, f"nvidia-smi ({len(rows)} GPU(s) on the machine)", notes)


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
        spec: The validated :class:`~runner.spec.ExperimentSpec`.
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
            f"devices.accelerator = \"cuda\" but {why}; runner never falls back to CPU silently: "
            f"set devices.accelerator = \"cpu\" (or \"auto\"), or run where a GPU is visible"
        )
    accelerator: Literal["cuda", "cpu"] = "cuda" if dev.accelerator == "cuda" or (dev.accelerator == "auto" and usable) else "cpu"
    if dev.accelerator == "auto" and inventory.gpus and not usable:
        notes.append("accelerator = auto chose cpu: GPUs are visible but torch is built without CUDA")

    if accelerator == "cpu":
        if mode == "dp":
            raise DeviceError(
                f"parallel.mode = \"dp\" needs CUDA GPUs but none is usable ({_visible_text(env)}; {inventory.source}): "
                f"use parallel.mode = \"none\", or \"ddp\" (backend gloo runs on CPU)"
            )
        if par.backend == "nccl":
            raise DeviceError("parallel.backend = \"nccl\" needs CUDA but the run is on cpu: use backend = \"gloo\" (or \"auto\")")
        if par.sync_batchnorm:
            raise DeviceError("parallel.sync_batchnorm needs CUDA but the run is on cpu: remove it, or run on GPUs")
        if train.amp == "fp16":
            raise DeviceError("train.amp = \"fp16\" needs CUDA but the run is on cpu: use amp = \"bf16\" or \"no\"")
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

    backend: Optional[Literal["nccl", "gloo"]] = None
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
            notes.append(f"a micro-batch of {micro} leaves device(s) {idle} idle under dp (torch.chunk split {per_device})")
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

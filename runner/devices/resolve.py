"""Resolve the accelerator and device ids of a spec against the visible GPUs; narrow CUDA_VISIBLE_DEVICES.

Three steps, kept apart so the middle one is pure and testable without a GPU:

1. ``runner.devices.inventory.probe_inventory`` lists the GPUs
   visible when runner starts, through NVML and an inherited
   ``CUDA_VISIBLE_DEVICES``, without initialising CUDA in this process.
2. ``resolve_devices`` turns spec + environment + inventory into a
   ``DevicePlan`` (accelerator, chosen devices, world size, backend,
   per-device batch) or raises ``runner.errors.DeviceError``.
3. ``runner.devices.inventory.apply_device_env`` narrows ``CUDA_VISIBLE_DEVICES``
   to the chosen devices, so that inside this process and its children they are
   ``cuda:0 .. cuda:n-1``.

Only the rules that need the machine are checked here (a GPU is visible, ``auto`` found
CUDA, the GPU count); the schema checks what the spec alone decides. Both word a rule with
the same function of ``runner.spec.rules``, and never check it twice for one spec.

Numbering: ``devices.ids`` index the GPUs visible when runner starts (the
user's view, honouring an inherited ``CUDA_VISIBLE_DEVICES``). ``entry`` is the
``CUDA_VISIBLE_DEVICES`` item that selects a device as inherited (an integer
or a ``GPU-``/``MIG-`` UUID); ``physical_index`` is the index in PCI bus order
(nvidia-smi's index), which CUDA follows once ``CUDA_DEVICE_ORDER=PCI_BUS_ID``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

from runner.devices.inventory import DEFAULT_ORDER, ORDER_VAR, VISIBLE_VAR, Inventory, cuda_initialized
from runner.errors import DeviceError, show
from runner.spec import rules
from runner.spec.schema import cuda_only_problems, static_world_size
from runner.spec.schema_parallel import MODES

if TYPE_CHECKING:  # pragma: no cover
    from runner.spec.schema import ExperimentSpec
    from runner.spec.schema_parallel import DevicesSpec, ParallelSpec

Accelerator = Literal["cuda", "cpu"]


@dataclass(frozen=True)
class DevicePlan:
    """Where and how a spec runs on this machine; see :func:`resolve_devices`.

    ``requested_ids`` are the user's visible indices; ``visible``/``selected`` are ``CUDA_VISIBLE_DEVICES`` entries;
    ``per_device_batch`` is what each device sees in one forward pass; ``output_index`` is dp's output device among the
    ids; ``env`` is set in this process and its children; ``threads_from`` says where the thread count comes from.
    """

    accelerator: Accelerator
    mode: str
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
    threads_per_process: int = 1
    threads_from: str = "default"

    @property
    def replicas(self) -> bool:
        """One process drives every chosen GPU (dp)."""
        return MODES[self.mode].replicas

    def describe(self) -> dict[str, Any]:
        """A JSON-able summary for ``runner plan`` and MLflow, with each chosen device's numbering from id to uuid."""
        devices = [
            {
                "id": dev_id,
                "cuda_index": pos,
                "entry": self.selected[pos],
                "physical_index": _at(self.physical_indices, pos),
                "name": self.names[pos],
                "uuid": self.uuids[pos],
                "total_memory_bytes": _at(self.total_memory_bytes, pos),
            }
            for pos, dev_id in enumerate(self.requested_ids)
        ]
        plain = {k: v for k, v in dataclasses.asdict(self).items() if k not in _PER_DEVICE}  # copies of every list
        return {**plain, "devices": devices, "output_device": self.output_index if self.replicas else None}


# DevicePlan's fields that describe() folds into one entry per device (``output_index``: dp's ``output_device``)
_PER_DEVICE = ("requested_ids", "selected", "names", "uuids", "physical_indices", "total_memory_bytes", "output_index")


def _at(values: Sequence[Any], pos: int) -> Any:
    return values[pos] if pos < len(values) else None


# --------------------------------------------------------------------------- resolve


def threads_per_process(requested: int, env: Mapping[str, str], cores: int, processes: int) -> tuple[int, str]:
    """``(threads, source)`` for each training process, the same rule in every mode (docs/design.md §3)."""
    if requested > 0:
        return requested, "devices.threads_per_process"
    omp = env.get("OMP_NUM_THREADS", "").strip()
    if omp.isdigit() and int(omp) > 0:
        return int(omp), "OMP_NUM_THREADS"
    per_task = env.get("SLURM_CPUS_PER_TASK", "").strip()
    if per_task.isdigit() and int(per_task) > 0:
        cores = min(cores, int(per_task))
    processes = max(1, processes)
    return max(1, cores // processes), f"{cores} usable cores / {processes} training processes"


def chunk_sizes(total: int, parts: int) -> list[int]:
    """What ``torch.chunk`` (DataParallel's scatter) gives each of ``parts`` devices: 10 over 4 -> ``[3, 3, 3, 1]``."""
    size = math.ceil(total / parts)
    return [max(0, min(size, total - k * size)) for k in range(parts)]


def resolve_devices(spec: ExperimentSpec, env: Mapping[str, str], inventory: Inventory) -> DevicePlan:
    """Decide where a spec runs on this machine from ``env`` and ``inventory`` alone. Raises DeviceError: A GPU asked
    for and missing, ids out of range, a CUDA-only setting without a GPU, a ddp ``nproc_per_node`` unlike the GPU
    count, or a batch that the world size does not divide; at its key."""
    notes = list(inventory.notes)
    accelerator = _choose_accelerator(spec.devices, env, inventory, notes)
    if accelerator == "cpu":
        _check_cpu_run(spec, env, inventory)
        ids: list[int] = []
        child_env = _cpu_env(spec.devices, inventory, notes)
    else:
        ids = _select_gpus(spec, env, inventory, notes)
        child_env = {
            VISIBLE_VAR: ",".join(inventory.gpus[i].visible_entry for i in ids),
            ORDER_VAR: env.get(ORDER_VAR, DEFAULT_ORDER),
        }
    layout = _process_layout(spec, accelerator, ids)
    chosen = [inventory.gpus[i] for i in ids]
    threads, threads_from = threads_per_process(
        spec.devices.threads_per_process, env, inventory.cores, layout.nproc_per_node
    )
    return DevicePlan(
        accelerator=accelerator,
        mode=spec.parallel.mode,
        requested_ids=ids,
        visible=[g.visible_entry for g in inventory.gpus],
        selected=[g.visible_entry for g in chosen],
        names=[g.name for g in chosen],
        uuids=[g.uuid for g in chosen],
        **layout._asdict(),
        global_batch=spec.data.batch_size,
        per_device_batch=_split_batch(spec, layout, ids, notes),
        env=child_env,
        notes=notes,
        grad_accum_steps=spec.train.grad_accum_steps,
        output_index=_output_index(spec.parallel, ids),
        physical_indices=[g.physical_index for g in chosen],
        total_memory_bytes=[g.total_memory_bytes for g in chosen],
        threads_per_process=threads,
        threads_from=threads_from,
    )


def _visible_text(env: Mapping[str, str]) -> str:
    value = env.get(VISIBLE_VAR)
    return f"{VISIBLE_VAR}={value!r}" if value is not None else f"{VISIBLE_VAR} unset"


def _no_gpu_reason(env: Mapping[str, str], inventory: Inventory) -> str:
    """Why CUDA cannot be used here: no visible GPU, or a torch built without CUDA."""
    if inventory.gpus:
        return f"{len(inventory.gpus)} GPU(s) are visible but the installed torch is built without CUDA"
    return f"no GPU is visible ({_visible_text(env)}; {inventory.source})"


def _choose_accelerator(
    devices: DevicesSpec, env: Mapping[str, str], inventory: Inventory, notes: list[str]
) -> Accelerator:
    """``cuda`` when asked for or found by ``auto``, else ``cpu``; DeviceError for cuda without a usable GPU."""
    usable = bool(inventory.gpus) and inventory.cuda_available
    if devices.accelerator == "cuda" and not usable:
        raise DeviceError(
            f'accelerator = "cuda" but {_no_gpu_reason(env, inventory)}; runner never falls back to CPU silently: '
            f'set devices.accelerator = "cpu" (or "auto"), or run where a GPU is visible',
            key="devices.accelerator",
        )
    if devices.accelerator == "auto" and inventory.gpus and not usable:
        notes.append("accelerator = auto chose cpu: GPUs are visible but torch is built without CUDA")
    return "cuda" if devices.accelerator == "cuda" or (devices.accelerator == "auto" and usable) else "cpu"


def _check_cpu_run(spec: ExperimentSpec, env: Mapping[str, str], inventory: Inventory) -> None:
    """DeviceError for the first CUDA-only setting (dp, nccl, sync_batchnorm, fp16) when ``auto`` found no GPU."""
    if spec.devices.accelerator != "auto":
        return
    why = f'accelerator = "auto" chose cpu since {_no_gpu_reason(env, inventory)}'
    problems = cuda_only_problems(spec, why)
    if problems:
        key, message = problems[0]
        raise DeviceError(message, key=key)


def _cpu_env(devices: DevicesSpec, inventory: Inventory, notes: list[str]) -> dict[str, str]:
    """Variables for a CPU run: hide the GPUs when the spec chose the CPU on a GPU machine."""
    if isinstance(devices.ids, list):
        notes.append(f"devices.ids = {devices.ids} is ignored: the run is on cpu")
    if devices.accelerator == "cpu" and inventory.gpus:
        return {VISIBLE_VAR: ""}  # hide the GPUs so nothing (cuDNN, libraries) touches them
    return {}


def _select_gpus(spec: ExperimentSpec, env: Mapping[str, str], inventory: Inventory, notes: list[str]) -> list[int]:
    """The visible indices the run uses (``devices.ids`` or all; one for mode none); DeviceError for an unknown id."""
    dev = spec.devices
    mode = spec.parallel.mode
    n_visible = len(inventory.gpus)
    ids = list(range(n_visible)) if dev.ids == "all" else list(dev.ids)
    bad = [i for i in ids if i >= n_visible]
    if bad:
        listing = "; ".join(g.label() for g in inventory.gpus) or "none"
        raise DeviceError(
            f"ids = {show(dev.ids)} asks for {bad} but only {n_visible} GPU(s) are visible "
            f"({_visible_text(env)}), numbered 0..{n_visible - 1}: {listing}. "
            f"ids count the visible GPUs, not nvidia-smi's numbering",
            key="devices.ids",
        )
    traits = MODES[mode]
    if not traits.elastic and not traits.replicas and len(ids) > 1:  # one process, one device
        if dev.ids == "all":
            notes.append(f"mode = {mode} uses only device {ids[0]} of {len(ids)} visible")
        else:  # what runs instead of a value that cannot apply (docs/design.md §10)
            notes.append(f'devices.ids = {show(dev.ids)}: mode = "{mode}" runs on one device, the first: {ids[0]}')
        ids = ids[:1]
    if traits.replicas and len(ids) == 1:
        notes.append(f"{mode} with one device runs unwrapped (no DataParallel)")
    return ids


def _output_index(par: ParallelSpec, ids: list[int]) -> int:
    """dp: position of ``output_device`` among the chosen ids; DeviceError when it is not one of them."""
    if "output_device" not in par.traits.keys or par.output_device is None:
        return 0
    if par.output_device not in ids:  # an id list was checked by the schema; "all" is known only here
        raise DeviceError(rules.output_device_not_chosen(par.output_device, ids), key="parallel.output_device")
    return ids.index(par.output_device)


class _Layout(NamedTuple):
    nnodes: int
    nproc_per_node: int
    world_size: int
    backend: Literal["nccl", "gloo"] | None


def _process_layout(spec: ExperimentSpec, accelerator: Accelerator, ids: list[int]) -> _Layout:
    """Nodes, processes per node, world size and backend; DeviceError when ddp's ``nproc_per_node`` unlike the GPUs."""
    par = spec.parallel
    dev = spec.devices
    if not par.traits.elastic:
        return _Layout(1, 1, 1, None)
    nproc = par.nproc_per_node if par.nproc_per_node is not None else (len(ids) if accelerator == "cuda" else 1)
    static = dev.accelerator == "cuda" and isinstance(dev.ids, list)
    if accelerator == "cuda" and nproc != len(ids) and not static:
        raise DeviceError(rules.nproc_mismatch(nproc, dev.ids, len(ids)), key="parallel.nproc_per_node")
    backend: Literal["nccl", "gloo"] = (
        par.backend if par.backend != "auto" else ("nccl" if accelerator == "cuda" else "gloo")
    )
    return _Layout(par.nnodes, nproc, par.nnodes * nproc, backend)


def _split_batch(spec: ExperimentSpec, layout: _Layout, ids: list[int], notes: list[str]) -> list[int]:
    """Samples per device per forward pass; DeviceError when a world size only this machine fixes does not divide."""
    batch = spec.data.batch_size
    accum = spec.train.grad_accum_steps
    world = layout.world_size
    if static_world_size(spec) is None and (problem := rules.batch_split_problem(batch, world, accum)):
        raise DeviceError(problem, key="data.batch_size")
    micro = batch // (world * accum)
    traits = spec.parallel.traits
    if traits.replicas and len(ids) > 1:
        per_device = chunk_sizes(micro, len(ids))
        idle = [ids[k] for k, size in enumerate(per_device) if size == 0]
        if idle:
            notes.append(
                f"a micro-batch of {micro} leaves device(s) {idle} idle under dp (torch.chunk split {per_device})"
            )
        return per_device
    return [micro] * layout.nproc_per_node if traits.elastic else [micro]


def apply_device_env(plan: DevicePlan, environ: MutableMapping[str, str] = os.environ) -> None:
    """Set ``plan.env`` in ``environ`` so this process and its children see only the chosen devices, in ``devices.ids``
    order; DeviceError when CUDA, which reads the variable once, is initialised and the plan would change its view."""
    changes = {k: v for k, v in plan.env.items() if environ.get(k) != v}
    if changes and cuda_initialized():
        now = {k: environ.get(k) for k in changes}
        raise DeviceError(
            f"CUDA is already initialised in this process, so setting {changes} (now {now}) would not take effect "
            f"and the run would use other GPUs than planned; resolve and apply devices before anything touches CUDA"
        )
    environ.update(changes)


def apply_threads(plan: DevicePlan) -> None:
    """Give torch ``plan.threads_per_process`` intra-op threads, and inter-op ones while torch still accepts them."""
    import torch

    torch.set_num_threads(plan.threads_per_process)
    if torch.get_num_interop_threads() != plan.threads_per_process:
        with contextlib.suppress(RuntimeError):  # "cannot set number of interop threads after parallel work"
            torch.set_num_interop_threads(plan.threads_per_process)

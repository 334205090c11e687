"""Resolve the accelerator and device ids of a spec against the visible GPUs; narrow CUDA_VISIBLE_DEVICES.

Details: docs/design.md, "Module notes", runner/devices/resolve.py.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

from runner.devices.inventory import DEFAULT_ORDER, ORDER_VAR, VISIBLE_VAR, Inventory
from runner.errors import DeviceError, show
from runner.spec import rules
from runner.spec.schema_parallel import MODES

if TYPE_CHECKING:  # pragma: no cover
    from runner.spec.schema import ExperimentSpec
    from runner.spec.schema_parallel import DevicesSpec, ParallelSpec

Accelerator = Literal["cuda", "cpu"]


@dataclass(frozen=True)
class DevicePlan:
    """Where and how a spec runs on this machine; see :func:`resolve_devices`.

    Attributes:
        mode: ``parallel.mode`` (:data:`runner.spec.schema_parallel.MODES` says what it is).
        requested_ids: Chosen visible indices (the user's numbering); empty on CPU.
        visible: ``CUDA_VISIBLE_DEVICES`` entries of every visible GPU (inherited view).
        selected: ``CUDA_VISIBLE_DEVICES`` entries of the chosen GPUs, in order.
        uuids: UUIDs of the chosen GPUs (``None`` when unknown).
        nproc_per_node: Processes on this node (1 for a one-process mode).
        nnodes: Nodes (1 for a one-process mode).
        world_size: ``nnodes * nproc_per_node``.
        backend: Process-group backend of a mode of one process per device, else ``None``.
        global_batch: ``data.batch_size``: samples per optimizer step across all devices.
        per_device_batch: Samples each device sees in one forward pass (one
            micro-batch): dp's scatter split, ddp's per-rank batch, or ``[B]``.
        output_index: dp only: position of ``parallel.output_device`` within the chosen ids.
        env: Variables to set in this process and its children.
        notes: Warnings worth showing, e.g. ``"dp with one device runs unwrapped"``.
        physical_indices: PCI-order (nvidia-smi) indices of the chosen GPUs (``None`` when unknown).
        total_memory_bytes: Memory of the chosen GPUs in bytes (``None`` when unknown).
        threads_per_process: CPU threads of each training process (:func:`threads_per_process`).
        threads_from: Where that number comes from, e.g. ``"2 usable cores / 2 processes"``.
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
            "output_device": self.output_index if self.replicas else None,
            "env": dict(self.env),
            "notes": list(self.notes),
            "threads_per_process": self.threads_per_process,
            "threads_from": self.threads_from,
        }


def _at(values: Sequence[Any], pos: int) -> Any:
    return values[pos] if pos < len(values) else None


# --------------------------------------------------------------------------- resolve


def threads_per_process(requested: int, env: Mapping[str, str], cores: int, processes: int) -> tuple[int, str]:
    """CPU threads of each training process, the same rule for every mode, and where the number comes from.

    ``devices.threads_per_process`` when set (> 0), else a positive ``OMP_NUM_THREADS``, else
    ``max(1, usable cores // processes)``. Usable cores are the process's CPU affinity (``cores``),
    under Slurm at most ``SLURM_CPUS_PER_TASK``; ``processes`` are the training processes that share
    them (1 for none and dp, and for a ddp worker that is a Slurm task of its own).

    Returns:
        ``(threads, source)``, e.g. ``(1, "2 usable cores / 2 training processes")``.
    """
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
    """Sizes ``torch.chunk`` (and so DataParallel's scatter) gives to each of ``parts`` devices.

    Chunks hold ``ceil(total / parts)`` samples; the last one holds the rest, and
    devices past the last chunk get nothing (10 over 4 -> ``[3, 3, 3, 1]``,
    9 over 4 -> ``[3, 3, 3, 0]``).

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


def resolve_devices(spec: ExperimentSpec, env: Mapping[str, str], inventory: Inventory) -> DevicePlan:
    """Decide where a spec runs on this machine (pure: reads nothing else).

    Args:
        env: The environment runner started with (for ``CUDA_VISIBLE_DEVICES`` and
            ``CUDA_DEVICE_ORDER``).
        inventory: GPUs visible at start, from :func:`probe_inventory` (or a fake one).

    Returns:
        The :class:`DevicePlan`.

    Raises:
        DeviceError: ``accelerator = "cuda"`` without a visible GPU; ids out of range;
            ``accelerator = "auto"`` found no GPU for dp, nccl, sync_batchnorm or fp16; a
            ddp ``nproc_per_node`` that differs from the number of GPUs; a global batch that
            does not divide by ``world_size * grad_accum_steps`` (when the spec alone does not
            fix the world size). Each names its spec key.
    """
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
        nproc_per_node=layout.nproc_per_node,
        nnodes=layout.nnodes,
        world_size=layout.world_size,
        backend=layout.backend,
        global_batch=spec.data.batch_size,
        per_device_batch=_split_batch(spec, layout, ids, notes),
        env=child_env,
        notes=notes,
        grad_accum_steps=spec.train.grad_accum_steps,
        output_index=_output_index(spec.parallel, spec.devices, ids),
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
    """``cuda`` when asked for (and usable) or when ``auto`` finds a usable GPU, else ``cpu``.

    Raises:
        DeviceError: ``accelerator = "cuda"`` and no usable GPU: never a silent fallback.
    """
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
    """CUDA-only settings when ``accelerator = "auto"`` found no GPU (``"cpu"`` is the schema's to check).

    Raises:
        DeviceError: The first CUDA-only setting found: dp, nccl, sync_batchnorm or fp16.
    """
    if spec.devices.accelerator != "auto":
        return
    why = f'accelerator = "auto" chose cpu since {_no_gpu_reason(env, inventory)}'
    problems = rules.cuda_only_problems(spec, why)
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
    """The visible indices the run uses: ``devices.ids`` (or every visible GPU), one for mode none.

    Raises:
        DeviceError: An id that no visible GPU has.
    """
    dev, mode = spec.devices, spec.parallel.mode
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


def _output_index(par: ParallelSpec, devices: DevicesSpec, ids: list[int]) -> int:
    """dp: position of ``output_device`` among the chosen ids (0: the first).

    Raises:
        DeviceError: ``output_device`` is not one of the GPUs that ``ids = "all"`` chose.
    """
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
    """Nodes, processes per node, world size and backend: one process unless one per device.

    Raises:
        DeviceError: ddp on CUDA whose ``nproc_per_node`` differs from the GPUs chosen here
            (when the spec alone fixes both, the schema has checked it).
    """
    par, dev = spec.parallel, spec.devices
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
    """Samples each device sees per forward pass: dp's ``torch.chunk`` split, ddp's per-rank share.

    Raises:
        DeviceError: The batch does not divide by ``world x grad_accum_steps``, for a world size
            only this machine fixes (the schema checks a world size the spec fixes, and always
            ``grad_accum_steps``, so a spec is never reported twice).
    """
    batch, accum, world = spec.data.batch_size, spec.train.grad_accum_steps, layout.world_size
    if rules.static_world_size(spec) is None and (problem := rules.batch_split_problem(batch, world, accum)):
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

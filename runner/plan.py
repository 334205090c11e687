"""What would run: devices, world size, batches, launch method and tracking target of a spec.

Shared by ``runner plan`` (which prints it) and ``runner exec`` (which acts on it), so the
two can never disagree. The launcher's environment is read here, once, through
:class:`runner.launch.environment.LauncherEnvironment`; inside a Slurm job step the layout of
its tasks is decided here too (docs/design.md §13).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from runner.launch.environment import LauncherEnvironment, SlurmLayout

if TYPE_CHECKING:  # pragma: no cover
    from runner.devices.inventory import Inventory
    from runner.devices.resolve import DevicePlan
    from runner.spec.loading import LoadedSpec

Launch = Literal["in-process", "elastic", "external"]


@dataclass(frozen=True)
class Rendezvous:
    """The c10d rendezvous of a ddp job that runner's elastic launcher joins.

    Attributes:
        endpoint: ``host:port`` (``None``: a free port on localhost, for one node).
        run_id: The rendezvous id every node shares (``parallel.rdzv_id``, or the Slurm job id).
        nnodes: Nodes of the job.
        node_rank: This node's rank; node 0 hosts the rendezvous store.
    """

    endpoint: str | None
    run_id: str
    nnodes: int
    node_rank: int


@dataclass(frozen=True)
class Plan:
    """A resolved spec ready to run.

    Attributes:
        loaded: The spec and where it came from.
        devices: Where it runs on this machine.
        tracking_uri: Absolute MLflow tracking URI, or ``None`` when tracking is off.
        experiment: MLflow experiment name.
        launch: ``"in-process"``, ``"elastic"`` (runner starts the DDP workers) or
            ``"external"`` (already a worker of torchrun or a scheduler).
        launcher: This process's place in its job, as its launcher set it (rank, ``RUNNER_RUN_ID``);
            for a per-device Slurm task, the worker its Slurm variables make it.
        rendezvous: Where the elastic launcher meets the other nodes (ddp only, else ``None``;
            under torchrun, the spec's settings, which torchrun's own replace).
        slurm: How this Slurm job step runs the spec, or ``None`` outside Slurm (and under torchrun).
    """

    loaded: LoadedSpec
    devices: DevicePlan
    tracking_uri: str | None
    experiment: str
    launch: Launch
    launcher: LauncherEnvironment
    rendezvous: Rendezvous | None = None
    slurm: SlurmLayout | None = None

    @property
    def owns_run(self) -> bool:
        """Whether this process creates and ends the run: rank 0 of a launched job, else node 0's launcher."""
        if self.launch == "external":
            return self.launcher.is_main
        return self.rendezvous is None or self.rendezvous.node_rank == 0

    def describe(self) -> dict[str, Any]:
        """JSON-able summary (printed by ``runner plan --json``, logged as ``spec/plan.json``)."""
        spec = self.loaded.spec
        par = spec.parallel
        out: dict[str, Any] = {
            "spec": str(self.loaded.path),
            "name": spec.name,
            "mode": par.mode,
            "devices": self.devices.describe(),
            "world_size": self.devices.world_size,
            "global_batch_size": spec.data.batch_size,
            "grad_accum_steps": spec.train.grad_accum_steps,
            "launch": self.launch,
            "tracking_uri": self.tracking_uri,
            "experiment": self.experiment,
        }
        if self.rendezvous is not None:
            rdzv = self.rendezvous
            out["rendezvous"] = {
                "backend": "c10d",
                "endpoint": rdzv.endpoint or "localhost:<free port>",
                "id": rdzv.run_id,
                "nnodes": rdzv.nnodes,
                "node_rank": rdzv.node_rank,
                "nproc_per_node": self.devices.nproc_per_node,
                "max_restarts": par.max_restarts,
            }
        if self.slurm is not None:
            out["slurm"] = self.slurm.describe()
        return out


def format_plan(info: dict[str, Any]) -> str:
    """Human-readable summary of :meth:`Plan.describe` for ``runner plan``.

    Args:
        info: What :meth:`Plan.describe` returned.

    Returns:
        One line per fact: mode, accelerator, each device, world size, batch split, tracking, notes.
    """
    dev = info["devices"]
    lines = [f"plan for {info['spec']}"]
    launch = {
        "in-process": "one process",
        "elastic": "elastic launcher (torchrun machinery)",
        "external": "already a worker (torchrun / scheduler)",
    }
    lines.append(f"  mode           {info['mode']} ({launch.get(info['launch'], info['launch'])})")
    lines.append(
        f"  accelerator    {dev['accelerator']}" + (f", backend {dev['backend']}" if dev.get("backend") else "")
    )
    for d in dev.get("devices", []):
        uuid = f", {d['uuid']}" if d.get("uuid") else ""
        lines.append(
            f"  device         id {d['id']} -> visible {d['entry']} -> cuda:{d['cuda_index']} {d['name']}{uuid}"
        )
    lines.append(
        f"  world size     {info['world_size']} ({dev['nnodes']} node(s) x {dev['nproc_per_node']} process(es))"
    )
    split = " + ".join(str(b) for b in dev["per_device_batch"])
    accum = f" x {info['grad_accum_steps']} micro-steps" if info["grad_accum_steps"] > 1 else ""
    lines.append(f"  global batch   {info['global_batch_size']} = {split} per device{accum}")
    if "rendezvous" in info:
        r = info["rendezvous"]
        lines.append(
            f"  rendezvous     c10d at {r['endpoint']} "
            f"(id {r['id']}, node rank {r['node_rank']}, max restarts {r['max_restarts']})"
        )
    if "slurm" in info:
        lines.append(f"  slurm          {_slurm_line(info['slurm'])}")
    tracking = f"{info['tracking_uri']} (experiment {info['experiment']!r})" if info["tracking_uri"] else "off"
    lines.append(f"  tracking       {tracking}")
    if dev.get("env"):
        lines.append("  environment    " + " ".join(f"{k}={v}" for k, v in dev["env"].items()))
    lines += [f"  note           {note}" for note in dev.get("notes", [])]
    return "\n".join(lines)


_SLURM_LAYOUTS = {
    "per-device": "one task per device: this task is rank {procid} of {ntasks}",
    "per-node": "one task per node: this task launches node {nodeid}'s workers ({nnodes} node(s))",
    "batch": "the batch script itself (not started by srun): one launcher on this node",
}


def _slurm_line(slurm: dict[str, Any]) -> str:
    requeued = f", requeued {slurm['restart_count']}x: resumes its run" if slurm["restart_count"] else ""
    text = _SLURM_LAYOUTS[slurm["layout"]].format(**slurm)
    return f"job {slurm['job_id']}, {text} (SLURM_NTASKS={slurm['ntasks']}, SLURM_NNODES={slurm['nnodes']}){requeued}"


def launched_externally(env: Mapping[str, str]) -> bool:
    """True when torchrun or a scheduler already started this process as a worker (RANK etc. set)."""
    return LauncherEnvironment.detect(env).external


def make_plan(loaded: LoadedSpec, *, env: Mapping[str, str] | None = None, inventory: Inventory | None = None) -> Plan:
    """Resolve devices, launch method and tracking target of ``loaded``.

    Args:
        loaded: The validated spec.
        env: Environment to resolve against (default ``os.environ``).
        inventory: Device inventory (default: probed without initialising CUDA).

    Returns:
        The :class:`Plan`.

    Raises:
        DeviceError: The spec asks for devices this machine does not have; placed at the
            spec file's line of the key it is about.
        UsageError: Started by torchrun with a world size that differs from the spec's, a Slurm
            step whose tasks fit neither layout (the message names both numbers), or launcher
            variables that are not integers.
        SpecError: ``parallel.nnodes > 1`` without ``parallel.rdzv_endpoint`` outside a Slurm
            step (which derives the endpoint), at the line of ``parallel.nnodes``.
    """
    from runner.devices.inventory import probe_inventory
    from runner.devices.resolve import resolve_devices
    from runner.errors import DeviceError, UsageError
    from runner.spec.loading import key_line
    from runner.tracking.uri import resolve_tracking_uri

    env = os.environ if env is None else env
    spec = loaded.spec
    try:
        launcher = LauncherEnvironment.detect(env)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    inventory = probe_inventory(env) if inventory is None else inventory
    try:
        devices = resolve_devices(spec, env, inventory)
    except DeviceError as exc:
        raise exc.located(loaded.path, key_line(loaded, exc.key)) from None
    slurm = None
    if launcher.slurm is not None and not launcher.external:
        slurm, launcher = _slurm_layout(loaded, launcher, devices, env)
    launch = _launch_method(loaded, launcher, devices)
    rendezvous = _rendezvous(loaded, slurm, launch == "elastic") if spec.parallel.mode == "ddp" else None
    uri = resolve_tracking_uri(spec) if spec.tracking.enabled else None
    experiment = spec.tracking.experiment or spec.name
    return Plan(loaded, devices, uri, experiment, launch, launcher, rendezvous, slurm)


def _slurm_layout(
    loaded: LoadedSpec, launcher: LauncherEnvironment, devices: DevicePlan, env: Mapping[str, str]
) -> tuple[SlurmLayout, LauncherEnvironment]:
    """The layout of this Slurm step and, for one task per device, this task as the worker it is.

    Raises:
        UsageError: The step's tasks fit neither layout, a node has more tasks than GPUs, or the
            node list cannot be read.
    """
    from runner.errors import UsageError

    assert launcher.slurm is not None
    par = loaded.spec.parallel
    try:
        layout = launcher.slurm.layout(
            world_size=devices.world_size, nproc_per_node=devices.nproc_per_node, nnodes=par.nnodes
        )
        if layout.kind != "per-device":
            return layout, launcher
        worker = launcher.as_slurm_worker(layout, env)
    except ValueError as exc:
        raise UsageError(f"{loaded.path}: {exc}") from None
    local = launcher.slurm.local_tasks
    if devices.accelerator == "cuda" and local > devices.nproc_per_node:
        raise UsageError(
            f"{loaded.path}: Slurm started {local} tasks on this node but the spec uses {devices.nproc_per_node} "
            f"GPU(s) per node: give each task one GPU (srun --ntasks-per-node={devices.nproc_per_node})"
        )
    return layout, worker


def _rendezvous(loaded: LoadedSpec, slurm: SlurmLayout | None, launching: bool) -> Rendezvous:
    """Where runner's elastic launcher meets the other nodes: the spec's settings, or the Slurm job's.

    ``launching`` is False under torchrun, whose own rendezvous the workers already joined.

    Raises:
        SpecError: Several nodes and no endpoint outside a Slurm step, at ``parallel.nnodes``' line.
        UsageError: The Slurm node list cannot be read.
    """
    from runner.errors import SpecError, SpecIssue, UsageError
    from runner.spec.loading import key_line

    par = loaded.spec.parallel
    if slurm is not None and slurm.kind != "batch":
        try:
            derived = slurm.rendezvous_endpoint() if slurm.nnodes > 1 or slurm.kind == "per-device" else None
        except ValueError as exc:
            raise UsageError(f"{loaded.path}: {exc}") from None
        endpoint = par.rdzv_endpoint if slurm.kind == "per-node" and par.rdzv_endpoint else derived
        return Rendezvous(endpoint, f"slurm-{slurm.job.job_id}", slurm.nnodes, slurm.node_rank)
    if launching and par.nnodes > 1 and not par.rdzv_endpoint:
        message = (
            f'nnodes = {par.nnodes} needs rdzv_endpoint = "host:port" reachable from every node '
            "(inside a Slurm job step it comes from the node list)"
        )
        raise SpecError(SpecIssue(loaded.path, key_line(loaded, "parallel.nnodes"), "parallel.nnodes", message))
    return Rendezvous(par.rdzv_endpoint, par.rdzv_id, par.nnodes, par.node_rank)


def _launch_method(loaded: LoadedSpec, launcher: LauncherEnvironment, devices: DevicePlan) -> Launch:
    """How the workers are made; a job started by torchrun must agree with the spec on ``WORLD_SIZE``.

    Raises:
        UsageError: ``WORLD_SIZE`` > 1 for a one-process mode, or differing from the spec's world size.
    """
    from runner.errors import UsageError

    mode = loaded.spec.parallel.mode
    if not launcher.external:
        return "elastic" if mode == "ddp" else "in-process"
    outside = launcher.world_size
    if mode != "ddp" and outside > 1:
        raise UsageError(
            f"{loaded.path}: started as one of {outside} workers (WORLD_SIZE={outside}) but parallel.mode = "
            f'"{mode}": set mode = "ddp" or start runner without torchrun'
        )
    if mode == "ddp" and outside != devices.world_size:
        raise UsageError(
            f"{loaded.path}: the launcher started WORLD_SIZE={outside} workers but the spec's world size is "
            f"{devices.world_size} (parallel.nnodes x nproc_per_node): make them agree"
        )
    return "external"

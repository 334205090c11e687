"""What would run: devices, world size, batches, launch method and tracking target of a spec.

Shared by ``runner plan`` (which prints it) and ``runner exec`` (which acts on it), so the
two can never disagree. The launcher's environment is read here, once, through
``runner.devices.environment.LauncherEnvironment``; inside a Slurm job step the layout of
its tasks is decided here too (docs/design.md §15). For a spec this machine cannot run:
what is missing, and the ``--set`` arguments that run it here, tried before they are offered
(``plan_or_problem``). What ``runner plan`` prints is ``runner.plan_report``.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from runner.devices.environment import LauncherEnvironment, SlurmLayout
from runner.errors import DeviceError, SpecError, SpecIssue, UsageError
from runner.tracking.uri import checkpoint_root, resolve_tracking_uri

if TYPE_CHECKING:  # pragma: no cover
    from runner.devices.inventory import Inventory
    from runner.devices.resolve import DevicePlan
    from runner.spec.loading import LoadedSpec

Launch = Literal["in-process", "elastic", "external"]
RUN_ID_PLACEHOLDER = "<run id>"


@dataclass(frozen=True)
class Rendezvous:
    """The c10d rendezvous the elastic launcher joins: ``host:port`` (``None``: a local free port), id, node rank."""

    endpoint: str | None
    run_id: str
    nnodes: int
    node_rank: int


@dataclass(frozen=True)
class Plan:
    """A resolved spec ready to run.

    ``launch`` is ``"in-process"``, ``"elastic"`` or ``"external"`` (a worker of torchrun or a scheduler); ``launcher``
    is this process's place in its job; ``checkpoint_root`` holds each run's checkpoint folder (named by its run id);
    ``part_notes`` are filled in once the built parts are checked.
    """

    loaded: LoadedSpec
    devices: DevicePlan
    tracking_uri: str | None
    checkpoint_root: Path
    launch: Launch
    launcher: LauncherEnvironment
    run_name: str = ""
    rendezvous: Rendezvous | None = None
    slurm: SlurmLayout | None = None
    part_notes: tuple[str, ...] = ()

    @property
    def owns_run(self) -> bool:
        """Whether this process creates and ends the run: rank 0 of a launched job, else node 0's launcher."""
        if self.launch == "external":
            return self.launcher.is_main
        return self.rendezvous is None or self.rendezvous.node_rank == 0

    @property
    def notes(self) -> list[str]:
        """What to know before the run starts: printed by ``plan`` and ``exec``, tagged ``runner.notes``."""
        notes = [*self.devices.notes, *self.part_notes]
        if self.loaded.spec.sweep is not None:
            notes.append(f"[sweep] is ignored by runner exec; run `runner sweep {self.loaded.path}` for the study")
        profile = self.loaded.spec.profile
        world = self.devices.world_size
        if profile is not None and (absent := [r for r in profile.ranks if r >= world]):
            notes.append(f"profile.ranks {absent} will record nothing: this job has ranks 0 to {world - 1}")
        return notes

    def describe(self) -> dict[str, Any]:
        """JSON-able summary (printed by ``runner plan --json``, logged as ``spec/plan.json``)."""
        devices = self.devices
        par = self.loaded.spec.parallel
        out = spec_facts(self.loaded, self.tracking_uri, self.checkpoint_root, self.run_name, devices.accelerator)
        out.update(devices=devices.describe(), world_size=devices.world_size, launch=self.launch, notes=self.notes)
        if self.rendezvous is not None:
            rdzv = self.rendezvous
            out["rendezvous"] = {
                "backend": "c10d",
                "endpoint": rdzv.endpoint or "localhost:<free port>",
                # torch's TCPStore server (the rendezvous store, on node 0) takes no bind address
                "listens_on": "every interface (torch's TCPStore binds no single address)",
                "id": rdzv.run_id,
                "nnodes": rdzv.nnodes,
                "node_rank": rdzv.node_rank,
                "nproc_per_node": self.devices.nproc_per_node,
                "max_restarts": par.max_restarts,
            }
        if self.slurm is not None:
            fields = ("job_id", "ntasks", "nnodes", "procid", "nodeid", "nodelist", "restart_count")
            out["slurm"] = {"layout": self.slurm.kind, **{name: getattr(self.slurm.job, name) for name in fields}}
        return out


def spec_facts(
    loaded: LoadedSpec, uri: str | None, checkpoint_root: Path, run_name: str, accelerator: str | None = None
) -> dict[str, Any]:
    """What the spec says: name, mode, batch, tracking, checkpoint folder, keys that do not apply on ``accelerator``."""
    from runner.spec.dump import set_inactive_keys

    spec = loaded.spec
    checkpoints = str(checkpoint_root / RUN_ID_PLACEHOLDER) if spec.checkpoint.enabled else None
    return {
        "spec": str(loaded.path),
        "name": spec.name,
        "run_name": run_name,
        "mode": spec.parallel.mode,
        "global_batch_size": spec.data.batch_size,
        "grad_accum_steps": spec.train.grad_accum_steps,
        "tracking_uri": uri,
        "experiment": spec.experiment_name,
        "checkpoint_dir": checkpoints,
        "inactive": set_inactive_keys(spec, accelerator),
        "overrides": loaded.command_line(),
    }


def launched_externally(env: Mapping[str, str]) -> bool:
    """True when torchrun or a scheduler already started this process as a worker (RANK etc. set)."""
    return LauncherEnvironment.detect(env).external


def make_plan(
    loaded: LoadedSpec,
    *,
    env: Mapping[str, str] | None = None,
    inventory: Inventory | None = None,
    tracking_uri: str | None = None,
) -> Plan:
    """Resolve devices, launch method, tracking target (``tracking_uri`` overrides) and run name of ``loaded``. Raises
    DeviceError: The spec asks for devices this machine lacks, at the key's line. UsageError: A torchrun world size or
    Slurm layout that does not fit, or non-integer launcher variables. SpecError: ``parallel.nnodes > 1`` without
    ``parallel.rdzv_endpoint`` outside Slurm."""
    from runner.devices.inventory import probe_inventory
    from runner.devices.resolve import resolve_devices, threads_per_process
    from runner.spec.loading import key_line

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
        slurm, launcher = _slurm_layout(loaded, launcher, devices)
        if slurm.kind == "per-device":  # this task is one training process with CPUs of its own
            threads, source = threads_per_process(spec.devices.threads_per_process, env, inventory.cores, 1)
            devices = replace(devices, threads_per_process=threads, threads_from=source)
    launch = _launch_method(loaded, launcher, devices)
    rendezvous = _rendezvous(loaded, slurm, launch == "elastic") if spec.parallel.traits.elastic else None
    uri = tracking_uri_of(loaded, tracking_uri)
    name = run_name_of(loaded, devices)
    return Plan(
        loaded, devices, uri, checkpoint_root(uri, spec.checkpoint.dir), launch, launcher, name, rendezvous, slurm
    )


def tracking_uri_of(loaded: LoadedSpec, given: str | None) -> str | None:
    if not loaded.spec.tracking.enabled:
        return None
    return given if given is not None else resolve_tracking_uri(loaded.spec)


def run_name_of(loaded: LoadedSpec, devices: DevicePlan | None) -> str:
    """``tracking.run_name``, else ``<name> <mode>-<size> <changed values>`` (docs/design.md §6)."""
    from runner.spec.loading import default_run_name

    spec = loaded.spec
    if spec.tracking.run_name:
        return spec.tracking.run_name
    return default_run_name(loaded, spec.parallel.mode, _size(loaded, devices))


def _size(loaded: LoadedSpec, devices: DevicePlan | None) -> int | str:
    """Devices (dp) or processes (ddp, fsdp) a run spans: the ``2`` of ``ddp-2``."""
    from runner.spec.schema import static_world_size

    spec = loaded.spec
    traits = spec.parallel.traits
    if devices is not None:
        if traits.elastic:
            return devices.world_size
        return max(1, len(devices.requested_ids)) if traits.replicas else 1
    if traits.replicas:
        ids = spec.devices.ids
        return len(ids) if isinstance(ids, list) else "?"
    return static_world_size(spec) or "?"


def _launch_method(loaded: LoadedSpec, launcher: LauncherEnvironment, devices: DevicePlan) -> Launch:
    """How the workers are made; UsageError when torchrun's ``WORLD_SIZE`` disagrees with the spec."""
    mode = loaded.spec.parallel.mode
    traits = loaded.spec.parallel.traits
    if not launcher.external:
        return traits.launch
    outside = launcher.world_size
    if not traits.elastic and outside > 1:
        raise UsageError(
            f"{loaded.path}: started as one of {outside} workers (WORLD_SIZE={outside}) but parallel.mode = "
            f'"{mode}": set mode = "ddp" or start runner without torchrun'
        )
    if traits.elastic and outside != devices.world_size:
        raise UsageError(
            f"{loaded.path}: the launcher started WORLD_SIZE={outside} workers but the spec's world size is "
            f"{devices.world_size} (parallel.nnodes x nproc_per_node): make them agree"
        )
    return "external"


def _slurm_layout(
    loaded: LoadedSpec, launcher: LauncherEnvironment, devices: DevicePlan
) -> tuple[SlurmLayout, LauncherEnvironment]:
    """The layout of this Slurm step (and this task as its worker); UsageError when the tasks fit no layout."""
    assert launcher.slurm is not None
    par = loaded.spec.parallel
    try:
        layout = launcher.slurm.layout(
            world_size=devices.world_size, nproc_per_node=devices.nproc_per_node, nnodes=par.nnodes
        )
        if layout.kind != "per-device":
            return layout, launcher
        worker = launcher.as_slurm_worker(layout)
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
    """Where the elastic launcher meets other nodes: the spec's settings, else the Slurm job's; SpecError for none."""
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
        raise SpecError(SpecIssue(None, None, "parallel.nnodes", message))
    return Rendezvous(par.rdzv_endpoint, par.rdzv_id, par.nnodes, par.node_rank)


def describe_unrunnable(
    loaded: LoadedSpec, error: DeviceError, fix: list[str] | None, shown: str | None = None
) -> dict[str, Any]:
    """What ``runner plan`` shows for a spec this machine cannot run: like :meth:`Plan.describe` with ``devices =
    None``, ``asked``, ``missing`` (the error) and ``try`` (the command with ``fix``, or ``None``)."""
    spec = loaded.spec
    uri = tracking_uri_of(loaded, None)
    info = spec_facts(loaded, uri, checkpoint_root(uri, loaded.spec.checkpoint.dir), run_name_of(loaded, None))
    ids = spec.devices.ids
    shown_ids = "all visible GPUs" if ids == "all" else f"ids {ids}"
    launch: Launch = spec.parallel.traits.launch
    info.update(devices=None, asked=f"accelerator {spec.devices.accelerator}, {shown_ids}", launch=launch, notes=[])
    info["missing"] = str(error)
    command = ["runner", "plan", shown or str(loaded.path)]
    info["try"] = shlex.join([*command, *_command_line_without(loaded, fix), *fix]) if fix else None
    return info


def _command_line_without(loaded: LoadedSpec, fix: Sequence[str]) -> list[str]:
    """``loaded``'s ``--unset``/``--set`` arguments less each ``--set`` of a key that ``fix`` sets another way."""
    from runner.spec.reading import parse_key

    fixed = {parse_key(item.partition("=")[0]) for item in fix[1::2]}
    kept = tuple(o for o in loaded.overrides if parse_key(o.partition("=")[0]) not in fixed)
    return dataclasses.replace(loaded, overrides=kept).command_line()


def plan_or_problem(
    loaded: LoadedSpec, *, env: Mapping[str, str], inventory: Inventory, shown: str | None = None
) -> tuple[dict[str, Any], DeviceError | None]:
    """``(Plan.describe(), None)``, or ``(describe_unrunnable(...), error)`` whose last line is a command that runs
    here."""
    try:
        return make_plan(loaded, env=env, inventory=inventory).describe(), None
    except DeviceError as exc:
        info = describe_unrunnable(loaded, exc, find_fix(loaded, exc, env=env, inventory=inventory), shown)
        message = exc.message + (f"\nthis runs here: {info['try']}" if info["try"] else "")
        return info, DeviceError(message, exc.key, exc.file, exc.line)


def find_fix(
    loaded: LoadedSpec, error: DeviceError, *, env: Mapping[str, str], inventory: Inventory
) -> list[str] | None:
    """The first ``--set`` arguments that make ``loaded`` run here, tried for real, or ``None``: a change of the key the
    error names, then the CPU alone and with each other mode."""
    from runner.devices.resolve import resolve_devices
    from runner.spec.loading import load_spec

    for candidate in _fix_candidates(loaded, error, inventory):
        try:
            changed = load_spec(loaded.path, [*loaded.overrides, *candidate], loaded.unset)
            resolve_devices(changed.spec, env, inventory)
        except (SpecError, DeviceError):
            continue
        return [word for item in candidate for word in ("--set", item)]
    return None


def _fix_candidates(loaded: LoadedSpec, error: DeviceError, inventory: Inventory) -> list[list[str]]:
    from runner.spec.schema_parallel import MODES

    spec = loaded.spec
    own = {
        "parallel.backend": [["parallel.backend=gloo"]],
        "parallel.sync_batchnorm": [["parallel.sync_batchnorm=false"]],
        "train.amp": [["train.amp=bf16"], ["train.amp=no"]],
        "devices.ids": [["devices.ids=all"]],
        "parallel.nproc_per_node": [[f"parallel.nproc_per_node={len(inventory.gpus)}"]] if inventory.gpus else [],
    }.get(error.key, [])
    others = [m for m, traits in MODES.items() if m != spec.parallel.mode and not traits.cuda_only]
    cpu = "devices.accelerator=cpu"
    return [*own, [cpu], *([f"parallel.mode={m}", cpu] for m in others)]

"""What would run: devices, world size, batches, launch method and tracking target of a spec.

Shared by ``runner plan`` (which prints it) and ``runner exec`` (which acts on it), so the
two can never disagree. The launcher's environment is read here, once, through
:class:`runner.launch.environment.LauncherEnvironment`.
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from runner.launch.environment import LauncherEnvironment

if TYPE_CHECKING:  # pragma: no cover
    from runner.devices.inventory import Inventory
    from runner.devices.resolve import DevicePlan
    from runner.errors import DeviceError
    from runner.spec.loading import LoadedSpec

Launch = Literal["in-process", "elastic", "external"]
RUN_ID_PLACEHOLDER = "<run id>"


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
        launcher: This process's place in its job, as its launcher set it (rank, ``RUNNER_RUN_ID``).
        run_name: The MLflow run name: ``tracking.run_name``, else the default of
            :func:`runner.spec.naming.default_run_name` (``digits-mlp ddp-2 lr=0.05``).
    """

    loaded: LoadedSpec
    devices: DevicePlan
    tracking_uri: str | None
    experiment: str
    launch: Launch
    launcher: LauncherEnvironment
    run_name: str = ""

    @property
    def notes(self) -> list[str]:
        """What to know before the run starts: printed by ``plan`` and ``exec``, tagged ``runner.notes``."""
        return list(self.devices.notes)

    def describe(self) -> dict[str, Any]:
        """JSON-able summary (printed by ``runner plan --json``, logged as ``spec/plan.json``)."""
        out = _spec_facts(self.loaded, self.tracking_uri, self.experiment, self.run_name)
        spec = self.loaded.spec
        par = spec.parallel
        out.update(
            {
                "devices": self.devices.describe(),
                "world_size": self.devices.world_size,
                "launch": self.launch,
                "notes": self.notes,
            }
        )
        if par.mode == "ddp":
            out["rendezvous"] = {
                "backend": "c10d",
                "endpoint": par.rdzv_endpoint or "localhost:<free port>",
                "id": par.rdzv_id,
                "nnodes": par.nnodes,
                "node_rank": par.node_rank,
                "nproc_per_node": self.devices.nproc_per_node,
                "max_restarts": par.max_restarts,
            }
        return out


def _spec_facts(loaded: LoadedSpec, uri: str | None, experiment: str, run_name: str) -> dict[str, Any]:
    """What the spec alone says: name, mode, batch, tracking, checkpoint folder, inactive keys."""
    from runner.spec.active import set_inactive_keys
    from runner.training.checkpoint import default_checkpoint_dir

    spec = loaded.spec
    checkpoints = None
    if spec.checkpoint.enabled:
        checkpoints = str(default_checkpoint_dir(uri, spec.checkpoint.dir, RUN_ID_PLACEHOLDER))
    return {
        "spec": str(loaded.path),
        "name": spec.name,
        "run_name": run_name,
        "mode": spec.parallel.mode,
        "global_batch_size": spec.data.batch_size,
        "grad_accum_steps": spec.train.grad_accum_steps,
        "tracking_uri": uri,
        "experiment": experiment,
        "checkpoint_dir": checkpoints,
        "inactive": set_inactive_keys(spec),
        "overrides": loaded.command_line(),
    }


_LAUNCH_TEXT = {
    "in-process": "one process",
    "elastic": "elastic launcher (torchrun machinery)",
    "external": "already a worker (torchrun / scheduler)",
}


def format_plan(info: dict[str, Any]) -> str:
    """Human-readable summary of :meth:`Plan.describe` (or :func:`describe_unrunnable`) for ``runner plan``.

    Args:
        info: What :meth:`Plan.describe` returned, with ``trials`` (a sweep's trial names) when given.

    Returns:
        One line per fact: run name, mode, devices with their names, world size, batch split,
        tracking, checkpoint folder, inactive keys, notes, trials; for a spec this machine cannot
        run, what is missing and the command that runs instead.
    """
    lines = [f"plan for {info['spec']}", _row("run name", info.get("run_name") or "(set when the run starts)")]
    dev = info.get("devices")
    launch = info.get("launch")
    lines.append(_row("mode", f"{info['mode']} ({_LAUNCH_TEXT.get(launch, launch)})" if launch else info["mode"]))
    lines += _device_lines(info, dev) if dev else [_row("devices", info.get("asked", "?"))]
    if dev:
        split = " + ".join(str(b) for b in dev["per_device_batch"])
        accum = f" x {info['grad_accum_steps']} micro-steps" if info["grad_accum_steps"] > 1 else ""
        lines.append(_row("global batch", f"{info['global_batch_size']} = {split} per device{accum}"))
    else:
        lines.append(_row("global batch", str(info["global_batch_size"])))
    if "rendezvous" in info:
        r = info["rendezvous"]
        where = f"c10d at {r['endpoint']} (id {r['id']}, node rank {r['node_rank']}, max restarts {r['max_restarts']})"
        lines.append(_row("rendezvous", where))
    tracking = f"{info['tracking_uri']} (experiment {info['experiment']!r})" if info["tracking_uri"] else "off"
    lines.append(_row("tracking", tracking))
    lines.append(_row("checkpoints", info.get("checkpoint_dir") or "off"))
    if dev and dev.get("env"):
        lines.append(_row("environment", " ".join(f"{k}={v}" for k, v in dev["env"].items())))
    lines += [_row("inactive", text) for text in _inactive_lines(info.get("inactive") or {})]
    lines += [_row("note", note) for note in info.get("notes", [])]
    lines += _trial_lines(info.get("trials"))
    if info.get("missing"):
        lines.append(_row("cannot run", info["missing"]))
        lines.append(_row("try", info["try"] or "no change of mode or accelerator runs this spec here"))
    return "\n".join(lines)


def _row(label: str, value: str) -> str:
    return f"  {label:<14} {value}"


def _device_lines(info: dict[str, Any], dev: dict[str, Any]) -> list[str]:
    """Accelerator, one line per device (id -> CUDA_VISIBLE_DEVICES entry -> cuda:i, name), world size."""
    lines = [_row("accelerator", dev["accelerator"] + (f", backend {dev['backend']}" if dev.get("backend") else ""))]
    for d in dev.get("devices", []):
        uuid = f", {d['uuid']}" if d.get("uuid") else ""
        lines.append(
            _row("device", f"id {d['id']} -> visible {d['entry']} -> cuda:{d['cuda_index']} {d['name']}{uuid}")
        )
    if not dev.get("devices"):
        lines.append(
            _row("device", "cpu" + (f" ({dev['nproc_per_node']} processes)" if dev["nproc_per_node"] > 1 else ""))
        )
    world = f"{info['world_size']} ({dev['nnodes']} node(s) x {dev['nproc_per_node']} process(es))"
    return [*lines, _row("world size", world)]


def _inactive_lines(inactive: dict[str, str]) -> list[str]:
    """``parallel.backend, parallel.timeout_s: ddp only (mode = "none")``: inactive keys grouped by reason."""
    by_reason: dict[str, list[str]] = {}
    for key, why in inactive.items():
        by_reason.setdefault(why, []).append(key)
    return [f"{', '.join(keys)}: {why}" for why, keys in by_reason.items()]


def _trial_lines(trials: list[str] | None) -> list[str]:
    if trials is None:
        return []
    return [_row("trials", f"{len(trials)} (runner sweep)"), *(_row("", f"{i}: {t}") for i, t in enumerate(trials))]


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
    """Resolve devices, launch method, tracking target and run name of ``loaded``.

    Args:
        loaded: The validated spec.
        env: Environment to resolve against (default ``os.environ``).
        inventory: Device inventory (default: probed without initialising CUDA).
        tracking_uri: The store to use instead of the spec's (``runner resume`` continues a run
            where it was found). Default: :func:`runner.tracking.uri.resolve_tracking_uri`.

    Returns:
        The :class:`Plan`.

    Raises:
        DeviceError: The spec asks for devices this machine does not have; placed at the
            spec file's line of the key it is about.
        UsageError: Started by torchrun with a world size that differs from the spec's, or with
            launcher variables that are not integers.
    """
    from runner.devices.inventory import probe_inventory
    from runner.devices.resolve import resolve_devices
    from runner.errors import DeviceError, UsageError
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
    launch = _launch_method(loaded, launcher, devices)
    uri = _tracking_uri(loaded, tracking_uri)
    return Plan(loaded, devices, uri, _experiment(loaded), launch, launcher, run_name_of(loaded, devices))


def _tracking_uri(loaded: LoadedSpec, given: str | None) -> str | None:
    from runner.tracking.uri import resolve_tracking_uri

    if not loaded.spec.tracking.enabled:
        return None
    return given if given is not None else resolve_tracking_uri(loaded.spec)


def _experiment(loaded: LoadedSpec) -> str:
    return loaded.spec.tracking.experiment or loaded.spec.name


def run_name_of(loaded: LoadedSpec, devices: DevicePlan | None) -> str:
    """``tracking.run_name``, else ``<name> <mode>-<size> <changed values>`` (docs/design.md §6).

    ``size`` is what the mode spans: 1 for none, dp's GPUs, ddp's world size; without a device
    plan (the machine cannot run the spec) the spec's own count, or ``?`` when only the machine knows.
    """
    from runner.spec.naming import default_run_name

    spec = loaded.spec
    if spec.tracking.run_name:
        return spec.tracking.run_name
    return default_run_name(loaded, spec.parallel.mode, _size(loaded, devices))


def _size(loaded: LoadedSpec, devices: DevicePlan | None) -> int | str:
    """Devices (dp) or processes (ddp) a run spans: the ``2`` of ``ddp-2``."""
    from runner.spec.rules import static_world_size

    spec = loaded.spec
    mode = spec.parallel.mode
    if devices is not None:
        if mode == "ddp":
            return devices.world_size
        return max(1, len(devices.requested_ids)) if mode == "dp" else 1
    if mode == "dp":
        ids = spec.devices.ids
        return len(ids) if isinstance(ids, list) else "?"
    return static_world_size(spec) or "?"


# ----------------------------------------------------------------------------- a spec this machine cannot run


def describe_unrunnable(
    loaded: LoadedSpec, error: DeviceError, fix: list[str] | None, shown: str | None = None
) -> dict[str, Any]:
    """What ``runner plan`` shows for a spec this machine cannot run: the spec's facts, what is missing, a fix.

    Args:
        loaded: The spec.
        error: Why it cannot run here (from :func:`make_plan`).
        fix: Extra command-line arguments that make it run here (:func:`find_fix`), or ``None``.
        shown: The spec file as the user named it (for the command to try). Default: its absolute path.

    Returns:
        A dict like :meth:`Plan.describe`, with ``devices = None``, ``asked`` (the devices the spec
        asks for), ``missing`` (the error) and ``try`` (the whole command with the fix, or ``None``).
    """
    spec = loaded.spec
    info = _spec_facts(loaded, _tracking_uri(loaded, None), _experiment(loaded), run_name_of(loaded, None))
    ids = spec.devices.ids
    shown_ids = "all visible GPUs" if ids == "all" else f"ids {ids}"
    launch: Launch = "elastic" if spec.parallel.mode == "ddp" else "in-process"
    info.update(devices=None, asked=f"accelerator {spec.devices.accelerator}, {shown_ids}", launch=launch, notes=[])
    info["missing"] = str(error)
    command = ["runner", "plan", shown or str(loaded.path), *loaded.command_line()]
    info["try"] = shlex.join([*command, *fix]) if fix else None
    return info


def plan_or_problem(
    loaded: LoadedSpec, *, env: Mapping[str, str], inventory: Inventory, shown: str | None = None
) -> tuple[dict[str, Any], DeviceError | None]:
    """What ``runner plan`` prints, and why this machine cannot run the spec (``None`` when it can).

    Returns:
        ``(Plan.describe(), None)``, or ``(describe_unrunnable(...), error)`` where ``error`` says
        what is missing and, on its last line, the command that runs here (found by :func:`find_fix`).

    Raises:
        UsageError: As :func:`make_plan` (launcher variables).
    """
    from runner.errors import DeviceError as _DeviceError

    try:
        return make_plan(loaded, env=env, inventory=inventory).describe(), None
    except _DeviceError as exc:
        info = describe_unrunnable(loaded, exc, find_fix(loaded, exc, env=env, inventory=inventory), shown)
        message = exc.message + (f"\nthis runs here: {info['try']}" if info["try"] else "")
        return info, _DeviceError(message, exc.key, exc.file, exc.line)


def find_fix(
    loaded: LoadedSpec, error: DeviceError, *, env: Mapping[str, str], inventory: Inventory
) -> list[str] | None:
    """The first ``--set`` arguments that make ``loaded`` run on this machine, tried for real, or ``None``.

    Candidates: a change of the key the error names (``backend = "gloo"``, ``ids = "all"``, ...),
    then the CPU (``accelerator = "cpu"``), alone and with each other mode (for dp, ddp first). Each
    is loaded with the spec's own ``--set``/``--unset`` and resolved against ``inventory``: a
    suggestion is printed only when the spec then validates and its devices resolve.

    Returns:
        E.g. ``["--set", "parallel.mode=ddp", "--set", "devices.accelerator=cpu"]``.
    """
    from runner.devices.resolve import resolve_devices
    from runner.errors import DeviceError as _DeviceError
    from runner.errors import SpecError
    from runner.spec.loading import load_spec

    for candidate in _fix_candidates(loaded, error, inventory):
        try:
            changed = load_spec(loaded.path, [*loaded.overrides, *candidate], loaded.unset)
            resolve_devices(changed.spec, env, inventory)
        except (SpecError, _DeviceError):
            continue
        return [word for item in candidate for word in ("--set", item)]
    return None


def _fix_candidates(loaded: LoadedSpec, error: DeviceError, inventory: Inventory) -> list[list[str]]:
    spec = loaded.spec
    own = {
        "parallel.backend": [["parallel.backend=gloo"]],
        "parallel.sync_batchnorm": [["parallel.sync_batchnorm=false"]],
        "train.amp": [["train.amp=bf16"], ["train.amp=no"]],
        "devices.ids": [["devices.ids=all"]],
        "parallel.nproc_per_node": [[f"parallel.nproc_per_node={len(inventory.gpus)}"]] if inventory.gpus else [],
    }.get(error.key, [])
    mode = spec.parallel.mode
    others = ["ddp", "none"] if mode == "dp" else [m for m in ("none", "ddp") if m != mode]
    cpu = "devices.accelerator=cpu"
    return [*own, [cpu], *([f"parallel.mode={m}", cpu] for m in others)]


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

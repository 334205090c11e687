"""What ``runner plan`` prints: the plan as text, and for a spec this machine cannot run, what is missing and a fix."""

from __future__ import annotations

import json
import os
import shlex
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from runner.errors import mask_secrets
from runner.plan import Launch, experiment_of, make_plan, run_name_of, spec_facts, tracking_uri_of

if TYPE_CHECKING:  # pragma: no cover
    from runner.devices.inventory import Inventory
    from runner.errors import DeviceError
    from runner.spec.loading import LoadedSpec


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
        if r["node_rank"] == 0:
            lines.append(_row("", f"its store listens on {r['listens_on']}"))
    tracking = f"{info['tracking_uri']} (experiment {info['experiment']!r})" if info["tracking_uri"] else "off"
    if "slurm" in info:
        lines.append(_row("slurm", _slurm_line(info["slurm"])))
    lines.append(_row("tracking", tracking))
    lines.append(_row("checkpoints", info.get("checkpoint_dir") or "off"))
    if dev and dev.get("env"):
        lines.append(_row("environment", " ".join(f"{k}={v}" for k, v in dev["env"].items())))
    lines += [_row("inactive", text) for text in _inactive_lines(info.get("inactive") or {})]
    lines += [_row("note", note) for note in info.get("notes", [])]
    lines += _trial_lines(info.get("trials"))
    return "\n".join(lines)  # what cannot run, and the fix, are the error's to print (once, on stderr)


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


_SLURM_LAYOUTS = {
    "per-device": "one task per device: this task is rank {procid} of {ntasks}",
    "per-node": "one task per node: this task launches node {nodeid}'s workers ({nnodes} node(s))",
    "batch": "the batch script itself (not started by srun): one launcher on this node",
}


def _slurm_line(slurm: dict[str, Any]) -> str:
    requeued = f", requeued {slurm['restart_count']}x: resumes its run" if slurm["restart_count"] else ""
    text = _SLURM_LAYOUTS[slurm["layout"]].format(**slurm)
    return f"job {slurm['job_id']}, {text} (SLURM_NTASKS={slurm['ntasks']}, SLURM_NNODES={slurm['nnodes']}){requeued}"


def describe_unrunnable(
    loaded: LoadedSpec, error: DeviceError, fix: list[str] | None, shown: str | None = None
) -> dict[str, Any]:
    """What ``runner plan`` shows for a spec this machine cannot run: the spec's facts, what is missing, a fix.

    Args:
        error: Why it cannot run here (from :func:`make_plan`).
        fix: Extra command-line arguments that make it run here (:func:`find_fix`), or ``None``.
        shown: The spec file as the user named it (for the command to try). Default: its absolute path.

    Returns:
        A dict like :meth:`Plan.describe`, with ``devices = None``, ``asked`` (the devices the spec
        asks for), ``missing`` (the error) and ``try`` (the whole command with the fix, or ``None``).
    """
    spec = loaded.spec
    info = spec_facts(loaded, tracking_uri_of(loaded, None), experiment_of(loaded), run_name_of(loaded, None))
    ids = spec.devices.ids
    shown_ids = "all visible GPUs" if ids == "all" else f"ids {ids}"
    launch: Launch = spec.parallel.traits.launch
    info.update(devices=None, asked=f"accelerator {spec.devices.accelerator}, {shown_ids}", launch=launch, notes=[])
    info["missing"] = str(error)
    command = ["runner", "plan", shown or str(loaded.path)]
    info["try"] = shlex.join([*command, *_command_line_without(loaded, fix), *fix]) if fix else None
    return info


def _command_line_without(loaded: LoadedSpec, fix: Sequence[str]) -> list[str]:
    """``loaded``'s ``--unset``/``--set`` arguments less each ``--set`` of a key that ``fix`` sets another way.

    A suggestion never repeats the user's override with another value (``--set parallel.mode=dp
    --set parallel.mode=ddp``): the later one would win anyway, so the spec it runs is the same.
    """
    import dataclasses

    from runner.spec.overrides import parse_key

    fixed = {parse_key(item.partition("=")[0]) for item in fix[1::2]}
    kept = tuple(o for o in loaded.overrides if parse_key(o.partition("=")[0]) not in fixed)
    return dataclasses.replace(loaded, overrides=kept).command_line()


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
    then the CPU (``accelerator = "cpu"``), alone and with each other mode (for dp, ``none`` first: one
    process, as dp is; ddp of one process is none with a process group). Each
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


def show_plan(
    loaded: LoadedSpec,
    *,
    shown: str,
    as_json: bool = False,
    with_spec: bool = False,
    sweep_trials: Callable[[LoadedSpec], list[str]] | None = None,
) -> None:
    """``runner plan``: print the plan (as JSON with ``as_json``, with the resolved spec with ``with_spec``).

    The plan is printed first; a spec this machine cannot run then raises, with what is missing
    and a working fix.

    Args:
        shown: The spec file as the user named it (for the command to try).
        as_json: Print :meth:`Plan.describe` as JSON instead of text.
        with_spec: Also print the resolved spec as TOML, every default included.
        sweep_trials: Names a spec's sweep trials (``runner.tools.sweep_define.trial_names``, passed in by
            the command line: the core does not import the tools); used when the spec has ``[sweep]``.

    Raises:
        DeviceError: This machine cannot run the spec (after the plan is printed).
        UsageError: As :func:`make_plan` (launcher variables).
    """
    from runner.devices.inventory import probe_inventory
    from runner.launch.prebuild import known_differences
    from runner.spec.dump import dump_spec

    info, problem = plan_or_problem(loaded, env=os.environ, inventory=probe_inventory(os.environ), shown=shown)
    info["notes"] = [*info.get("notes", []), *known_differences(loaded)]
    if loaded.spec.sweep is not None and sweep_trials is not None:
        info["trials"] = sweep_trials(loaded)  # the trials say what [sweep] does: no note that exec ignores it
        info["notes"] = [n for n in info.get("notes", []) if not n.startswith("[sweep]")]
        info.get("inactive", {}).pop("sweep", None)
    print(mask_secrets(json.dumps(info, indent=2) if as_json else format_plan(info)))
    if with_spec:
        print(f"\n# resolved spec ({loaded.path})")
        print(mask_secrets(dump_spec(loaded.spec)), end="")
    if problem is not None:
        raise problem  # after the plan: what is missing, and the command that runs here

"""A sweep's trials as experiments: the trial spec, validation of every trial up front, the child run's tags."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from runner.errors import DeviceError, SpecError, SpecIssue, UsageError
from runner.tools.sweep_space import Trial
from runner.tracking.values import param_value, safe_key

if TYPE_CHECKING:
    from runner.plan import Plan
    from runner.spec.loading import LoadedSpec


def without_sweep(loaded: LoadedSpec) -> LoadedSpec:
    """Return ``loaded`` as a plain experiment: its ``[sweep]`` table removed, hash recomputed.

    Args:
        loaded: A :class:`runner.spec.loading.LoadedSpec`.

    Raises:
        SpecError: Cannot happen for a spec that validated with its ``[sweep]`` table.
    """
    from runner.spec.dump import spec_sha256
    from runner.spec.loading import spec_from_dict

    if loaded.spec.sweep is None and "sweep" not in loaded.data:
        return loaded
    data = {k: v for k, v in loaded.data.items() if k != "sweep"}
    spec = spec_from_dict(data, origin=str(loaded.path))
    return dataclasses.replace(loaded, spec=spec, data=data, sha256=spec_sha256(spec))


def prepare_trials(
    path: Path, overrides: Sequence[str], trials: Sequence[Trial], in_file: Mapping[str, int | None] | None = None
) -> list[tuple[LoadedSpec, Plan]]:
    """Load, validate and plan every trial before any runs; collect every problem.

    Args:
        path: The spec file.
        overrides: Base ``--set`` strings; each trial's own values are applied after them.
        trials: The trials.
        in_file: Swept keys whose values come from the spec's ``[sweep.params]`` (see
            :func:`swept_in_file`), with their line: a bad value of theirs is blamed on that line.

    Returns:
        ``(LoadedSpec without [sweep], runner.plan.Plan)`` per trial.

    Raises:
        SpecError: Trial specs that do not validate or name unknown models; each issue
            keeps its key and names the trial.
        DeviceError: Trials that ask for devices this machine does not have, one line each.
    """
    from runner.devices.inventory import probe_inventory
    from runner.plan import make_plan
    from runner.spec.loading import load_spec, relocate_issues

    inventory = probe_inventory(os.environ)
    issues: list[SpecIssue] = []
    device_errors: list[str] = []
    checked: dict[tuple[str, Path], SpecError | None] = {}
    out = []
    for trial in trials:
        try:
            loaded = without_sweep(load_spec(path, [*overrides, *trial.overrides()]))
        except SpecError as exc:
            issues += [_in_trial(issue, trial, path, in_file or {}) for issue in exc.issues]
            continue
        model_error = _model_error(loaded, checked)
        if model_error is not None:
            located = relocate_issues(model_error, loaded)  # at model.name's line in the spec file
            issues += [_in_trial(issue, trial, path, in_file or {}) for issue in located.issues]
            continue
        try:
            out.append((loaded, make_plan(loaded, inventory=inventory)))
        except (DeviceError, UsageError) as exc:
            device_errors.append(f"{trial.label()}: {exc}")
    if issues:
        raise SpecError(issues)
    if device_errors:
        raise DeviceError("\n".join(device_errors))
    return out


def _model_error(loaded: LoadedSpec, checked: dict[tuple[str, Path], SpecError | None]) -> SpecError | None:
    """Whether the trial's model name resolves (each name and folder is checked once)."""
    from runner.training.models import check_model_name

    key = (loaded.spec.model.name, loaded.path.parent)
    if key not in checked:
        try:
            check_model_name(*key)
            checked[key] = None
        except SpecError as exc:
            checked[key] = exc
    return checked[key]


def trial_tags(trial: Trial) -> tuple[tuple[str, str], ...]:
    """MLflow tags of a trial's child run: index, values (JSON) and ``sweep.<key>`` per swept key."""
    tags = [
        ("runner.sweep", "trial"),
        ("runner.sweep.trial", str(trial.index)),
        ("runner.sweep.values", json.dumps(trial.values, default=str)),
    ]
    tags += [(safe_key(f"sweep.{k}"), param_value(v)) for k, v in trial.values.items()]
    return tuple(tags)


def trial_metric(metrics: Mapping[str, float], name: str) -> float | None:
    """The value of the sweep's metric among a trial's final metrics, or ``None`` when it was not logged."""
    value = metrics.get(name)
    return None if value is None else float(value)


def swept_in_file(base: LoadedSpec, grid: Sequence[str], random: Sequence[str]) -> dict[str, int | None]:
    """Keys of the spec's ``[sweep.params]`` that the command line does not replace, with their line in the file.

    Args:
        base: The spec (with its ``[sweep]`` table).
        grid, random: The ``--grid`` and ``--random`` entries (``KEY=...``).
    """
    from runner.spec.locate import locate_keys

    if base.spec.sweep is None:
        return {}
    given = {entry.partition("=")[0].strip() for entry in (*grid, *random)}
    lines = locate_keys(base.source_text)
    return {key: lines.get(("sweep", "params", key)) for key in base.spec.sweep.params if key not in given}


def _in_trial(issue: SpecIssue, trial: Trial, path: Path, in_file: Mapping[str, int | None]) -> SpecIssue:
    """The issue, naming the trial; a value from the spec's ``[sweep.params]`` is placed at its line there."""
    label = f"[sweep {trial.label()}]"
    swept = next((k for k in in_file if issue.key == k or issue.key.startswith((k + ".", k + "["))), None)
    if swept is not None and swept in trial.values:
        message = issue.message.split(" (from --set ", 1)[0]
        return SpecIssue(path, in_file[swept], issue.key, f'{message} (a value of sweep.params."{swept}") {label}')
    return dataclasses.replace(issue, message=f"{issue.message} {label}")

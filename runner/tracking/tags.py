"""Provenance of a new run: its tags (source, git, versions, host, devices) and its git artifacts.

Neither mlflow nor torch is imported when this module is imported.

Also: how values and names are written to MLflow: param strings, safe keys, length limits, batch sizes.

Also: what a run records about its spec: the params that apply, the spec files (self-contained), the overrides.
"""

from __future__ import annotations

import contextlib
import getpass
import json
import os
import re
import shlex
import socket
from collections.abc import Mapping
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

from runner.tracking.gitinfo import git_diff

if TYPE_CHECKING:
    from runner.spec.loading import LoadedSpec
    from runner.spec.schema import ExperimentSpec


NOTES_TAG = "runner.notes"

if TYPE_CHECKING:
    from runner.spec.loading import LoadedSpec
    from runner.tracking.gitinfo import GitInfo


def _torch_versions() -> tuple[str, str]:
    """``(torch version, CUDA version of the torch build or "none")``, read from ``torch/version.py`` without
    importing torch (the driver of a none or dp job never does; docs/design.md §6)."""
    import ast
    import importlib.util
    from pathlib import Path

    found = importlib.util.find_spec("torch")
    if found is None or not found.submodule_search_locations:
        return "none", "none"
    values: dict[str, str] = {}
    try:
        tree = ast.parse((Path(next(iter(found.submodule_search_locations))) / "version.py").read_text())
    except (OSError, SyntaxError):
        return "unknown", "unknown"
    for node in tree.body:
        target = node.targets[0] if isinstance(node, ast.Assign) else getattr(node, "target", None)
        value = getattr(node, "value", None)
        if isinstance(target, ast.Name) and isinstance(value, ast.Constant):
            values[target.id] = str(value.value) if value.value is not None else "none"
    return values.get("__version__", "unknown"), values.get("cuda", "none")


def _runner_version() -> str:
    import runner

    return str(getattr(runner, "__version__", "unknown"))


def source_tags(source: str) -> dict[str, str]:
    """MLflow's source tags of a run started from a local file (``mlflow.source.name``, ``mlflow.source.type``).

    Args:
        source: The spec file, as shown in the MLflow UI.
    """
    return {"mlflow.source.type": "LOCAL", "mlflow.source.name": source}


def _git_tags(info: GitInfo) -> dict[str, str]:
    """``runner.git.*`` and MLflow's ``mlflow.source.git.*`` tags of a working tree."""
    tags = {
        "runner.git.dirty": "true" if info.dirty else "false",
        "runner.git.untracked_files": str(info.untracked_count),
    }
    if info.commit:
        tags["mlflow.source.git.commit"] = info.commit
    if info.branch:
        tags["runner.git.branch"] = info.branch
        tags["mlflow.source.git.branch"] = info.branch
    if info.remote_url:
        tags["mlflow.source.git.repoURL"] = info.remote_url
    return tags


def _device_tags(plan_description: Mapping[str, Any]) -> dict[str, Any]:
    """``runner.devices``, ``runner.world_size`` and ``runner.accelerator`` from a plan description.

    ``plan_description`` is either a ``DevicePlan`` description or a whole plan holding one
    under ``"devices"``.
    """
    tags: dict[str, Any] = {}
    nested = plan_description.get("devices")
    device_plan = nested if isinstance(nested, Mapping) else plan_description
    names = device_plan.get("names") or [
        d["name"] for d in device_plan.get("devices") or () if isinstance(d, Mapping) and d.get("name")
    ]
    if names:
        tags["runner.devices"] = ", ".join(str(n) for n in names)
    elif device_plan.get("accelerator") == "cpu":
        tags["runner.devices"] = "cpu"
    for key in ("world_size", "accelerator"):
        value = plan_description.get(key, device_plan.get(key))
        if value is not None:
            tags[f"runner.{key}"] = value
    return tags


def _notes(plan_description: Mapping[str, Any]) -> list[str]:
    """The plan's notes (what runs instead of a value that cannot apply, ids ignored on CPU, ...)."""
    notes = plan_description.get("notes")
    if notes is None:
        nested = plan_description.get("devices")
        notes = nested.get("notes") if isinstance(nested, Mapping) else None
    return [str(n) for n in notes or ()]


def run_tags(
    loaded: LoadedSpec,
    plan_description: Mapping[str, Any],
    info: GitInfo | None,
    extra_tags: Mapping[str, Any] | None = None,
    parent_run_id: str | None = None,
) -> dict[str, str]:
    """Build the tags of a new run: provenance, environment, spec tags, then ``extra_tags``.

    Besides provenance, ``runner.overrides`` holds the command line's ``--set`` / ``--unset``
    arguments (when there are any) and ``runner.notes`` the plan's notes, one a line.

    Args:
        plan_description: ``Plan.describe()`` or ``DevicePlan.describe()``; ``devices[*].name`` (or
            ``names``), ``world_size``, ``accelerator``, ``mode`` and ``notes`` are read when present.
        info: :class:`runner.tracking.gitinfo.GitInfo` of the repository holding the spec, or ``None``.

    Returns:
        Tag key -> string value (values cut to MLflow's ``MAX_TAG_VAL_LENGTH``).
    """
    spec = loaded.spec
    torch_version, cuda_version = _torch_versions()
    spec_path = info.relpath(loaded.path) if info is not None else str(Path(loaded.path).resolve())
    tags: dict[str, Any] = {
        **source_tags(spec_path),
        "runner.spec.path": spec_path,
        "runner.spec.sha256": loaded.sha256,
        "runner.version": _runner_version(),
        "runner.torch_version": torch_version,
        "runner.cuda_version": cuda_version,
        "runner.hostname": socket.gethostname(),
        "runner.parallel_mode": plan_description.get("mode", spec.parallel.mode),
    }
    with contextlib.suppress(Exception):  # no user name in containers without a passwd entry
        tags["mlflow.user"] = getpass.getuser()
    if info is not None:
        tags.update(_git_tags(info))
    tags.update(_device_tags(plan_description))
    if loaded.overrides or loaded.unset:
        tags[OVERRIDES_TAG] = overrides_text(loaded)
    notes = _notes(plan_description)
    if notes:
        tags[NOTES_TAG] = "\n".join(notes)
    if spec.description:
        tags["mlflow.note.content"] = spec.description
    if parent_run_id:
        tags["mlflow.parentRunId"] = parent_run_id
    tags.update(spec.tags)
    tags.update(extra_tags or {})
    limit = max_tag_chars()
    return {k: shorten(param_value(v), limit, "the run's artifacts") for k, v in tags.items()}


def git_artifacts(info: GitInfo | None) -> dict[str, str]:
    """The git artifacts of a new run: artifact path -> text.

    ``git/diff.patch`` (``git diff HEAD``) when tracked files differ from ``HEAD``, and
    ``git/untracked.txt`` (one path a line, with a count of those not listed) when untracked
    files exist; nothing outside a repository.
    """
    out: dict[str, str] = {}
    if info is None:
        return out
    if info.dirty:
        out["git/diff.patch"] = git_diff(info)
    if info.untracked:
        more = info.untracked_count - len(info.untracked)
        out["git/untracked.txt"] = "\n".join(info.untracked) + (f"\n[... and {more} more]" if more > 0 else "") + "\n"
    return out


PARAMS_PER_BATCH = 100  # MLflow's limit for params (and tags) in one log_batch request
METRICS_PER_BATCH = 1000  # MLflow's limit for metrics in one log_batch request
_BAD_KEY_CHARS = re.compile(r"[^/\w.\- :]")


def param_value(value: Any) -> str:
    """Render one flattened spec value as an MLflow param string, stably.

    ``True`` -> ``"true"``, ``1`` -> ``"1"``, ``1.0`` -> ``"1.0"`` (floats use ``repr``),
    lists and tables -> JSON, strings unchanged.

    Args:
        value: A JSON-able scalar, list or dict.
    """
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, (list, tuple, dict)):
        return json.dumps(value, default=str)
    return str(value)


def safe_key(key: str) -> str:
    """Replace the characters MLflow rejects in param, tag and metric names with ``_``.

    MLflow accepts letters, digits, ``_``, ``-``, ``.``, ``/``, spaces and ``:``
    (``mlflow.utils.validation``); ``model.kwargs.hidden|x`` becomes ``model.kwargs.hidden_x``.
    """
    return _BAD_KEY_CHARS.sub("_", key)


def shorten(text: str, limit: int, where: str) -> str:
    """Cut ``text`` to ``limit`` characters with a marker saying how long it was and where the rest is.

    Args:
        where: Where the full text can be found, e.g. ``"artifact spec/resolved.toml"``.
    """
    if len(text) <= limit:
        return text
    marker = f"...[truncated from {len(text)} chars; full text in {where}]"
    return text[: max(0, limit - len(marker))] + marker


def max_tag_chars() -> int:
    """MLflow's limit on the length of a tag value (``MAX_TAG_VAL_LENGTH``, 8000 in MLflow 3)."""
    from mlflow.utils.validation import MAX_TAG_VAL_LENGTH

    return int(MAX_TAG_VAL_LENGTH)


def max_param_chars() -> int:
    """MLflow's limit on the length of a param value (``MAX_PARAM_VAL_LENGTH``, 6000 in MLflow 3)."""
    from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH

    return int(MAX_PARAM_VAL_LENGTH)


RESOLVED = "spec/resolved.toml"
PLAN = "spec/plan.json"
OVERRIDES_TAG = "runner.overrides"


def spec_params(spec: ExperimentSpec, accelerator: str | None = None) -> dict[str, str]:
    """Return the MLflow params of a spec: the keys that apply, dotted, as strings within MLflow's limits.

    Keys come from :func:`runner.spec.dump.active_params`: another mode's options, another
    dataset's keys and other inactive keys are left out (docs/design.md §10), so two runs differ in
    their params only where their training differs; ``None`` values are left out. Characters MLflow
    rejects in keys become ``_``; values longer than MLflow's limit (``MAX_PARAM_VAL_LENGTH``, 6000)
    are shortened with a marker pointing at the ``spec/resolved.toml`` artifact, which holds the
    whole spec.

    Args:
        accelerator: The accelerator the run resolved to (``"cpu"``: GPU-only keys are left out too),
            or ``None`` (:func:`runner.spec.dump.run_inactive_keys`).
    """
    from runner.spec.dump import active_params

    limit = max_param_chars()
    return {
        safe_key(key): shorten(param_value(value), limit, f"artifact {RESOLVED}")
        for key, value in active_params(spec, accelerator).items()
        if value is not None
    }


def spec_artifacts(loaded: LoadedSpec, resolved_toml: str, plan_json: str) -> dict[str, str]:
    """Artifact path -> text of a new run's spec: every file read, the resolved spec and the plan.

    The spec file and each file it ``extends`` are stored under ``spec/`` at their paths relative
    to the folder that holds them all (``spec/digits_mlp.toml``, ``spec/base/digits.toml``), so the
    logged spec loads on its own. A file that would be called ``resolved.toml`` or ``plan.json``
    there is stored as ``source-<name>``.

    Args:
        loaded: The spec; ``loaded.sources`` lists the files read (the spec file alone when empty).
    """
    sources = list(loaded.sources) or [(Path(loaded.path), loaded.source_text)]
    root = Path(os.path.commonpath([str(Path(p).parent) for p, _ in sources]))
    out: dict[str, str] = {}
    for path, text in sources:
        relative = PurePosixPath(Path(path).relative_to(root).as_posix())
        if str(relative) in ("resolved.toml", "plan.json"):
            relative = relative.with_name(f"source-{relative.name}")
        out[f"spec/{relative}"] = text
    out[RESOLVED] = resolved_toml
    out[PLAN] = plan_json
    return out


def overrides_text(loaded: LoadedSpec) -> str:
    """The command line's changes to the spec file, as shell words: ``--set optim.lr=0.05 --unset devices.ids``."""
    return shlex.join(loaded.command_line())

"""What a run records about its spec: the params that apply, the spec files (self-contained), the overrides.

Neither mlflow nor torch is imported when this module is imported.
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING

from runner.tracking.values import max_param_chars, param_value, safe_key, shorten

if TYPE_CHECKING:
    from runner.spec.loading import LoadedSpec
    from runner.spec.schema import ExperimentSpec

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
        spec: An ``ExperimentSpec``.
        accelerator: The accelerator the run resolved to (``"cpu"``: GPU-only keys are left out too),
            or ``None`` (:func:`runner.spec.active.run_inactive_keys`).
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
        resolved_toml: :func:`runner.spec.dump.dump_spec` of the spec.
        plan_json: The plan description as JSON.
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

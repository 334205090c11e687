"""Which keys of a spec apply: the inactive ones (another mode's, dataset's or optimizer's) and the params.

A key that does not apply to the chosen mode or dataset is tolerated and inert (docs/design.md
§10): validation accepts it, ``runner plan`` lists it as inactive with the reason, and it is never
logged as an MLflow param, so runs differ in their params only where they really differ. The
decision is the spec's alone, the same in every run of it, whatever the machine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from runner.spec.schema_parallel import ParallelSpec, modes_with

if TYPE_CHECKING:  # pragma: no cover
    from runner.spec.schema import ExperimentSpec

SYNTHETIC_ONLY = ("num_samples", "input_shape", "num_classes")
FILE_DATASETS_ONLY = ("root",)  # torchvision.<Name> and imagefolder read files from data.root
TORCHVISION_ONLY = ("download",)


def inactive_keys(spec: ExperimentSpec) -> dict[str, str]:
    """Dotted keys (or whole tables) of ``spec`` that do not apply to it, with the reason.

    Args:
        spec: A validated spec.

    Returns:
        ``{dotted key: reason}``, e.g. ``{"parallel.backend": 'ddp only (mode = "none")'}``, whether
        or not the spec sets them: the resolved spec leaves their defaults out, and
        :func:`runner.spec.dump.active_params` drops them (and every key below them).
    """
    par, data = spec.parallel, spec.data
    out: dict[str, str] = {}
    for key in [k for k in ParallelSpec.model_fields if k != "mode" and k not in par.traits.keys]:
        out[f"parallel.{key}"] = f'{" and ".join(modes_with(key))} only (mode = "{par.mode}")'
    if spec.devices.accelerator == "cpu":
        out["devices.ids"] = 'GPU ids (accelerator = "cpu")'
    out.update(_data_inactive(data.dataset, data.val_fraction))
    if not spec.train.compile:
        out["train.compile_backend"] = "compile only (train.compile = false)"
    if spec.optim.name != "sgd":
        out["optim.momentum"] = f'sgd only (optim.name = "{spec.optim.name}")'
    return out


def _data_inactive(dataset: str, val_fraction: float) -> dict[str, str]:
    """``[data]`` keys of other datasets: synthetic's shapes, torchvision's download, the file root."""
    out: dict[str, str] = {}
    shown = f'dataset = "{dataset}"'
    if dataset != "synthetic":
        out.update({f"data.{k}": f"synthetic only ({shown})" for k in SYNTHETIC_ONLY})
        if val_fraction == 0:
            out["data.split_seed"] = "no split (val_fraction = 0)"
    if not dataset.startswith("torchvision."):
        out.update({f"data.{k}": f"torchvision datasets only ({shown})" for k in TORCHVISION_ONLY})
        if dataset != "imagefolder":
            out.update({f"data.{k}": f"torchvision and imagefolder only ({shown})" for k in FILE_DATASETS_ONLY})
    return out


def is_inactive(key: str, inactive: dict[str, str]) -> bool:
    """Whether dotted ``key`` is one of ``inactive`` or lies below one of them."""
    return any(key == k or key.startswith(k + ".") for k in inactive)


def run_inactive_keys(spec: ExperimentSpec, accelerator: str | None = None) -> dict[str, str]:
    """:func:`inactive_keys` and what does not apply to a run of ``runner exec``: the keys params and diffs leave out.

    Besides the spec's own inactive keys: ``[sweep]`` (``runner exec`` ignores it; ``runner sweep``
    logs it on its parent run), and on the CPU the GPU-only keys ``devices.ids`` and
    ``parallel.sync_batchnorm`` (SyncBatchNorm has no CPU kernel), also when ``accelerator = "auto"``
    resolved to the CPU, as the plan's note about ``devices.ids`` says.

    Args:
        spec: A validated spec.
        accelerator: The accelerator the run resolved to (``"cpu"`` or ``"cuda"``), or ``None`` when
            unknown (the spec's own ``devices.accelerator`` decides; ``"auto"`` keeps the GPU keys).

    Returns:
        ``{dotted key: reason}``.
    """
    out = inactive_keys(spec)
    out["sweep"] = "runner sweep only (runner exec ignores [sweep])"
    if "cpu" in (accelerator, spec.devices.accelerator):
        out.setdefault("devices.ids", "GPU ids (the run is on cpu)")
        out.setdefault("parallel.sync_batchnorm", "CUDA only (the run is on cpu)")
    return out


def set_inactive_keys(spec: ExperimentSpec, accelerator: str | None = None) -> dict[str, str]:
    """The inactive keys the spec actually sets (not only their defaults), for ``runner plan``.

    Returns:
        ``{dotted key: reason}`` for each key of :func:`run_inactive_keys` written in the spec or on the
        command line.
    """
    written = _written_keys(spec)
    inactive = run_inactive_keys(spec, accelerator)
    return {k: why for k, why in inactive.items() if any(w == k or w.startswith(k + ".") for w in written)}


def _written_keys(spec: ExperimentSpec) -> set[str]:
    """Dotted keys set explicitly (``model_fields_set``) in every table of ``spec``."""
    from pydantic import BaseModel

    found: set[str] = set()

    def walk(model: BaseModel, prefix: str) -> None:
        for name in model.model_fields_set:
            value = getattr(model, name)
            key = f"{prefix}{name}"
            found.add(key)
            if isinstance(value, BaseModel):
                walk(value, key + ".")

    walk(spec, "")
    return found

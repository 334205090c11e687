"""Which keys of a spec apply: the inactive ones (another mode's, dataset's or optimizer's) and the params.

A key that does not apply to the chosen mode or dataset is tolerated and inert (docs/design.md
§10): validation accepts it, ``runner plan`` lists it as inactive with the reason, and it is never
logged as an MLflow param, so runs differ in their params only where they really differ. The
decision is the spec's alone, the same in every run of it, whatever the machine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from runner.spec.rules import DDP_ONLY, DP_ONLY

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
        :func:`active_params` drops them (and every key below them).
    """
    par, data = spec.parallel, spec.data
    out: dict[str, str] = {}
    for mode, keys in (("dp", DP_ONLY), ("ddp", DDP_ONLY)):
        if par.mode != mode:
            out.update({f"parallel.{k}": f'{mode} only (mode = "{par.mode}")' for k in keys})
    if spec.devices.accelerator == "cpu":
        out["devices.ids"] = 'GPU ids (accelerator = "cpu")'
    out.update(_data_inactive(data.dataset, data.val_fraction))
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


def active_params(spec: ExperimentSpec) -> dict[str, Any]:
    """The flattened spec without its inactive keys: what a run logs as params, the same way in every run.

    Args:
        spec: A validated spec.

    Returns:
        Dotted key -> JSON-able value, as :func:`runner.spec.dump.flatten_spec`, minus every key that
        :func:`inactive_keys` names (or that lies below one it names).
    """
    from runner.spec.dump import flatten_spec  # dump imports this module

    inactive = inactive_keys(spec)
    return {k: v for k, v in flatten_spec(spec).items() if not is_inactive(k, inactive)}


def set_inactive_keys(spec: ExperimentSpec) -> dict[str, str]:
    """The inactive keys the spec actually sets (not only their defaults), for ``runner plan``.

    Returns:
        ``{dotted key: reason}`` for each inactive key written in the spec or on the command line.
    """
    written = _written_keys(spec)
    return {k: why for k, why in inactive_keys(spec).items() if any(w == k or w.startswith(k + ".") for w in written)}


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

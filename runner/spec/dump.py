"""Write a validated spec back out: TOML with every default explicit, flat dotted keys, and its SHA-256.

The stored spec is what a run is compared, resumed and reproduced against: every default is written out so that a
later change of a default cannot leak into an old run, and its digest names one exact experiment.
"""

from __future__ import annotations

import datetime
import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

import tomli_w
from pydantic import BaseModel

from runner.errors import show
from runner.spec.rules import takes_momentum
from runner.spec.schema import ExperimentSpec
from runner.spec.schema_parallel import DevicesSpec, ParallelSpec, modes_with


def dump_spec(spec: ExperimentSpec) -> str:
    """TOML of a spec with every default that applies written out (keys in schema order); it re-loads equal.

    ``None`` values and empty tables are left out, and defaults of inactive keys; inactive keys the spec sets are kept.
    """
    return tomli_w.dumps(_plain_table(spec, inactive_keys(spec)))


def spec_sha256(spec: ExperimentSpec) -> str:
    """Return the hex SHA-256 of :func:`dump_spec` (stable across comments and formatting)."""
    return hashlib.sha256(dump_spec(spec).encode("utf-8")).hexdigest()


def group_sha256(spec: ExperimentSpec) -> str:
    """The first 12 hex digits of :func:`spec_sha256` with ``[parallel]``, ``[devices]`` and the run name at their
    defaults: the runs of one spec under every mode and device list share it (tag ``runner.spec.group``), so one
    filter in the MLflow UI shows them side by side."""
    tracking = spec.tracking.model_copy(update={"run_name": None})
    modeless = spec.model_copy(update={"parallel": ParallelSpec(), "devices": DevicesSpec(), "tracking": tracking})
    return spec_sha256(modeless)[:12]


def flatten_spec(spec: ExperimentSpec) -> dict[str, Any]:
    """Dotted key -> JSON-able value in schema order (``model.kwargs.num_classes``); lists stay lists, ``None`` is
    left out."""
    flat: dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        else:
            flat[prefix] = _jsonable(value)

    walk("", _plain_table(spec, inactive_keys(spec)))
    return flat


def set_keys(model: BaseModel, prefix: str = "") -> set[str]:
    """The dotted keys that ``model`` sets itself (in its file, a base it extends, or ``--set``), not by default; a
    free table set (``model.kwargs``) covers every key under it."""
    keys = set()
    for name in model.model_fields_set:
        value = getattr(model, name)
        if isinstance(value, BaseModel):
            keys |= set_keys(value, f"{prefix}{name}.")
        else:
            keys.add(prefix + name)
    return keys


def _plain_table(model: BaseModel, inactive: dict[str, str], prefix: str = "") -> dict[str, Any]:
    """Plain dict of ``model``: the fields set, and every default that applies (an inactive one is left out, §10)."""
    values = {}
    for name, field in type(model).model_fields.items():
        if name not in model.model_fields_set and is_inactive(prefix + name, inactive):
            continue
        value = _plain(getattr(model, name), inactive, f"{prefix}{name}.")
        if value is not None and (value != {} or field.is_required()):
            values[name] = value
    return values


def _plain(value: Any, inactive: dict[str, str], prefix: str) -> Any:
    if isinstance(value, BaseModel):
        return _plain_table(value, inactive, prefix)
    if isinstance(value, dict):
        return {str(k): _plain(v, inactive, f"{prefix}{k}.") for k, v in value.items() if v is not None}
    if isinstance(value, (list, tuple)):
        return [_plain(v, inactive, prefix) for v in value]
    return value


def _jsonable(value: Any) -> Any:
    if isinstance(value, (datetime.date, datetime.time)):
        return value.isoformat()
    if isinstance(value, list):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    return value


def active_params(spec: ExperimentSpec, accelerator: str | None = None) -> dict[str, Any]:
    """:func:`flatten_spec` less every key :func:`run_inactive_keys` names, or below one: what a run logs as params."""
    inactive = run_inactive_keys(spec, accelerator)
    return {k: v for k, v in flatten_spec(spec).items() if not is_inactive(k, inactive)}


MAX_RUN_NAME_CHARS = 250  # MLflow stores run names in a column of 250 characters


def value_label(value: Any) -> str:
    """A value as it reads in a run name: strings bare, the rest as TOML (``0.05``, ``true``, ``[0, 1]``)."""
    if value is None:
        return "unset"
    return value if isinstance(value, str) else show(value, limit=40)


def short_keys(keys: Sequence[str]) -> dict[str, str]:
    """The label of each dotted key: its last part (``optim.lr`` -> ``lr``), or the whole key when two share it."""
    last = [k.rsplit(".", 1)[-1] for k in keys]
    return {k: (tail if last.count(tail) == 1 else k) for k, tail in zip(keys, last, strict=True)}


def values_label(values: Mapping[str, Any]) -> str:
    """``lr=0.1 seed=0`` for ``{"optim.lr": 0.1, "seed": 0}``, keys shortened by :func:`short_keys`."""
    labels = short_keys(list(values))
    return " ".join(f"{labels[k]}={value_label(v)}" for k, v in values.items())


def trial_run_name(values: Mapping[str, Any]) -> str:
    """A sweep trial's run name from its values, ``lr=0.1 seed=0`` (``trial`` when it has none)."""
    return cut_run_name(values_label(values) or "trial")


def cut_run_name(name: str) -> str:
    """``name`` cut to :data:`MAX_RUN_NAME_CHARS` (MLflow's limit for a run name), ending in ``...`` when cut."""
    return name if len(name) <= MAX_RUN_NAME_CHARS else name[: MAX_RUN_NAME_CHARS - 3] + "..."


SYNTHETIC_ONLY = ("num_samples", "input_shape", "num_classes")
FILE_DATASETS_ONLY = ("root",)  # torchvision.<Name> and imagefolder read files from data.root
TORCHVISION_ONLY = ("download",)
IMAGE_ONLY = ("image_size", "num_channels")  # resized and repeated by runner's image datasets, not by a factory


def inactive_keys(spec: ExperimentSpec) -> dict[str, str]:
    """``{dotted key: reason}`` of keys (or tables) that do not apply to ``spec``, set or not."""
    par = spec.parallel
    data = spec.data
    out: dict[str, str] = {}
    for key in [k for k in ParallelSpec.model_fields if k != "mode" and k not in par.traits.keys]:
        out[f"parallel.{key}"] = f'{" and ".join(modes_with(key))} only (mode = "{par.mode}")'
    if spec.devices.accelerator == "cpu":
        out["devices.ids"] = 'GPU ids (accelerator = "cpu")'
    out.update(_data_inactive(data.dataset, data.val_fraction))
    if not spec.train.compile:
        out["train.compile_backend"] = "compile only (train.compile = false)"
    if not takes_momentum(spec.optim.name):
        out["optim.momentum"] = f'sgd and rmsprop only (optim.name = "{spec.optim.name}")'
    if spec.checkpoint.monitor is None:
        out.update({f"checkpoint.{k}": "checkpoint.monitor only (unset)" for k in ("goal", "keep_best")})
    return out


def _data_inactive(dataset: str, val_fraction: float) -> dict[str, str]:
    """``[data]`` keys of other datasets: synthetic's shapes, torchvision's download, the file root."""
    out: dict[str, str] = {}
    shown = f'dataset = "{dataset}"'
    if dataset != "synthetic":
        out.update({f"data.{k}": f"synthetic only ({shown})" for k in SYNTHETIC_ONLY})
        if val_fraction == 0:
            out["data.split_seed"] = "no split (val_fraction = 0)"
    if ":" in dataset or dataset == "sklearn.diabetes":  # a factory makes its own samples; diabetes has no images
        out.update({f"data.{k}": f"image datasets only ({shown})" for k in IMAGE_ONLY})
    if not dataset.startswith("torchvision."):
        out.update({f"data.{k}": f"torchvision datasets only ({shown})" for k in TORCHVISION_ONLY})
        if dataset != "imagefolder":
            out.update({f"data.{k}": f"torchvision and imagefolder only ({shown})" for k in FILE_DATASETS_ONLY})
    return out


def is_inactive(key: str, inactive: dict[str, str]) -> bool:
    """Whether dotted ``key`` is one of ``inactive`` or lies below one of them."""
    return any(key == k or key.startswith(k + ".") for k in inactive)


def run_inactive_keys(spec: ExperimentSpec, accelerator: str | None = None) -> dict[str, str]:
    """:func:`inactive_keys` plus what does not apply to a run: ``[sweep]``, and on the CPU ``devices.ids`` and
    ``parallel.sync_batchnorm`` (``accelerator``: the resolved one; ``None``: the spec's decides)."""
    out = inactive_keys(spec)
    out["sweep"] = "runner sweep only (runner exec ignores [sweep])"
    if "cpu" in (accelerator, spec.devices.accelerator):
        out.setdefault("devices.ids", "GPU ids (the run is on cpu)")
        out.setdefault("parallel.sync_batchnorm", "CUDA only (the run is on cpu)")
    return out


def set_inactive_keys(spec: ExperimentSpec, accelerator: str | None = None) -> dict[str, str]:
    """The :func:`run_inactive_keys` that the spec or command line actually sets, for ``runner plan``."""
    written = _written_keys(spec)
    inactive = run_inactive_keys(spec, accelerator)
    return {k: why for k, why in inactive.items() if any(w == k or w.startswith(k + ".") for w in written)}


def _written_keys(spec: ExperimentSpec) -> set[str]:
    """Dotted keys set explicitly (``model_fields_set``) in every table of ``spec``."""
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

"""Write a validated spec back out: TOML with every default explicit, flat dotted keys, and its SHA-256."""

from __future__ import annotations

import datetime
import hashlib
from typing import Any

import tomli_w
from pydantic import BaseModel, ValidationError

from runner.spec.active import inactive_keys, is_inactive, run_inactive_keys
from runner.spec.schema import ExperimentSpec


def dump_spec(spec: ExperimentSpec) -> str:
    """Write a spec as TOML with every default that applies made explicit; it re-loads to an equal spec.

    ``None`` values and empty tables are left out. A default is written unless its key is
    inactive (:func:`runner.spec.active.inactive_keys`: e.g. ddp's options under ``mode = "none"``)
    or writing it would change how the table validates. Inactive keys the spec sets are kept.

    Args:
        spec: A validated spec.

    Returns:
        TOML text, keys in schema order.
    """
    return tomli_w.dumps(_plain_table(spec, inactive_keys(spec)))


def spec_sha256(spec: ExperimentSpec) -> str:
    """Return the hex SHA-256 of :func:`dump_spec` (stable across comments and formatting)."""
    return hashlib.sha256(dump_spec(spec).encode("utf-8")).hexdigest()


def flatten_spec(spec: ExperimentSpec) -> dict[str, Any]:
    """Flatten a spec into dotted keys, e.g. for MLflow params.

    Tables (including dict-valued ``kwargs``) become dotted keys (``model.kwargs.num_classes``);
    lists stay lists; dates and times become ISO strings; ``None`` values are omitted.
    Values come from the validated spec, so ``lr = 1`` appears as ``1.0``.

    Args:
        spec: A validated spec.

    Returns:
        Dict from dotted key to a JSON-serialisable value, in schema order.
    """
    flat: dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        else:
            flat[prefix] = _jsonable(value)

    walk("", _plain_table(spec, inactive_keys(spec)))
    return flat


def _plain_table(model: BaseModel, inactive: dict[str, str], prefix: str = "") -> dict[str, Any]:
    """Plain dict of ``model``: set fields, plus every default that applies and validates alongside them."""
    cls = type(model)
    values = {}
    for name in cls.model_fields:
        value = _plain(getattr(model, name), inactive, f"{prefix}{name}.")
        if value is None or (value == {} and not cls.model_fields[name].is_required()):
            continue
        values[name] = value
    chosen = {n: v for n, v in values.items() if n in model.model_fields_set}
    for name, value in values.items():
        if name in chosen or is_inactive(prefix + name, inactive):
            continue
        if _validates(cls, {**chosen, name: value}):
            chosen[name] = value
    result = {n: v for n, v in values.items() if n in chosen}
    if _validates(cls, result, expect=model):
        return result
    return {n: v for n, v in values.items() if n in model.model_fields_set}


def _plain(value: Any, inactive: dict[str, str], prefix: str) -> Any:
    if isinstance(value, BaseModel):
        return _plain_table(value, inactive, prefix)
    if isinstance(value, dict):
        return {str(k): _plain(v, inactive, f"{prefix}{k}.") for k, v in value.items() if v is not None}
    if isinstance(value, (list, tuple)):
        return [_plain(v, inactive, prefix) for v in value]
    return value


def _validates(cls: type[BaseModel], data: dict[str, Any], expect: BaseModel | None = None) -> bool:
    try:
        made = cls.model_validate(data)
    except ValidationError:
        return False
    return expect is None or made == expect


def _jsonable(value: Any) -> Any:
    if isinstance(value, (datetime.date, datetime.time)):
        return value.isoformat()
    if isinstance(value, list):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    return value


def active_params(spec: ExperimentSpec, accelerator: str | None = None) -> dict[str, Any]:
    """The flattened spec without its inactive keys: what a run logs as params, the same way in every run.

    Args:
        spec: A validated spec.
        accelerator: The accelerator the run resolved to, or ``None`` (see
            :func:`~runner.spec.active.run_inactive_keys`).

    Returns:
        Dotted key -> JSON-able value, as :func:`flatten_spec`, minus every key that
        :func:`~runner.spec.active.run_inactive_keys` names (or that lies below one it names).
    """
    inactive = run_inactive_keys(spec, accelerator)
    return {k: v for k, v in flatten_spec(spec).items() if not is_inactive(k, inactive)}

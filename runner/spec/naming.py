"""Run names that say what a run is: the spec, its mode and devices, and the values changed from the file.

``digits-mlp ddp-2 lr=0.05``: the spec's ``name``, the mode with the devices (or processes) it
spans, then each value the command line set, under the last part of its dotted key. Sweep
trials are named by their values alone (``lr=0.1 seed=0``) and nest under the sweep's run.
``tracking.run_name`` (or ``--run-name``) replaces the default (docs/design.md §6).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from runner.spec.overrides import parse_key
from runner.spec.wording import show

if TYPE_CHECKING:  # pragma: no cover
    from runner.spec.loading import LoadedSpec

MAX_RUN_NAME_CHARS = 250  # MLflow stores run names in a column of 250 characters
_IN_THE_MODE = ("parallel.mode",)  # already said by the mode part of the name


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
    """The MLflow run name of a sweep trial: its values, e.g. ``lr=0.1 seed=0`` (``trial`` when it has none).

    Args:
        values: Dotted key -> the trial's value, in the sweep's key order.
    """
    return _cut(values_label(values) or "trial")


def default_run_name(loaded: LoadedSpec, mode: str, size: int | str) -> str:
    """The default run name: spec name, ``<mode>-<size>``, and the values the command line changed.

    Args:
        loaded: The spec; ``loaded.overrides`` (``--set``) and ``loaded.unset`` (``--unset``) are the
            command line's changes, named with the value they gave (a default for ``--unset``).
        mode: ``none``, ``dp`` or ``ddp``.
        size: Devices the run uses (dp's GPUs) or its world size (ddp): the ``2`` of ``ddp-2``
            (``?`` while only the machine can say).

    Returns:
        E.g. ``digits-mlp ddp-2 lr=0.05``, at most 250 characters.
    """
    changed = {k: v for k, v in overridden_values(loaded).items() if k not in _IN_THE_MODE}
    parts = [loaded.spec.name, f"{mode}-{size}", values_label(changed)]
    return _cut(" ".join(p for p in parts if p))


def overridden_values(loaded: LoadedSpec) -> dict[str, Any]:
    """Dotted key -> validated value of every key the command line set or unset, in command-line order."""
    keys: dict[str, str] = {}
    for text in (*loaded.unset, *(o.partition("=")[0] for o in loaded.overrides)):
        loc = parse_key(text)
        if loc is not None:
            key = ".".join(str(part) for part in loc)
            keys.pop(key, None)
            keys[key] = text
    return {key: _value_at(loaded.spec, key.split(".")) for key in keys}


def _value_at(model: BaseModel, parts: Iterable[str]) -> Any:
    """The value of the validated spec at dotted ``parts`` (``None`` when unset)."""
    value: Any = model
    for part in parts:
        if isinstance(value, BaseModel):
            value = getattr(value, part, None)
        elif isinstance(value, Mapping):
            value = value.get(part)
        else:
            return None
    if isinstance(value, BaseModel):
        return {k: getattr(value, k) for k in value.model_fields_set}
    return value


def _cut(name: str) -> str:
    return name if len(name) <= MAX_RUN_NAME_CHARS else name[: MAX_RUN_NAME_CHARS - 3] + "..."

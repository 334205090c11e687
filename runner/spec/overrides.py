"""Apply ``--set dotted.key=value`` and ``--unset dotted.key`` to a spec dict read from its files. Details:
docs/design.md, "Module notes"."""

from __future__ import annotations

import json
import os
import re
import tomllib
from typing import Any

from pydantic import BaseModel

from runner.errors import SpecIssue, did_you_mean, show, with_hint
from runner.spec.messages import Loc, annotation_at, format_key, unwrap_optional
from runner.spec.reading import PATH_KEYS, Origin, SpecTree, forget
from runner.spec.schema import ExperimentSpec

ORIGIN = "--set"
UNSET = "--unset"


class FlagOverride(str):
    """A ``--set`` text made by a shorthand flag (``--nproc-per-node 2``); messages name the flag as typed."""

    option: str
    typed: str

    def __new__(cls, text: str, option: str, typed: str) -> FlagOverride:
        self = super().__new__(cls, text)
        self.option, self.typed = option, typed
        return self

    def __getnewargs__(self) -> tuple[str, str, str]:  # type: ignore[override]
        return str(self), self.option, self.typed


def option_of(override: str) -> str:
    """The flag an override came from: ``--set``, or a :class:`FlagOverride`'s own."""
    return override.option if isinstance(override, FlagOverride) else ORIGIN


def typed_as(override: str) -> str:
    """The override as the user typed it: ``--set optim.lr=0.05``, or ``--nproc-per-node 0``."""
    return override.typed if isinstance(override, FlagOverride) else f"{ORIGIN} {override}"


def parallel_flags(**flags: int | str | None) -> list[str]:
    """The ddp shorthand flags (``nnodes``, ``node_rank``, ``nproc_per_node``, ``rdzv_endpoint``) as ``--set`` entries
    (``nnodes=2`` -> ``parallel.nnodes=2``); unset flags give none."""
    out: list[str] = []
    for key, value in flags.items():
        if value is not None:
            option, text = "--" + key.replace("_", "-"), json.dumps(value) if isinstance(value, str) else value
            out.append(FlagOverride(f"parallel.{key}={text}", option, f"{option} {value}"))
    return out


def apply_override(tree: SpecTree, override: str, issues: list[SpecIssue]) -> None:
    """Apply one ``dotted.key=value`` to ``tree`` in place; problems become issues located at ``--set``."""
    key_text, eq, value_text = override.partition("=")
    loc = parse_key(key_text) if eq else None
    if loc is None:
        message = f"{show(override)}: expected dotted.key=value, e.g. --set optim.lr=0.05"
        issues.append(SpecIssue(None, None, "", message, ORIGIN))
        return
    bare_fraction = re.fullmatch(r"([+-]?)\.(\d.*)", value_text.strip())
    if bare_fraction:
        fixed = f"{bare_fraction.group(1)}0.{bare_fraction.group(2)}"
        message = f"invalid TOML value {value_text.strip()} (write {fixed})"
        issues.append(SpecIssue(None, None, format_key(loc), message, ORIGIN))
        return
    node = _parent_table(tree.data, loc, override, issues)
    if node is None:
        return
    value = _override_value(loc, value_text.strip())
    if loc in PATH_KEYS and isinstance(value, str) and value:
        value = os.path.abspath(os.path.expanduser(value))
    node[loc[-1]] = value
    forget(tree.provenance, loc)
    tree.provenance[loc] = Origin(None, None, override)


def _parent_table(data: dict[str, Any], loc: Loc, override: str, issues: list[SpecIssue]) -> dict[str, Any] | None:
    """The table that holds ``loc``, created when missing; ``None`` (and an issue) when a scalar is in the way."""
    node = data
    for i, part in enumerate(loc[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            message = f"{format_key(loc[: i + 1])} is {show(child)}, not a table (from {typed_as(override)})"
            issues.append(SpecIssue(None, None, format_key(loc), message, option_of(override)))
            return None
        node = child
    return node


def parse_key(text: str) -> Loc | None:
    """Parse a TOML dotted key (``optim.lr``, ``sweep.params."optim.lr"``); ``None`` if it is not one."""
    try:
        parsed: Any = tomllib.loads(f"{text.strip()} = 0")
    except (tomllib.TOMLDecodeError, RecursionError):  # the parser recurses once per level of nesting
        return None
    loc: Loc = ()
    while isinstance(parsed, dict):
        if len(parsed) != 1:
            return None
        ((name, parsed),) = parsed.items()
        loc += (name,)
    return loc or None


def _override_value(loc: Loc, text: str) -> Any:
    """Parse ``text`` as a TOML value; not-TOML text, or any scalar for a string key, stays a string."""
    try:
        parsed = tomllib.loads(f"v = {text}")
    except (tomllib.TOMLDecodeError, RecursionError):
        return text
    if set(parsed) != {"v"}:
        return text
    value = parsed["v"]
    if annotation_at(loc) is str and not isinstance(value, (str, list, dict)):
        return text
    return value


def apply_unset(tree: SpecTree, key_text: str, issues: list[SpecIssue]) -> bool:
    """Remove ``key_text`` from ``tree`` so its default applies; return whether one was removed. An unknown key is an
    issue with a did-you-mean."""
    loc = parse_key(key_text)
    if loc is None:
        message = f"{show(key_text)}: expected a dotted key, e.g. --unset devices.ids"
        issues.append(SpecIssue(None, None, "", message, UNSET))
        return False
    parent: Any = tree.data
    for part in loc[:-1]:
        parent = parent.get(part) if isinstance(parent, dict) else None
    if isinstance(parent, dict) and loc[-1] in parent:
        del parent[loc[-1]]
        forget(tree.provenance, loc)
        return True
    if annotation_at(loc) is None:
        known = sorted(set(schema_keys()) | set(_tree_keys(tree.data)))
        hint = did_you_mean(format_key(loc), known, render=str)
        message = with_hint("unknown key: neither the schema nor the spec has it", hint)
        issues.append(SpecIssue(None, None, format_key(loc), message, UNSET))
    return False


def _tree_keys(data: dict[str, Any], prefix: Loc = ()) -> list[str]:
    out = []
    for key, value in data.items():
        loc = (*prefix, key)
        out.append(format_key(loc))
        if isinstance(value, dict):
            out += _tree_keys(value, loc)
    return out


def schema_keys() -> list[str]:
    """Every dotted key of the spec schema, tables included (``parallel``, ``parallel.mode``, ...)."""
    out: list[str] = []

    def walk(model: type[BaseModel], prefix: str) -> None:
        for name, field in model.model_fields.items():
            out.append(prefix + name)
            ann = unwrap_optional(field.annotation)
            if isinstance(ann, type) and issubclass(ann, BaseModel):
                walk(ann, f"{prefix}{name}.")

    walk(ExperimentSpec, "")
    return out

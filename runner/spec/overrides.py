"""Apply ``--set dotted.key=value`` overrides to a spec dict read from its files.

Each value is read as a TOML value (``0.05``, ``[0, 1]``, ``{ a = 1 }``); text that is not
TOML, or any scalar given for a string key, is taken as a string. The override becomes the
origin of its key, so validation messages say ``--set: optim.lr: ... (from --set optim.lr=x)``.
"""

from __future__ import annotations

import os
import re
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

from runner.errors import SpecIssue
from runner.spec.locate import Loc, format_key
from runner.spec.messages import annotation_at
from runner.spec.reading import PATH_KEYS, Origin, Provenance, SpecTree, forget
from runner.spec.wording import show

ORIGIN = "--set"


def apply_override(tree: SpecTree, override: str, issues: list[SpecIssue]) -> None:
    """Apply one ``dotted.key=value`` to ``tree``; problems with the override itself become issues.

    Args:
        tree: The spec read from its files (changed in place).
        override: The text given to ``--set``.
        issues: Problems found are appended here (located at ``--set``, not at a file).
    """
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
    _set_origin(tree.provenance, loc, override)


def _parent_table(data: dict[str, Any], loc: Loc, override: str, issues: list[SpecIssue]) -> dict[str, Any] | None:
    """The table that holds ``loc``, created when missing; ``None`` (and an issue) when a scalar is in the way."""
    node = data
    for i, part in enumerate(loc[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            message = f"{format_key(loc[: i + 1])} is {show(child)}, not a table (from --set {override})"
            issues.append(SpecIssue(None, None, format_key(loc), message, ORIGIN))
            return None
        node = child
    return node


def _set_origin(provenance: Provenance, loc: Loc, override: str) -> None:
    forget(provenance, loc)
    provenance[loc] = Origin(None, None, override)


def parse_key(text: str) -> Loc | None:
    """Parse a TOML dotted key (``optim.lr``, ``sweep.params."optim.lr"``); ``None`` if it is not one."""
    try:
        parsed: Any = tomllib.loads(f"{text.strip()} = 0")
    except tomllib.TOMLDecodeError:
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
    except tomllib.TOMLDecodeError:
        return text
    if set(parsed) != {"v"}:
        return text
    value = parsed["v"]
    if annotation_at(loc) is str and not isinstance(value, (str, list, dict)):
        return text
    return value

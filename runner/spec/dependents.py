"""Which spec files build on which: the ``extends`` chains, so that editing a base re-checks the specs on top of it.

``runner validate --dependents-in DIR`` (the pre-commit hook) uses :func:`plan_validation`: the
files a commit changed are checked, and so is every spec under ``DIR`` whose ``extends`` chain
reaches one of them. A changed file that other specs extend is a base: it is checked through
them, since a base may leave required keys to the specs that extend it.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]


def extends_chain(path: Path) -> set[Path]:
    """Every file ``path`` builds on through ``extends``, transitively, as real paths.

    Files that cannot be read or parsed, and cycles, end the chain there: ``runner validate``
    reports them; this only answers which files a spec reaches.

    Args:
        path: A spec file.

    Returns:
        The real paths of the bases (``path`` itself excluded unless a cycle leads back to it).
    """
    seen: set[Path] = set()
    todo = [Path(os.path.realpath(path))]
    while todo:
        current = todo.pop()
        for base in _extends_of(current):
            real = Path(os.path.realpath(current.parent / base))
            if real not in seen:
                seen.add(real)
                todo.append(real)
    return seen


def _extends_of(path: Path) -> list[str]:
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return []
    value = raw.get("extends")
    if isinstance(value, str):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, str)]
    return []


@dataclass
class ValidationPlan:
    """What ``runner validate --dependents-in`` checks.

    Attributes:
        files: The specs to validate, in order: the changed files that are not bases, then the
            specs that extend a changed file.
        bases: Changed files that other specs extend, each with the specs that extend it.
    """

    files: list[Path] = field(default_factory=list)
    bases: dict[Path, list[Path]] = field(default_factory=dict)


def plan_validation(changed: Sequence[str | Path], folders: Iterable[str | Path]) -> ValidationPlan:
    """The changed files plus every spec under ``folders`` whose ``extends`` chain reaches one of them.

    Args:
        changed: Spec files named on the command line (by pre-commit: the staged ones).
        folders: Where the specs that may extend them live (searched recursively for ``*.toml``).

    Returns:
        The :class:`ValidationPlan`; paths keep the form they were given or found in.
    """
    given = [Path(p) for p in changed]
    real = {Path(os.path.realpath(p)): p for p in given}
    candidates = sorted({p for folder in folders for p in Path(folder).rglob("*.toml") if p.is_file()})
    plan = ValidationPlan()
    dependents: list[Path] = []
    for candidate in candidates:
        reached = extends_chain(candidate) & set(real)
        for base in sorted(reached):
            plan.bases.setdefault(real[base], []).append(candidate)
        if reached and Path(os.path.realpath(candidate)) not in real:
            dependents.append(candidate)
    plan.files = [p for p in given if p not in plan.bases] + dependents
    return plan

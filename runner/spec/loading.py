"""Load a spec: read its files, apply ``--set``, validate into :class:`LoadedSpec` or located issues.

Also: ``runner validate``: check spec files one by one (with the specs that extend them) and report each.

Also: which spec files build on which: the ``extends`` chains, so that editing a base re-checks the specs on top of it.

Details: docs/design.md, "Module notes", runner/spec/loading.py.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from runner.errors import SpecError

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

from runner.errors import SpecIssue
from runner.spec.dump import spec_sha256
from runner.spec.messages import Loc, explain_errors, format_key, locate_keys
from runner.spec.overrides import apply_override, apply_unset, option_of, parse_key, typed_as
from runner.spec.reading import Origin, Provenance, read_tree
from runner.spec.rules import INT64_LIMIT
from runner.spec.schema import ExperimentSpec


@dataclass(frozen=True)
class LoadedSpec:
    """A validated spec and where it came from.

    Attributes:
        spec: The validated spec; relative paths in it are already absolute.
        path: Absolute path of the spec file.
        source_text: The text of that file (not of the files it extends).
        data: The merged raw dict after ``extends`` and ``--set``, paths resolved.
        sha256: Hex SHA-256 of :func:`runner.spec.dump.dump_spec` of ``spec`` (ignores comments and layout).
        overrides: The ``--set`` texts applied, in order.
        unset: The keys ``--unset`` removed (before the ``--set`` texts were applied); a key no spec file
            wrote is left out (it changed nothing, so it neither names the run nor is repeated).
        sources: Every file read, ``(absolute path, text)``: the spec file first, then each file it
            extends; a run logs them all, so its spec is self-contained.
    """

    spec: ExperimentSpec
    path: Path
    source_text: str
    data: dict[str, Any]
    sha256: str
    overrides: tuple[str, ...] = ()
    unset: tuple[str, ...] = ()
    sources: tuple[tuple[Path, str], ...] = ()

    def command_line(self) -> list[str]:
        """The ``--unset`` and ``--set`` arguments that made this spec from its file, in the order applied."""
        out: list[str] = []
        for key in self.unset:
            out += ["--unset", key]
        for override in self.overrides:
            out += ["--set", override]
        return out


def load_spec(path: str | Path, overrides: Sequence[str] = (), unset: Sequence[str] = ()) -> LoadedSpec:
    """Read, compose, override and validate a spec file.

    ``extends = "base.toml"`` (or a list) at the top level deep-merges the named files
    (relative to the extending file) under this one: tables merge key by key, other
    values are replaced. ``unset`` keys are then removed (their defaults apply), and
    ``overrides`` (``"optim.lr=0.05"``) are applied last; each value is read as a TOML
    value, and text that is not valid TOML is taken as a string.

    Args:
        overrides: ``dotted.key=value`` strings from ``--set``, applied in order.
        unset: Dotted keys from ``--unset``; a key the schema does not know is an issue (did-you-mean).

    Returns:
        The validated spec with its path, source text, merged dict and hash.

    Raises:
        SpecError: The file is missing, unreadable, not UTF-8, not TOML, empty, or
            invalid; every problem found is listed, each with file, line and key.
    """
    shown = Path(path)
    absolute = Path(os.path.abspath(shown))
    issues: list[SpecIssue] = []
    tree = read_tree(absolute, shown, issues)
    if tree is None:
        raise SpecError(issues)
    if not tree.data:
        message = f"spec is empty: a spec needs at least {', '.join(_required_keys())}"
        raise SpecError(SpecIssue(shown, None, "", message))
    removed = tuple(key for key in unset if apply_unset(tree, key, issues))  # a key no file wrote changes nothing
    for override in overrides:
        apply_override(tree, override, issues)
    where = lambda loc: _origin_of(tree.provenance, loc, shown)  # noqa: E731
    spec = _validate(tree.data, where, issues, {"spec_dir": absolute.parent})
    if issues or spec is None:
        raise SpecError(issues)
    return LoadedSpec(
        spec, absolute, tree.text, tree.data, spec_sha256(spec), tuple(overrides), removed, tuple(tree.sources)
    )


def load_resolved_text(text: str, path: Path, shown: str) -> LoadedSpec:
    """Validate a resolved spec stored with a run (``spec/resolved.toml``) as if it were the file ``path``.

    A resolved spec has every default written out, paths already absolute and no ``extends``, so
    it stands alone; ``path`` (the spec file the run was started from) only sets the folder that
    factory imports (``pkg.module:factory``) are taken from.

    Args:
        path: Absolute path of the run's original spec file (it need not exist any more).
        shown: What messages call the text, e.g. ``run 3f2a...: spec/resolved.toml``.

    Returns:
        The validated spec; ``source_text`` and ``sources`` are the resolved text itself.

    Raises:
        SpecError: The text is not TOML or does not validate (e.g. written by another version).
    """
    issues: list[SpecIssue] = []
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise SpecError(SpecIssue(Path(shown), None, "", f"invalid TOML: {exc}")) from None
    spec = _validate(data, lambda loc: Origin(Path(shown), None), issues)
    if spec is None:
        raise SpecError(issues)
    return LoadedSpec(spec, path, text, data, spec_sha256(spec), sources=((path, text),))


def spec_from_dict(d: dict[str, Any], origin: str = "<dict>") -> ExperimentSpec:
    """Validate a raw spec dict (no ``extends``, no path resolution).

    Args:
        origin: Name shown in error messages in place of a file.

    Returns:
        The validated spec.

    Raises:
        SpecError: One issue per problem, each with its dotted key (no line numbers).
    """
    issues: list[SpecIssue] = []
    spec = _validate(d, lambda loc: Origin(Path(origin), None), issues)
    if spec is None:
        raise SpecError(issues)
    return spec


def relocate_issues(error: SpecError, loaded: LoadedSpec) -> SpecError:
    """Place issues found while building (model, optimizer, dataset kwargs) on the spec file's lines.

    Builders only know the dotted key (``optim.kwargs``); this finds where that key is written
    in the spec file so the message reads ``FILE:LINE: optim.kwargs: ...`` like every other
    spec error. Keys written in an ``extends`` base keep the file name without a line, and so
    does a key that ``--set`` replaced, whose message names that ``--set``.

    Args:
        error: Raised by a builder; issues without a file are placed.

    Returns:
        A new error with the same issues, located.
    """
    lines = locate_keys(loaded.source_text)
    moved = []
    for issue in error.issues:
        if issue.file is None and issue.origin is None and issue.key:
            override = _override_of(loaded, issue.key)
            if override is not None:
                moved.append(SpecIssue(loaded.path, None, issue.key, f"{issue.message} (from {override})"))
            else:
                moved.append(SpecIssue(loaded.path, _line_in(lines, issue.key), issue.key, issue.message))
        else:
            moved.append(issue)
    return SpecError(moved)


def _override_of(loaded: LoadedSpec, key: str) -> str | None:
    """The ``--set KEY=VALUE`` (or ``--unset KEY``) that replaced dotted ``key`` or a table above it, or ``None``."""
    loc = tuple(key.split("."))
    flags = [(f"--unset {k}", k) for k in loaded.unset] + [(typed_as(text), text) for text in loaded.overrides]
    for flag, text in reversed(flags):
        o = parse_key(text.partition("=")[0])
        if o is not None and loc[: len(o)] == o:
            return flag
    return None


def key_line(loaded: LoadedSpec, key: str) -> int | None:
    """Line of the spec file where dotted ``key`` (or its nearest written ancestor) is written.

    Args:
        key: Dotted key such as ``parallel.mode``; empty for none.

    Returns:
        The 1-based line, or ``None`` when the key is not written in the file itself (a default,
        or a value from an ``extends`` base) or ``--set`` / ``--unset`` replaced it.
    """
    if not key or _override_of(loaded, key) is not None:
        return None
    return _line_in(locate_keys(loaded.source_text), key)


def _line_in(lines: dict[Loc, int], key: str) -> int | None:
    loc: Loc = ()
    for part in key.split("."):  # "metrics.val[1]" -> ("metrics", "val", 1)
        name, *indices = part.split("[")
        loc = (*loc, name, *(int(i.rstrip("]")) for i in indices if i.rstrip("]").isdigit()))
    return next((lines[loc[:n]] for n in range(len(loc), 0, -1) if loc[:n] in lines), None)


def _validate(
    data: dict[str, Any], where: Callable[[Loc], Origin], issues: list[SpecIssue], context: dict[str, Any] | None = None
) -> ExperimentSpec | None:
    """Validate ``data``; add one located issue per problem and return None on failure. ``context`` ``{"spec_dir":
    folder}`` also checks model and dataset names (:mod:`runner.spec.names`). Every integer, also inside ``kwargs``,
    must fit torch's int64 (:func:`_beyond_int64`)."""
    overflows = dict(_beyond_int64(data))
    try:
        spec = ExperimentSpec.model_validate(data, context=context)
        errors = []
    except ValidationError as exc:
        spec, errors = None, explain_errors(exc.errors(include_url=False))
    if not errors and not overflows:
        return spec
    reported = {loc for loc, _ in errors}
    errors += [(loc, message) for loc, message in overflows.items() if loc not in reported]
    found = []
    for loc, message in errors:
        origin = where(loc)
        override = origin.override
        text = message if override is None else f"{message} (from {typed_as(override)})"
        found.append(
            SpecIssue(origin.file, origin.line, format_key(loc), text, option_of(override) if override else None)
        )
    files = [i.file for i in found if i.file is not None]
    order = {f: i for i, f in enumerate(dict.fromkeys(files))}
    found.sort(key=lambda i: (i.file is None, order.get(i.file, 0) if i.file else 0, i.line or 0))
    issues.extend(found)
    return None


def _beyond_int64(value: Any, loc: Loc = ()) -> Iterator[tuple[Loc, str]]:
    """``(key path, message)`` of every integer under ``value`` outside torch's int64 (``-2**63 <= n < 2**63``). TOML
    integers are 64-bit, but Python's reader and ``--set`` take any size; torch raises on a larger one (an
    ``OverflowError``, or a ``TypeError`` carrying a C++ stack trace), maybe only mid-run."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _beyond_int64(item, (*loc, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _beyond_int64(item, (*loc, index))
    elif isinstance(value, int) and not isinstance(value, bool) and not -INT64_LIMIT <= value < INT64_LIMIT:
        yield loc, f"got {value}; expected a whole number from -2**63 to 2**63 - 1 (torch takes 64-bit integers)"


def _origin_of(provenance: Provenance, loc: Loc, top: Path) -> Origin:
    """Where ``loc`` (or its nearest written ancestor) came from; the top file's first line if nowhere."""
    for n in range(len(loc), 0, -1):
        if loc[:n] in provenance:
            return provenance[loc[:n]]
    for known, origin in provenance.items():  # e.g. an unknown table created only by --set a.b.c=1
        if known[: len(loc)] == loc:
            return origin
    return Origin(top, 1)


def _required_keys(model: type[BaseModel] = ExperimentSpec, prefix: str = "") -> list[str]:
    """Dotted keys a spec must set, e.g. ``name``, ``model.name``, ``data.batch_size``."""
    keys = []
    for name, info in model.model_fields.items():
        if info.is_required():
            ann = info.annotation
            if isinstance(ann, type) and issubclass(ann, BaseModel):
                keys += _required_keys(ann, f"{prefix}{name}.")
            else:
                keys.append(prefix + name)
    return keys


EXIT_OK = 0


def validate_files(files: Sequence[str], dependents_in: Sequence[str] = ()) -> int:
    """Validate ``files``; a file extended by specs under ``dependents_in`` is checked through them.

    Args:
        files: Spec files as named on the command line.
        dependents_in: Folders whose specs are also checked when their ``extends`` chain reaches a
            file of ``files`` (:func:`runner.spec.loading.plan_validation`); empty: ``files`` alone.

    Returns:
        The exit status: 0 when every file is valid, else the ``exit_code`` of :class:`SpecError` (2).
    """
    checked: list[str | Path] = list(files)
    if dependents_in:
        from runner.spec.loading import plan_validation

        plan = plan_validation(files, dependents_in)
        for base, users in plan.bases.items():
            print(f"base  {base}: checked through {len(users)} spec(s) that extend it")
        checked = list(plan.files)
    status = EXIT_OK
    for path in checked:  # every file is checked, so one run reports all bad files
        try:
            load_spec(path)
            print(f"ok    {path}")
        except SpecError as exc:
            status = exc.exit_code
            print(f"error {path}", file=sys.stdout)
            print(_indent(str(exc)), file=sys.stderr)
    return status


def _indent(text: str) -> str:
    return "\n".join("  " + line for line in text.splitlines())


try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]


def extends_chain(path: Path) -> set[Path]:
    """Every file ``path`` builds on through ``extends``, transitively, as real paths.

    Files that cannot be read or parsed, and cycles, end the chain there: ``runner validate``
    reports them; this only answers which files a spec reaches.

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

"""Load a spec: read its files, apply ``--set``, validate; ``runner validate`` and the ``extends`` chains.

The steps live apart: ``runner.spec.reading`` (TOML, ``extends``, ``--set`` -> dict and key origins),
``runner.spec.messages`` (wording pydantic's errors);
this module validates and places every problem at ``FILE:LINE: dotted.key``.
"""

from __future__ import annotations

import os
import sys
import tomllib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from runner.errors import SpecError, SpecIssue, echo
from runner.spec.dump import cut_run_name, spec_sha256, values_label
from runner.spec.messages import Loc, explain_errors, format_key, locate_keys, nearest, schema_fields
from runner.spec.reading import Origin, apply_override, apply_unset, option_of, parse_key, read_tree, typed_as
from runner.spec.rules import INT64_LIMIT
from runner.spec.schema import ExperimentSpec


@dataclass(frozen=True)
class LoadedSpec:
    """A validated spec and where it came from.

    ``data`` is the merged raw dict after ``extends`` and ``--set``; ``sha256`` hashes :func:`dump_spec` of ``spec``;
    ``unset`` holds only keys some file wrote; ``sources`` is every file read, the spec first, all logged with the run.
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

    ``extends`` deep-merges the named files under this one; ``unset`` keys are then removed and ``overrides``
    (``"optim.lr=0.05"``, TOML values, else strings) applied last. Raises SpecError: The file is missing, unreadable,
    not TOML, empty or invalid; every issue with file, line and key."""
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
    """Validate a run's ``spec/resolved.toml`` as if it were the file ``path`` (which sets the factories' folder only).

    Raises SpecError when the text is not TOML or does not validate (e.g. written by another version).
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
    """Validate a raw spec dict (no ``extends``, no paths); SpecError issues carry dotted keys, no lines."""
    issues: list[SpecIssue] = []
    spec = _validate(d, lambda loc: Origin(Path(origin), None), issues)
    if spec is None:
        raise SpecError(issues)
    return spec


def relocate_issues(error: SpecError, loaded: LoadedSpec) -> SpecError:
    """Place builders' issues (dotted key only) on the spec file's lines, as ``FILE:LINE: key: ...``.

    Keys from an ``extends`` base keep the file without a line; a key ``--set`` replaced names that ``--set``.
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
    loc = _loc_of(key)
    flags = [(f"--unset {k}", k) for k in loaded.unset] + [(typed_as(text), text) for text in loaded.overrides]
    for flag, text in reversed(flags):
        o = parse_key(text.partition("=")[0])
        if o is not None and loc[: len(o)] == o:
            return flag
    return None


def key_line(loaded: LoadedSpec, key: str) -> int | None:
    """1-based line where ``key`` (or its nearest written ancestor) is written; ``None`` for a default, a base's
    value, or a key ``--set``/``--unset`` replaced."""
    if not key or _override_of(loaded, key) is not None:
        return None
    return _line_in(locate_keys(loaded.source_text), key)


def _line_in(lines: dict[Loc, int], key: str) -> int | None:
    return nearest(lines, _loc_of(key))


def _loc_of(key: str) -> Loc:
    """A builder's dotted key as a location, list indices included: ``"metrics.val[1]"`` -> ``("metrics", "val",
    1)``, so ``data.transforms[0]`` is found under the ``--set data.transforms=...`` that wrote it."""
    loc: Loc = ()
    for part in key.split("."):
        name, *indices = part.split("[")
        loc = (*loc, name, *(int(i.rstrip("]")) for i in indices if i.rstrip("]").isdigit()))
    return loc


def _validate(
    data: dict[str, Any], where: Callable[[Loc], Origin], issues: list[SpecIssue], context: dict[str, Any] | None = None
) -> ExperimentSpec | None:
    """Validate ``data``, one located issue per problem (``None`` on failure); ``context`` adds the name checks."""
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
    """``(key path, message)`` of each integer outside torch's int64: TOML readers take any, torch fails mid-run."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _beyond_int64(item, (*loc, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _beyond_int64(item, (*loc, index))
    elif isinstance(value, int) and not isinstance(value, bool) and not -INT64_LIMIT <= value < INT64_LIMIT:
        yield loc, f"got {value}; expected a whole number from -2**63 to 2**63 - 1 (torch takes 64-bit integers)"


def _origin_of(provenance: dict[Loc, Origin], loc: Loc, top: Path) -> Origin:
    """Where ``loc`` (or its nearest written ancestor) came from; the top file's first line if nowhere."""
    if (found := nearest(provenance, loc)) is not None:
        return found
    for known, origin in provenance.items():  # e.g. an unknown table created only by --set a.b.c=1
        if known[: len(loc)] == loc:
            return origin
    return Origin(top, 1)


def _required_keys() -> list[str]:
    """Dotted keys a spec must set, e.g. ``name``, ``model.name``, ``data.batch_size``."""
    required = {""}  # the root, then each required key of a required table (a table comes before its keys)
    for key, info, _ in schema_fields():
        if info.is_required() and key.rpartition(".")[0] in required:
            required.add(key)
    return [key for key, _, table in schema_fields() if key in required and not table]


EXIT_OK = 0


def validate_files(files: Sequence[str], dependents_in: Sequence[str] = ()) -> int:
    """Validate ``files`` (a base through the specs under ``dependents_in`` that extend it); return the exit status."""
    checked: list[str | Path] = list(files)
    if dependents_in:
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
            echo("\n".join("  " + line for line in str(exc).splitlines()), err=True)
    return status


def extends_chain(path: Path) -> set[Path]:
    """The real paths ``path`` builds on through ``extends``; unreadable files and cycles end the chain there."""
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
    """What ``runner validate --dependents-in`` checks: ``files`` in order, and each changed base with its
    dependents."""

    files: list[Path] = field(default_factory=list)
    bases: dict[Path, list[Path]] = field(default_factory=dict)


def plan_validation(changed: Sequence[str | Path], folders: Iterable[str | Path]) -> ValidationPlan:
    """The changed files plus every ``*.toml`` under ``folders`` whose ``extends`` chain reaches one of them."""
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


_IN_THE_MODE = ("parallel.mode", "parallel.nproc_per_node")  # already said by the "<mode>-<size>" part


def default_run_name(loaded: LoadedSpec, mode: str, size: int | str) -> str:
    """``<name> <mode>-<size> <values the command line changed>``, e.g. ``digits-mlp ddp-2 lr=0.05``, at most 250
    characters."""
    changed = {k: v for k, v in overridden_values(loaded).items() if k not in _IN_THE_MODE}
    parts = [loaded.spec.name, f"{mode}-{size}", values_label(changed)]
    return cut_run_name(" ".join(p for p in parts if p))


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

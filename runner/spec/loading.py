"""Read a spec: TOML file -> dict (``extends``, ``--set`` overrides, key lines) -> validated ExperimentSpec."""

from __future__ import annotations

import copy
import datetime
import hashlib
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import tomli_w
from pydantic import BaseModel, ValidationError

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

from runner.errors import SpecError, SpecIssue
from runner.spec.locate import Loc, format_key, line_of, locate_keys
from runner.spec.messages import annotation_at, explain_errors, show
from runner.spec.schema import ExperimentSpec

# Keys holding filesystem paths; relative values are resolved against the folder of the
# file that wrote them (``--set`` values against the working directory).
PATH_KEYS: tuple[Loc, ...] = (("data", "root"), ("checkpoint", "dir"))


@dataclass(frozen=True)
class LoadedSpec:
    """A validated spec and where it came from.

    Attributes:
        spec: The validated spec; relative paths in it are already absolute.
        path: Absolute path of the spec file.
        source_text: The text of that file (not of the files it extends).
        data: The merged raw dict after ``extends`` and ``--set``, paths resolved.
        sha256: Hex SHA-256 of :func:`dump_spec` of ``spec`` (ignores comments and layout).
    """

    spec: ExperimentSpec
    path: Path
    source_text: str
    data: dict
    sha256: str


@dataclass(frozen=True)
class _Origin:
    """Where a key was written: a file and line, or a ``--set`` override."""

    file: Path | None
    line: int | None
    override: str | None = None


_Provenance = dict[Loc, _Origin]


def load_spec(path: str | Path, overrides: Sequence[str] = ()) -> LoadedSpec:
    """Read, compose, override and validate a spec file.

    ``extends = "base.toml"`` (or a list) at the top level deep-merges the named files
    (relative to the extending file) under this one: tables merge key by key, other
    values are replaced. ``overrides`` (``"optim.lr=0.05"``) are applied last; each value
    is read as a TOML value, and text that is not valid TOML is taken as a string.

    Args:
        path: The spec file.
        overrides: ``dotted.key=value`` strings from ``--set``, applied in order.

    Returns:
        The validated spec with its path, source text, merged dict and hash.

    Raises:
        SpecError: The file is missing, unreadable, not UTF-8, not TOML, empty, or
            invalid; every problem found is listed, each with file, line and key.
    """
    shown = Path(path)
    absolute = Path(os.path.abspath(shown))
    issues: list[SpecIssue] = []
    loaded = _load_tree(absolute, shown, (), issues)
    if loaded is None:
        raise SpecError(issues)
    data, provenance, text = loaded
    if not data:
        raise SpecError(
            SpecIssue(shown, None, "", f"spec is empty: a spec needs at least {', '.join(_required_keys())}")
        )
    for override in overrides:
        _apply_override(data, provenance, override, issues)
    spec = _validate(data, lambda loc: _origin_of(provenance, loc, shown), issues)
    if issues or spec is None:
        raise SpecError(issues)
    return LoadedSpec(spec=spec, path=absolute, source_text=text, data=data, sha256=spec_sha256(spec))


def spec_from_dict(d: dict, origin: str = "<dict>") -> ExperimentSpec:
    """Validate a raw spec dict (no ``extends``, no path resolution).

    Args:
        d: The spec as parsed TOML.
        origin: Name shown in error messages in place of a file.

    Returns:
        The validated spec.

    Raises:
        SpecError: One issue per problem, each with its dotted key (no line numbers).
    """
    issues: list[SpecIssue] = []
    spec = _validate(d, lambda loc: _Origin(Path(origin), None), issues)
    if spec is None:
        raise SpecError(issues)
    return spec


def dump_spec(spec: ExperimentSpec) -> str:
    """Write a spec as TOML with every default made explicit; it re-loads to an equal spec.

    ``None`` values and empty tables are left out. A default is written unless writing it
    would change how the table validates (e.g. ddp-only options under ``mode = "none"``).

    Args:
        spec: A validated spec.

    Returns:
        TOML text, keys in schema order.
    """
    return tomli_w.dumps(_plain_table(spec))


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

    walk("", _plain_table(spec))
    return flat


# ----------------------------------------------------------------------------- reading


def _load_tree(path: Path, shown: Path, chain: tuple[tuple[Path, Path], ...], issues: list[SpecIssue]):
    """Read ``path`` and, recursively, the files it extends; return (data, provenance, text) or None."""
    read = _read_file(path, shown, issues)
    if read is None:
        return None
    raw, text, lines = read
    chain = (*chain, (Path(os.path.realpath(path)), shown))
    data: dict = {}
    provenance: _Provenance = {}
    ok = True
    for base, line in _extends_of(raw, lines, shown, issues):
        target = path.parent / base
        target_shown = Path(os.path.normpath(shown.parent / base))
        real = Path(os.path.realpath(target))
        if any(real == seen for seen, _ in chain):
            cycle = " -> ".join(str(s) for _, s in chain) + f" -> {target_shown}"
            issues.append(SpecIssue(shown, line, "extends", f"extends cycle: {cycle}; remove one of these extends"))
            ok = False
            continue
        if not target.is_file():
            what = "is a directory" if target.is_dir() else "does not exist"
            issues.append(
                SpecIssue(
                    shown,
                    line,
                    "extends",
                    f"extends {show(base)}: {target_shown} {what} (paths are relative to {shown})",
                )
            )
            ok = False
            continue
        sub = _load_tree(target, target_shown, chain, issues)
        if sub is None:
            ok = False
            continue
        _merge(data, provenance, sub[0], sub[1], ())
    _resolve_paths(raw, path.parent)
    own = {loc: _Origin(shown, line) for loc, line in lines.items() if loc[:1] != ("extends",)}
    _merge(data, provenance, raw, own, ())
    return (data, provenance, text) if ok else None


def _read_file(path: Path, shown: Path, issues: list[SpecIssue]):
    """Read one TOML file in binary mode; return (raw dict, text, key lines) or None after adding an issue."""
    if path.is_dir():
        issues.append(SpecIssue(shown, None, "", "is a directory, not a spec file: give the path of a .toml file"))
        return None
    try:
        blob = path.read_bytes()
    except FileNotFoundError:
        issues.append(SpecIssue(shown, None, "", f"spec file not found (looked for {path})"))
        return None
    except OSError as exc:
        issues.append(SpecIssue(shown, None, "", f"cannot read the spec file: {exc.strerror or exc}"))
        return None
    try:
        text = blob.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = blob.count(b"\n", 0, exc.start) + 1
        column = exc.start - (blob.rfind(b"\n", 0, exc.start) + 1) + 1
        issues.append(
            SpecIssue(
                shown,
                line,
                "",
                f"not UTF-8 text: byte 0x{blob[exc.start]:02x} at byte offset {exc.start} (column {column}); "
                "save the file as UTF-8",
            )
        )
        return None
    text = text.removeprefix("\ufeff")
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        issues.append(_syntax_issue(shown, text, str(exc)))
        return None
    return raw, text, locate_keys(text)


_AT = re.compile(r"\s*\((?:at line (\d+), column (\d+)|at end of document)\)\s*$")


def _syntax_issue(shown: Path, text: str, message: str) -> SpecIssue:
    """Turn a tomllib message ``Invalid value (at line 2, column 6)`` into a located issue with a hint."""
    m = _AT.search(message)
    what = message[: m.start()] if m else message
    lines = text.split("\n")
    if m and m.group(1):
        line, column = int(m.group(1)), int(m.group(2))
        where = f" at column {column}"
    else:
        line, where = max(1, len(lines) - (1 if lines and not lines[-1].strip() else 0)), " at the end of the file"
    source = lines[line - 1] if 0 < line <= len(lines) else ""
    hint = _syntax_hint(source, what)
    key = _key_on_line(lines, line)
    what = what[:1].lower() + what[1:]
    return SpecIssue(shown, line, key, f"invalid TOML: {what}{where}" + (f" ({hint})" if hint else ""))


def _syntax_hint(source: str, what: str) -> str:
    if what.startswith(("Cannot overwrite", "Cannot declare")):
        return "each key and each [table] may be written only once"
    if what.startswith("Unclosed"):
        return "close it with the matching bracket or quote"
    key, eq, value = source.partition("=")
    value = value.split("#", 1)[0].strip() if eq else ""
    if m := re.fullmatch(r"([+-]?)\.(\d[\d_]*(?:[eE][+-]?\d+)?)", value):
        return f"write {m.group(1)}0.{m.group(2)}"
    if m := re.fullmatch(r"([+-]?\d[\d_]*)\.", value):
        return f"write {m.group(1)}.0"
    if value in ("True", "False", "TRUE", "FALSE", "yes", "no", "on", "off"):
        return f"write {'true' if value.lower() in ('true', 'yes', 'on') else 'false'} (TOML booleans are lowercase)"
    if value in ("None", "none", "null", "nil", "NULL"):
        return "TOML has no null: leave the key out to use its default"
    if re.fullmatch(r"[A-Za-z_][\w.\-/:+]*", value):
        return f"strings need quotes: write {key.strip()} = {show(value)}"
    return ""


def _key_on_line(lines: list[str], line: int) -> str:
    """Best-effort dotted key of the statement on ``line`` of a text that failed to parse."""
    source = lines[line - 1] if 0 < line <= len(lines) else ""
    key, eq, _ = source.partition("=")
    if not eq or not key.strip() or key.lstrip().startswith(("#", "[")):
        return ""
    found = locate_keys("\n".join([*lines[: line - 1], key + "= 0"]))
    here = [loc for loc, n in found.items() if n == line]
    return format_key(max(here, key=len)) if here else ""


def _extends_of(raw: dict, lines: dict[Loc, int], shown: Path, issues: list[SpecIssue]) -> list[tuple[str, int]]:
    """Pop ``extends`` from ``raw``; return [(relative path, line)]; bad values become issues."""
    value = raw.pop("extends", None)
    if value is None:
        return []
    if isinstance(value, str):
        return [(value, line_of(lines, ("extends",)))]
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return [(v, line_of(lines, ("extends", i))) for i, v in enumerate(value)]
    issues.append(
        SpecIssue(
            shown,
            line_of(lines, ("extends",)),
            "extends",
            f"got {show(value)}; expected a file name or a list of file names",
        )
    )
    return []


def _merge(dst: dict, provenance: _Provenance, src: dict, src_origins: _Provenance, prefix: Loc) -> None:
    """Deep-merge ``src`` into ``dst`` (tables merge, other values replace) and record where keys came from."""
    for key, value in src.items():
        loc = (*prefix, key)
        if isinstance(value, dict) and isinstance(dst.get(key), dict):
            _merge(dst[key], provenance, value, {}, loc)
        else:
            _forget(provenance, loc)
            dst[key] = copy.deepcopy(value)
    provenance.update(src_origins)


def _forget(provenance: _Provenance, loc: Loc) -> None:
    for known in [k for k in provenance if k[: len(loc)] == loc]:
        del provenance[known]


def _resolve_paths(raw: dict, base: Path) -> None:
    for table, key in PATH_KEYS:
        section = raw.get(table)
        if isinstance(section, dict) and isinstance(section.get(key), str) and section[key]:
            section[key] = os.path.normpath(base / Path(section[key]).expanduser())


# ----------------------------------------------------------------------------- overrides


def _apply_override(data: dict, provenance: _Provenance, override: str, issues: list[SpecIssue]) -> None:
    """Apply one ``dotted.key=value``; problems with the override itself become issues."""
    key_text, eq, value_text = override.partition("=")
    loc = _parse_key(key_text) if eq else None
    if loc is None:
        issues.append(
            SpecIssue(None, None, "", f"{show(override)}: expected dotted.key=value, e.g. --set optim.lr=0.05", "--set")
        )
        return
    bare_fraction = re.fullmatch(r"([+-]?)\.(\d.*)", value_text.strip())
    if bare_fraction:
        fixed = f"{bare_fraction.group(1)}0.{bare_fraction.group(2)}"
        issues.append(
            SpecIssue(None, None, format_key(loc), f"invalid TOML value {value_text.strip()} (write {fixed})", "--set")
        )
        return
    value = _override_value(loc, value_text.strip())
    node = data
    for i, part in enumerate(loc[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            issues.append(
                SpecIssue(
                    None,
                    None,
                    format_key(loc),
                    f"{format_key(loc[: i + 1])} is {show(child)}, not a table (from --set {override})",
                    "--set",
                )
            )
            return
        node = child
    if loc in PATH_KEYS and isinstance(value, str) and value:
        value = os.path.abspath(os.path.expanduser(value))
    node[loc[-1]] = value
    _forget(provenance, loc)
    provenance[loc] = _Origin(None, None, override)


def _parse_key(text: str) -> Loc | None:
    """Parse a TOML dotted key (``optim.lr``, ``sweep.params."optim.lr"``); None if it is not one."""
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
    if annotation_at(loc) in (str, Optional[str]) and not isinstance(value, (str, list, dict)):
        return text
    return value


# ----------------------------------------------------------------------------- validation


def _validate(data: dict, where, issues: list[SpecIssue]) -> ExperimentSpec | None:
    """Validate ``data``; add one located issue per problem and return None on failure."""
    try:
        return ExperimentSpec.model_validate(data)
    except ValidationError as exc:
        found = []
        for loc, message in explain_errors(exc.errors(include_url=False)):
            origin = where(loc)
            if origin.override is not None:
                message += f" (from --set {origin.override})"
            found.append(
                SpecIssue(origin.file, origin.line, format_key(loc), message, "--set" if origin.override else None)
            )
        order = {f: i for i, f in enumerate(dict.fromkeys(i.file for i in found if i.file is not None))}
        found.sort(key=lambda i: (i.file is None, order.get(i.file, 0), i.line or 0))
        issues.extend(found)
        return None


def _origin_of(provenance: _Provenance, loc: Loc, top: Path) -> _Origin:
    for n in range(len(loc), 0, -1):
        if loc[:n] in provenance:
            return provenance[loc[:n]]
    for known, origin in provenance.items():  # e.g. an unknown table created only by --set a.b.c=1
        if known[: len(loc)] == loc:
            return origin
    return _Origin(top, 1)


def relocate_issues(error: SpecError, loaded: LoadedSpec) -> SpecError:
    """Place issues found while building (model, optimizer, dataset kwargs) on the spec file's lines.

    Builders only know the dotted key (``optim.kwargs``); this finds where that key is written
    in the spec file so the message reads ``FILE:LINE: optim.kwargs: ...`` like every other
    spec error. Keys written in an ``extends`` base keep the file name without a line.
    """
    lines = locate_keys(loaded.source_text)
    moved = []
    for issue in error.issues:
        if issue.file is None and issue.origin is None and issue.key:
            loc = tuple(issue.key.split("."))
            line = next((lines[loc[:n]] for n in range(len(loc), 0, -1) if loc[:n] in lines), None)
            issue = SpecIssue(loaded.path, line, issue.key, issue.message)
        moved.append(issue)
    return SpecError(moved)


def _required_keys(model: type[BaseModel] = ExperimentSpec, prefix: str = "") -> list[str]:
    keys = []
    for name, field in model.model_fields.items():
        if field.is_required():
            ann = field.annotation
            if isinstance(ann, type) and issubclass(ann, BaseModel):
                keys += _required_keys(ann, f"{prefix}{name}.")
            else:
                keys.append(prefix + name)
    return keys


# ----------------------------------------------------------------------------- dumping


def _plain_table(model: BaseModel) -> dict:
    """Plain dict of ``model``: set fields, plus every default that validates alongside them."""
    cls = type(model)
    values = {}
    for name in cls.model_fields:
        value = _plain(getattr(model, name))
        if value is None or (value == {} and not cls.model_fields[name].is_required()):
            continue
        values[name] = value
    chosen = {n: v for n, v in values.items() if n in model.model_fields_set}
    for name, value in values.items():
        if name not in chosen and _validates(cls, {**chosen, name: value}):
            chosen[name] = value
    result = {n: v for n, v in values.items() if n in chosen}
    if _validates(cls, result, expect=model):
        return result
    return {n: v for n, v in values.items() if n in model.model_fields_set}


def _plain(value: Any) -> Any:
    if isinstance(value, BaseModel):
        return _plain_table(value)
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items() if v is not None}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _validates(cls: type[BaseModel], data: dict, expect: BaseModel | None = None) -> bool:
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

"""Read spec files: TOML (binary, UTF-8) -> dict, ``extends`` merged in, then ``--set`` and ``--unset`` applied, with
the file and line of every key.

Reading is kept apart from validating (``runner.spec.loading``): the result is a plain dict
and, for each key, where it was written (``Origin``), so that validation messages can say
``FILE:LINE:`` even for keys that came from a base file. Problems with the files themselves
(missing, not UTF-8, not TOML, an ``extends`` cycle) become located ``runner.errors.SpecIssue``.

``--set`` and ``--unset``: each value is read as a TOML value (``0.05``, ``[0, 1]``, ``{ a = 1 }``); text that is not
TOML, or any scalar given for a string key, is taken as a string. The override becomes the
origin of its key, so validation messages say ``--set: optim.lr: ... (from --set optim.lr=x)``; an
override a shorthand flag made (``FlagOverride``) is named by that flag instead.
``--unset`` removes a key written in the file (or a file it extends), so its default applies;
unsetting comes before setting.
"""

from __future__ import annotations

import copy
import json
import os
import re
import stat
import tempfile
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from runner.errors import SpecIssue, did_you_mean, show, with_hint
from runner.spec.messages import Loc, annotation_at, format_key, locate_keys, nearest, nested_beyond, schema_fields

# Keys holding filesystem paths; relative values are resolved against the folder of the
# file that wrote them (``--set`` values against the working directory).
PATH_KEYS: tuple[Loc, ...] = (("data", "root"), ("checkpoint", "dir"))


@dataclass(frozen=True)
class Origin:
    """Where a key was written: a file (as the user named it) and 1-based line, or a ``--set`` override's text."""

    file: Path | None
    line: int | None
    override: str | None = None


Provenance = dict[Loc, Origin]


@dataclass
class SpecTree:
    """A spec file read with everything it extends, not yet validated: merged data, each key's origin, the top file's
    text, and every file read, once each."""

    data: dict[str, Any]
    provenance: Provenance
    text: str
    sources: list[tuple[Path, str]] = field(default_factory=list)


def read_tree(path: Path, shown: Path, issues: list[SpecIssue]) -> SpecTree | None:
    """Read ``path`` and, recursively, the files it ``extends``, deep-merged under it; ``None`` when a file could not
    be read (the reasons appended to ``issues``)."""
    return _read_tree(path, shown, (), issues)


def _read_tree(
    path: Path, shown: Path, chain: tuple[tuple[Path, Path], ...], issues: list[SpecIssue]
) -> SpecTree | None:
    read = _read_file(path, shown, issues)
    if read is None:
        return None
    raw, text, lines = read
    chain = (*chain, (Path(os.path.realpath(path)), shown))
    tree = SpecTree({}, {}, text, [(Path(os.path.normpath(path)), text)])
    ok = True
    for base in _extends_of(raw, lines, shown, issues):
        sub = _read_base(path, shown, base, chain, issues)
        if sub is None:
            ok = False
            continue
        merge(tree.data, tree.provenance, sub.data, sub.provenance, ())
        tree.sources += [s for s in sub.sources if all(s[0] != known for known, _ in tree.sources)]
    for table, key in PATH_KEYS:  # relative to the file that writes them
        section = raw.get(table)
        if isinstance(section, dict) and isinstance(section.get(key), str) and section[key]:
            section[key] = os.path.normpath(path.parent / Path(section[key]).expanduser())
    own = {loc: Origin(shown, line) for loc, line in lines.items() if loc[:1] != ("extends",)}
    merge(tree.data, tree.provenance, raw, own, ())
    return tree if ok else None


def _read_base(
    path: Path, shown: Path, entry: tuple[str, int], chain: tuple[tuple[Path, Path], ...], issues: list[SpecIssue]
) -> SpecTree | None:
    """Read one file ``extends`` names, as ``(relative path, line)``; a cycle or a missing file is an issue."""
    base, line = entry
    target = path.parent / base
    target_shown = Path(os.path.normpath(shown.parent / base))
    real = Path(os.path.realpath(target))
    if any(real == seen for seen, _ in chain):
        cycle = " -> ".join(str(s) for _, s in chain) + f" -> {target_shown}"
        issues.append(SpecIssue(shown, line, "extends", f"extends cycle: {cycle}; remove one of these extends"))
        return None
    if not target.is_file():
        what = "is a directory" if target.is_dir() else "does not exist"
        message = f"extends {show(base)}: {target_shown} {what} (paths are relative to {shown})"
        issues.append(SpecIssue(shown, line, "extends", message))
        return None
    return _read_tree(target, target_shown, chain, issues)


def _read_file(path: Path, shown: Path, issues: list[SpecIssue]) -> tuple[dict[str, Any], str, dict[Loc, int]] | None:
    """Read one TOML file in binary mode; return (raw dict, text, key lines) or None after adding an issue."""
    if path.is_dir():
        issues.append(SpecIssue(shown, None, "", "is a directory, not a spec file: give the path of a .toml file"))
        return None
    try:
        blob = _bounded_read(path)
    except _NotASpecFile as exc:
        issues.append(SpecIssue(shown, None, "", str(exc)))
        return None
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
        message = (
            f"not UTF-8 text: byte 0x{blob[exc.start]:02x} at byte offset {exc.start} (column {column}); "
            "save the file as UTF-8"
        )
        issues.append(SpecIssue(shown, line, "", message))
        return None
    text = text.removeprefix("\ufeff")
    deep = nested_beyond(text, MAX_NESTING)
    if deep is not None:  # Python's TOML parser recurses once per level: stop before it does
        message = f"arrays and inline tables nest more than {MAX_NESTING} levels deep here; flatten the value"
        issues.append(SpecIssue(shown, deep, _key_on_line(text.split("\n"), deep), message))
        return None
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        issues.append(_syntax_issue(shown, text, str(exc)))
        return None
    return raw, text, locate_keys(text)


MAX_NESTING = 32
MAX_SPEC_BYTES = 4 * 2**20  # a spec is a page of text; 4 MiB is far past any, and bounds what a wrong path reads


class _NotASpecFile(OSError):
    """The path is no regular file (a device, a FIFO, a socket) or is larger than :data:`MAX_SPEC_BYTES`."""


def _bounded_read(path: Path) -> bytes:
    """The bytes of the regular file ``path`` (links followed), at most :data:`MAX_SPEC_BYTES`.

    A spec path that is a link to ``/dev/zero`` was read until the kernel's OOM killer ended the process, one to
    ``/dev/urandom`` read on, and a FIFO blocked forever: it is opened without blocking and checked by its open
    descriptor (no race with a rename), and read to the bound. Raises _NotASpecFile, or OSError from the system."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as fh:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = (
                "a character device" if stat.S_ISCHR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else "no regular file"
            )
            raise _NotASpecFile(f"is {kind}, not a spec file: give the path of a .toml file")
        blob = fh.read(MAX_SPEC_BYTES + 1)
    if len(blob) > MAX_SPEC_BYTES:
        raise _NotASpecFile(
            f"is larger than {MAX_SPEC_BYTES // 2**20} MiB, too large for a spec: give the path of a .toml file"
        )
    return blob


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
    """The fix for common TOML slips on the line ``source``: ``.5``, ``1.``, ``True``, ``None``, bare words."""
    if what.startswith(("Cannot overwrite", "Cannot declare")):
        return "each key and each [table] may be written only once"
    if what.startswith("Unclosed"):
        return "close it with the matching bracket or quote"
    if what.startswith("Illegal character '\\n'") and source.count('"') % 2:
        return 'close the string with " on the same line, or write """...""" for text of several lines'
    if what.startswith("Expected ']' at the end of a table declaration"):
        return f"close the table name with ]: {source.strip().split()[0].rstrip(']')}]"
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


def _extends_of(
    raw: dict[str, Any], lines: dict[Loc, int], shown: Path, issues: list[SpecIssue]
) -> list[tuple[str, int]]:
    """Pop ``extends`` from ``raw``; return [(relative path, line)]; bad values become issues."""
    value = raw.pop("extends", None)
    if value is None:
        return []
    if isinstance(value, str):
        return [(value, nearest(lines, ("extends",)) or 1)]
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return [(v, nearest(lines, ("extends", i)) or 1) for i, v in enumerate(value)]
    message = f"got {show(value)}; expected a file name or a list of file names"
    issues.append(SpecIssue(shown, nearest(lines, ("extends",)) or 1, "extends", message))
    return []


def merge(
    dst: dict[str, Any], provenance: Provenance, src: dict[str, Any], src_origins: Provenance, prefix: Loc
) -> None:
    """Deep-merge a copy of ``src`` into ``dst`` in place (tables merge, other values replace), recording origins."""
    for key, value in src.items():
        loc = (*prefix, key)
        if isinstance(value, dict) and isinstance(dst.get(key), dict):
            merge(dst[key], provenance, value, {}, loc)
        else:
            forget(provenance, loc)
            dst[key] = copy.deepcopy(value)
    provenance.update(src_origins)


def forget(provenance: Provenance, loc: Loc) -> None:
    """Drop the origins of ``loc`` and every key below it (they are about to be replaced)."""
    for known in [k for k in provenance if k[: len(loc)] == loc]:
        del provenance[known]


def folder_problem(folder: Path) -> str | None:
    """What stands in the way of creating files in ``folder`` (creating it when missing), or ``None``.

    A probe folder is made and removed in the nearest existing ancestor (``os.access`` says yes to root for ``/proc``).
    """
    existing = folder
    while not existing.exists():
        if existing.parent == existing:
            break
        existing = existing.parent
    if not existing.is_dir():
        return f"{existing} is a file, not a folder"
    try:
        probe = tempfile.mkdtemp(prefix=".runner-probe-", dir=existing)
    except OSError as exc:
        return f"{existing} does not let a folder be created in it ({exc.strerror or exc})"
    os.rmdir(probe)
    return None


# ----------------------------------------------------------------------------- --set and --unset

ORIGIN = "--set"
UNSET = "--unset"


class FlagOverride(str):
    """A ``--set`` text made by a shorthand flag (``--nproc-per-node 2``); messages name the flag as typed."""

    option: str
    typed: str

    def __new__(cls, text: str, option: str, typed: str) -> FlagOverride:
        self = super().__new__(cls, text)
        self.option = option
        self.typed = typed
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
        known = sorted({key for key, _, _ in schema_fields()} | set(_tree_keys(tree.data)))
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

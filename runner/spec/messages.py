"""Where each key of a spec file is written (its line) and pydantic's errors worded at those keys (``got X; expected
Y (hint)``).

A bad spec must be fixable from the message alone: ``FILE:LINE: key: what was got; what was expected``, with a
did-you-mean for a misspelt key, whatever the layer that found the problem.
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import json
import re
import tomllib
import types
from collections.abc import Iterable, Mapping, Sequence
from typing import Annotated, Any, TypeVar, Union, get_args, get_origin

from pydantic import BaseModel, TypeAdapter, ValidationError
from pydantic.fields import FieldInfo

from runner.errors import did_you_mean, join_or, show, suggest, with_hint
from runner.spec.names import MOVED
from runner.spec.rules import CrossFieldError
from runner.spec.schema import ExperimentSpec


def annotation_at(loc: Sequence[str | int]) -> Any:
    """Return the schema type at ``loc`` (Optional unwrapped), or ``None`` if the schema has no such key."""
    return _walk(tuple(loc))[2]


def explain_errors(errors: Iterable[Mapping[str, Any]]) -> list[tuple[Loc, str]]:
    """One ``(key path, message)`` per pydantic error of :class:`ExperimentSpec`, in order: ``got X; expected Y
    (hint)``, with a did-you-mean for unknown keys and choices, and union alternatives folded into one."""
    out: list[tuple[Loc, str]] = []
    unions: dict[Loc, list[tuple[Loc, Mapping[str, Any]]]] = {}
    for err in errors:
        clean, union_at, _ = _walk(tuple(err["loc"]))
        if union_at is None:
            out += _explain(clean, err)
        else:
            if union_at not in unions:
                out.append((union_at, ""))  # placeholder keeps the order
            unions.setdefault(union_at, []).append((clean, err))
    final: list[tuple[Loc, str]] = []
    for loc, message in out:
        if message or loc not in unions:
            final.append((loc, message))
            continue
        group = unions.pop(loc)
        deeper = [(c, e) for c, e in group if len(c) > len(loc)]
        if deeper:
            for c, e in deeper:
                final += _explain(c, e)
        else:
            final.append((loc, _explain_union([e for _, e in group])))
    return final


def _walk(loc: Loc) -> tuple[Loc, Loc | None, Any]:
    """Follow ``loc`` through the schema: (loc without union tags, where a union was, type at the end)."""
    ann: Any = ExperimentSpec
    clean: list[str | int] = []
    union_at: Loc | None = None
    for part in loc:
        ann = unwrap_optional(ann)
        if get_origin(ann) in (Union, types.UnionType):
            union_at, ann = tuple(clean), None  # this part is pydantic's tag of a union member
            continue
        clean.append(part)
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            field = ann.model_fields.get(part) if isinstance(part, str) else None
            ann = field.annotation if field else None
        elif get_origin(ann) is dict:
            ann = get_args(ann)[1]
        elif get_origin(ann) is list:
            ann = get_args(ann)[0]
        else:
            ann = None
    return tuple(clean), union_at, unwrap_optional(ann)


def unwrap_optional(ann: Any) -> Any:
    """``X`` for ``X | None`` (and for ``Annotated[X, ...]``); any other annotation unchanged."""
    if get_origin(ann) is Annotated:  # a type with its own validator, e.g. a [metrics] entry
        ann = get_args(ann)[0]
    if get_origin(ann) in (Union, types.UnionType):
        args = [a for a in get_args(ann) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return ann


@functools.cache
def schema_fields() -> tuple[tuple[str, FieldInfo, bool], ...]:
    """``(dotted key, field, is a table)`` of every key of the spec schema, each table before its keys."""
    found: list[tuple[str, FieldInfo, bool]] = []

    def walk(model: type[BaseModel], prefix: str) -> None:
        for name, field in model.model_fields.items():
            ann = unwrap_optional(field.annotation)
            table = isinstance(ann, type) and issubclass(ann, BaseModel)
            found.append((prefix + name, field, table))
            if table:
                walk(ann, f"{prefix}{name}.")

    walk(ExperimentSpec, "")
    return tuple(found)


def _elsewhere(key: str) -> list[str]:
    """Dotted keys of tables that have a field called ``key``."""
    return [k for k, _, table in schema_fields() if not table and k.endswith(f".{key}")]


def _choices(expected: str) -> list[str]:
    return re.findall(r"'((?:[^'\\]|\\.)*)'", expected)


def _explain(loc: Loc, err: Mapping[str, Any]) -> list[tuple[Loc, str]]:
    """Message(s) for one non-union pydantic error at ``loc``."""
    kind = err["type"]
    if kind in ("value_error", "assertion_error"):
        exc = (err.get("ctx") or {}).get("error")
        if isinstance(exc, CrossFieldError):
            return [(tuple(key.split(".")), message) for key, message in exc.problems]
        message = str(exc) if exc is not None else err["msg"].removeprefix("Value error, ")
        return [(_subject(loc, message), message)]
    if kind == "extra_forbidden":
        return [(loc, _unknown_key(loc))]
    if kind == "missing":
        return [(loc, _missing(loc))]
    return [(loc, _wrong_value(loc, err))]


def _unknown_key(loc: Loc) -> str:
    """``got unknown key "x"; expected a key of [t]: a, b (did you mean "a"?)``, or the table that has it."""
    parent = annotation_at(loc[:-1])
    known = list(parent.model_fields) if isinstance(parent, type) and issubclass(parent, BaseModel) else []
    hint = MOVED.get(tuple(loc)) or did_you_mean(loc[-1], known)
    where = f"a key of [{format_key(loc[:-1])}]" if loc[:-1] else "a top-level key"
    if not hint and (other := _elsewhere(str(loc[-1]))):
        hint = suggest(other, render=str)
    return with_hint(f"got unknown key {show(str(loc[-1]))}; expected {where}: {', '.join(known)}", hint)


def _wrong_value(loc: Loc, err: Mapping[str, Any]) -> str:
    """``got X; expected Y (hint)`` for a value of the wrong kind, outside its range, or not a choice."""
    kind, value, ctx = err["type"], err.get("input"), err.get("ctx") or {}
    got = f"got {show(value)}"
    if kind == "literal_error":
        choices = _choices(ctx.get("expected", ""))
        return with_hint(f"{got}; expected {join_or([show(c) for c in choices])}", did_you_mean(value, choices))
    if kind in ("dict_type", "model_type"):
        name = format_key(loc)
        return f"{got}; expected a table (write [{name}] with its keys, or {name} = {{ ... }})"
    wrong_type = _wrong_type(kind, value)
    if wrong_type is not None:
        expected, hint = wrong_type
        return with_hint(f"{got}; expected {expected}", hint)
    bound = (_between(loc, ctx) if kind in _BOUNDS else None) or _out_of_range(kind, ctx)
    if bound is not None:
        field = _field_at(loc)  # None: a list item or an unknown key, which counts as required
        optional = value == "" and field is not None and not field.is_required()
        return with_hint(f"{got}; expected {bound}", "remove the key for its default" if optional else "")
    return f"{got}; " + err["msg"].replace("Input should be", "expected").lower()


def value_problem(value: Any, expected: Any) -> str | None:
    """``got X; expected Y (hint)`` when a TOML value is of another kind than annotation ``expected`` (pydantic's
    strict validation); ``None`` when it fits, or when only a check TOML cannot pass fails (a tuple, a class)."""
    try:
        TypeAdapter(expected).validate_python(value, strict=True)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        if not all(e["type"] in _TOML_KINDS for e in errors):
            return None
        if len(errors) > 1:
            return _explain_union(errors)
        item = format_key(errors[0]["loc"])
        return (f"{item}: " if item else "") + _wrong_value(errors[0]["loc"], errors[0])
    except Exception:  # an annotation pydantic cannot build a validator for: the call decides
        return None
    return None


_TOML_KINDS = frozenset(
    {"int_type", "float_type", "bool_type", "string_type", "list_type", "literal_error", "none_required"}
)


def _wrong_type(kind: str, value: Any) -> tuple[str, str] | None:
    """``(what was expected, hint)`` for a type error, or ``None`` when ``kind`` is not one."""
    if kind in ("int_type", "int_from_float", "int_parsing"):
        hint = ""
        if isinstance(value, float) and not isinstance(value, bool):
            hint = f"counts are whole numbers: write {int(value)}" if value.is_integer() else "counts are whole numbers"
        return "a whole number", hint or _type_hint(value)
    if kind in ("float_type", "float_parsing"):
        return "a number", _type_hint(value)
    if kind in ("bool_type", "bool_parsing"):
        return "true or false", "write true/false" if isinstance(value, (int, float)) else _type_hint(value)
    if kind == "string_type":
        return "a string", f"quote it: {show(show(value))}" if isinstance(value, (int, float, bool)) else ""
    if kind == "list_type":
        return "a list", f"write [{show(value)}]" if not isinstance(value, dict) else ""
    return None


_BOUNDS = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<", "less_than_equal": "<="}


def _out_of_range(kind: str, ctx: Mapping[str, Any]) -> str | None:
    """What was expected of a value outside its bound or length, or ``None`` when ``kind`` is not one."""
    if kind in _BOUNDS:
        limit = next(iter(ctx.values()), "?")
        return f"a value {_BOUNDS[kind]} {_number(limit)}"
    what = "character" if kind.startswith("string_") else "item"
    if kind in ("too_short", "string_too_short"):
        n = ctx.get("min_length", 1)
        return f"at least {n} {what}{'s' if n != 1 else ''}"
    if kind in ("too_long", "string_too_long"):
        n = ctx.get("max_length", 0)
        return f"at most {n} {what}{'s' if n != 1 else ''}"
    return None


def _between(loc: Loc, ctx: Mapping[str, Any]) -> str | None:
    """Both bounds of the field at ``loc`` (``a value >= 0 and < 2**63``); ``None`` for one bound or a list item."""
    field = _field_at(loc)
    if field is None:  # a list item: pydantic's context names the one bound it broke
        return None
    words = {"gt": ">", "ge": ">=", "lt": "<", "le": "<="}
    as_float = isinstance(next(iter(ctx.values()), None), float)
    parts = [
        f"{words[name]} {_number(float(limit) if as_float else limit)}"
        for m in field.metadata
        for name in words
        if (limit := getattr(m, name, None)) is not None
    ]
    return f"a value {' and '.join(parts)}" if len(parts) > 1 else None


def _field_at(loc: Loc) -> FieldInfo | None:
    """The schema field of the key at ``loc``; ``None`` for a list item or an unknown key."""
    parent = annotation_at(loc[:-1])
    return parent.model_fields.get(loc[-1]) if isinstance(parent, type) and issubclass(parent, BaseModel) else None


def _number(limit: Any) -> str:
    """``show(limit)``, with ``(2**N)`` after a large power of two."""
    if isinstance(limit, int) and limit >= 2**16 and limit & (limit - 1) == 0:
        return f"{limit} (2**{limit.bit_length() - 1})"
    return show(limit)


def _subject(loc: Loc, message: str) -> Loc:
    """The key a table rule's message starts with (:mod:`runner.spec.rules` names it first), else ``loc``."""
    table = annotation_at(loc)
    word = re.match(r"[A-Za-z_]\w*", message)
    if word and isinstance(table, type) and issubclass(table, BaseModel) and word.group() in table.model_fields:
        return (*loc, word.group())
    return loc


def _type_hint(value: Any) -> str:
    """Hint for a value of the wrong type: quoted numbers or booleans."""
    if isinstance(value, bool):
        return "a boolean is not a number"
    if isinstance(value, str):
        with contextlib.suppress(ValueError):
            float(value)
            return f"remove the quotes: write {value}"
        if value.lower() in ("true", "false"):
            return f"remove the quotes: write {value.lower()}"
    return ""


def _missing(loc: Loc) -> str:
    field = _field_at(loc)
    about = f"; {' '.join(field.description.split())}" if field is not None and field.description else ""
    target = annotation_at(loc)
    if isinstance(target, type) and issubclass(target, BaseModel):
        return f"required table is missing: add [{format_key(loc)}]{about}"
    where = f"under [{format_key(loc[:-1])}]" if loc[:-1] else "at the top, before any [table]"
    return f"required key is missing: add {loc[-1]} = ... {where}{about}"


def _explain_union(errors: Sequence[Mapping[str, Any]]) -> str:
    """One message for a value that matched none of the members of a union."""
    value = errors[0].get("input")
    expected: list[str] = []
    choices: list[str] = []
    for err in errors:
        if err["type"] == "literal_error":
            found = _choices((err.get("ctx") or {}).get("expected", ""))
            choices += found
            expected += [show(c) for c in found]
        else:  # a TOML kind: a string, a list, a table (pydantic's dictionary), ...
            kind = ("a table", "") if err["type"] == "dict_type" else _wrong_type(err["type"], value)
            expected.append(kind[0] if kind else err["msg"].replace("Input should be ", ""))
    hint = did_you_mean(value, choices) if isinstance(value, str) else ""
    return with_hint(f"got {show(value)}; expected {join_or(expected)}", hint)


Loc = tuple  # tuple[str | int, ...]: table keys are str, array indices are int
_T = TypeVar("_T")

_BARE = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-")
_TOKEN = re.compile(  # the strings first: a "#", "[" or "=" inside one is text
    r"""(?P<s>\"\"\"(?:[^\\]|\\.)*?\"{3,5}|'\'\'[\s\S]*?'{3,5}|"(?:[^"\\\n]|\\.)*"|'[^'\n]*')"""
    r"|(?P<c>#[^\n]*)|(?P<n>\n)|(?P<p>[\[\]{}=,.])|(?P<w>[^\s\[\]{}=,.#\"']+)"
)


def locate_keys(text: str) -> dict[Loc, int]:
    """Map every key path of a valid TOML text (tuples of keys and indices) to its 1-based line: headers, dotted and
    quoted keys, inline tables and array elements. Unexpected text ends the scan with what was found."""
    scanner = _Scanner(text)
    with contextlib.suppress(IndexError, ValueError):
        scanner.document()
    return scanner.lines


def nested_beyond(text: str, limit: int) -> int | None:
    """The first line where ``[`` and ``{`` outside strings and comments nest beyond ``limit`` levels, or ``None``."""
    depth = 0
    for m in _TOKEN.finditer(text):
        depth += (m.group() in ("[", "{")) - (m.group() in ("]", "}"))
        if depth > limit:
            return text.count("\n", 0, m.start()) + 1
    return None


def nearest(found: Mapping[Loc, _T], loc: Sequence[str | int]) -> _T | None:
    """What ``found`` holds for key path ``loc`` (``("parallel", "mode")``), else for its nearest ancestor; or None."""
    loc = tuple(loc)
    return next((found[loc[:n]] for n in range(len(loc), 0, -1) if loc[:n] in found), None)


class _Scanner:
    """A forgiving reader of valid TOML's tokens that records the line of each key."""

    def __init__(self, text: str):
        self.tokens = [(m.lastgroup, m.group(), m.start()) for m in _TOKEN.finditer(text) if m.lastgroup != "c"]
        self.breaks = [m.start() for m in re.finditer("\n", text)]
        self.i = 0
        self.lines: dict[Loc, int] = {}
        self.array_tables: dict[Loc, int] = {}

    def at(self, *texts: str) -> bool:
        return self.i < len(self.tokens) and self.tokens[self.i][1] in texts

    def line(self) -> int:
        return bisect.bisect(self.breaks, self.tokens[self.i][2]) + 1

    def skip_lines(self) -> None:
        while self.at("\n"):
            self.i += 1

    def place(self, loc: Loc, line: int, overwrite: bool = True) -> None:
        if overwrite or loc not in self.lines:
            self.lines[loc] = line

    def document(self) -> None:
        table: Loc = ()
        self.skip_lines()
        while self.i < len(self.tokens):
            table = self.header() if self.at("[") else self.keyval(table)
            self.skip_lines()

    def header(self) -> Loc:
        line, start = self.line(), self.tokens[self.i][2]
        is_array = self.tokens[self.i + 1][1:] == ("[", start + 1)  # "[[", not "[ ["
        self.i += 1 + is_array
        key = self.key()
        self.i += 1 + is_array
        for n in range(1, len(key)):
            self.place(key[:n], line, overwrite=False)
        if is_array:
            self.array_tables[key] = index = self.array_tables.get(key, -1) + 1
            self.place(key, line, overwrite=False)
            key = (*key, index)
        self.place(key, line)
        return key

    def keyval(self, table: Loc) -> Loc:
        line = self.line()
        key = table + self.key()
        for n in range(len(table) + 1, len(key)):
            self.place(key[:n], line, overwrite=False)
        self.place(key, line)
        if not self.at("="):
            raise ValueError("expected '='")
        self.i += 1
        self.value(key)
        return table

    def key(self) -> Loc:
        parts: list[str] = []
        while True:
            kind, text, _ = self.tokens[self.i]
            if kind not in ("s", "w"):
                raise ValueError("expected a key")
            parts.append(tomllib.loads(f"k = {text}")["k"] if kind == "s" else text)
            self.i += 1
            if not self.at("."):
                return tuple(parts)
            self.i += 1

    def value(self, loc: Loc) -> None:
        """Skip one value, recording the lines of an array's elements and an inline table's keys."""
        if not self.at("[", "{"):
            start = self.i
            while self.i < len(self.tokens) and not self.at(",", "]", "}", "\n"):
                self.i += 1  # a scalar: its parts ("1", ".", "5") up to what ends it
            if start == self.i:
                raise ValueError("empty value")
            return
        close, index = "]" if self.at("[") else "}", 0
        self.i += 1
        self.skip_lines()
        while not self.at(close):
            if close == "]":
                self.place((*loc, index), self.line())
                self.value((*loc, index))
                index += 1
            else:
                self.keyval(loc)
            self.skip_lines()
            if self.at(","):
                self.i += 1
            self.skip_lines()
        self.i += 1


def format_key(loc: Sequence[str | int]) -> str:
    """Return the dotted key of a path: ``("devices", "ids", 1)`` -> ``devices.ids[1]``."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
            continue
        name = part if part and set(part) <= _BARE else json.dumps(part, ensure_ascii=False)
        out += f".{name}" if out else name
    return out

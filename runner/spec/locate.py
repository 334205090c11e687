"""Locate keys in TOML text: the line each key path is written on, and its dotted form.

The messages that explain validation errors at those keys live in :mod:`runner.spec.messages`.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Mapping, Sequence

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

Loc = tuple  # tuple[str | int, ...]: table keys are str, array indices are int

_BARE = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-")
_SCALAR_END = frozenset(",]}\n#")


def locate_keys(text: str) -> dict[Loc, int]:
    """Map every key path written in a TOML document to the 1-based line it is written on.

    Covers ``[table]`` and ``[[array]]`` headers, ``key = value`` lines, dotted keys
    (``a.b = 1`` also places ``a`` on that line unless it was placed before), quoted keys,
    keys of inline tables and elements of arrays (``("devices", "ids", 1)``). The text
    is assumed to be valid TOML (parse it with tomllib first); on anything unexpected
    the scan stops and returns what it has found so far.

    Returns:
        Dict from key path (tuple of str keys and int array indices) to line number.
    """
    scanner = _Scanner(text)
    with contextlib.suppress(IndexError, ValueError):
        scanner.document()
    return scanner.lines


def line_of(lines: Mapping[Loc, int], loc: Sequence[str | int]) -> int:
    """Return the line of ``loc``, else of its nearest located ancestor, else 1.

    Args:
        loc: Key path, e.g. ``("parallel", "mode")``.

    Returns:
        A 1-based line number.
    """
    loc = tuple(loc)
    for n in range(len(loc), 0, -1):
        if loc[:n] in lines:
            return lines[loc[:n]]
    return 1


class _Scanner:
    """A forgiving, position-tracking reader of valid TOML that records where keys are."""

    def __init__(self, text: str):
        self.s = text
        self.i = 0
        self.line = 1
        self.lines: dict[Loc, int] = {}
        self.array_tables: dict[Loc, int] = {}

    # -- low level
    def peek(self, n: int = 1) -> str:
        return self.s[self.i : self.i + n]

    def advance(self, n: int = 1) -> None:
        self.line += self.s.count("\n", self.i, self.i + n)
        self.i += n

    def skip_blank(self, newlines: bool) -> None:
        """Skip spaces and tabs (and newlines and comments when ``newlines``)."""
        while self.i < len(self.s):
            c = self.s[self.i]
            if c in " \t\r" or (newlines and c == "\n"):
                self.advance()
            elif c == "#" and newlines:
                end = self.s.find("\n", self.i)
                self.advance((len(self.s) if end < 0 else end) - self.i)
            else:
                return

    def place(self, loc: Loc, line: int, overwrite: bool = True) -> None:
        if overwrite or loc not in self.lines:
            self.lines[loc] = line

    # -- grammar
    def document(self) -> None:
        table: Loc = ()
        while True:
            self.skip_blank(newlines=True)
            if self.i >= len(self.s):
                return
            if self.peek() == "[":
                table = self.header()
            else:
                self.keyval(table)
            self.skip_blank(newlines=False)
            if self.peek() == "#":
                self.skip_blank(newlines=True)

    def header(self) -> Loc:
        is_array = self.peek(2) == "[["
        self.advance(2 if is_array else 1)
        line = self.line
        key = self.key()
        self.skip_blank(newlines=False)
        self.advance(2 if is_array else 1)
        for n in range(1, len(key)):
            self.place(key[:n], line, overwrite=False)
        if is_array:
            index = self.array_tables.get(key, -1) + 1
            self.array_tables[key] = index
            self.place(key, line, overwrite=False)
            key = (*key, index)
        self.place(key, line)
        return key

    def keyval(self, table: Loc) -> None:
        line = self.line
        key = table + self.key()
        for n in range(len(table) + 1, len(key)):
            self.place(key[:n], line, overwrite=False)
        self.place(key, line)
        self.skip_blank(newlines=False)
        if self.peek() != "=":
            raise ValueError("expected '='")
        self.advance()
        self.skip_blank(newlines=False)
        self.value(key)

    def key(self) -> Loc:
        parts: list[str] = []
        while True:
            self.skip_blank(newlines=False)
            c = self.peek()
            if c in ('"', "'"):
                start = self.i
                self.string()
                parts.append(tomllib.loads(f"k = {self.s[start : self.i]}")["k"])
            else:
                start = self.i
                while self.i < len(self.s) and self.s[self.i] in _BARE:
                    self.i += 1
                if start == self.i:
                    raise ValueError("empty key")
                parts.append(self.s[start : self.i])
            self.skip_blank(newlines=False)
            if self.peek() != ".":
                return tuple(parts)
            self.advance()

    def string(self) -> None:
        quote = self.peek()
        if self.peek(3) == quote * 3:
            self.advance(3)
            end = self._find_close(quote * 3, escapes=quote == '"')
            self.advance(end + 3 - self.i)
            while self.peek() == quote:  # up to two quotes may end the content
                self.advance()
            return
        self.advance()
        end = self._find_close(quote, escapes=quote == '"')
        self.advance(end + 1 - self.i)

    def _find_close(self, delim: str, escapes: bool) -> int:
        j = self.i
        while True:
            if escapes and self.s[j] == "\\":
                j += 2
                continue
            if self.s.startswith(delim, j):
                return j
            if j >= len(self.s):
                raise ValueError("unterminated string")
            j += 1

    def value(self, loc: Loc) -> None:
        c = self.peek()
        if c in ('"', "'"):
            self.string()
        elif c == "[":
            self.advance()
            index = 0
            while True:
                self.skip_blank(newlines=True)
                if self.peek() == "]":
                    self.advance()
                    return
                self.place((*loc, index), self.line)
                self.value((*loc, index))
                index += 1
                self.skip_blank(newlines=True)
                if self.peek() == ",":
                    self.advance()
        elif c == "{":
            self.advance()
            while True:
                self.skip_blank(newlines=True)
                if self.peek() == "}":
                    self.advance()
                    return
                self.keyval(loc)
                self.skip_blank(newlines=True)
                if self.peek() == ",":
                    self.advance()
        else:
            start = self.i
            while self.i < len(self.s) and self.s[self.i] not in _SCALAR_END:
                self.i += 1
            if start == self.i:
                raise ValueError("empty value")


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

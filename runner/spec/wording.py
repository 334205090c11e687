"""How values, choices and hints are written in every spec message: TOML values, "a, b or c", "message (hint)".

And did-you-mean suggestions, matched and worded the same everywhere: ``(did you mean "x"?)``.
"""

from __future__ import annotations

import difflib
import json
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any


def show(value: Any, limit: int = 60) -> str:
    """Render a value as it would be written in TOML (shortened to about ``limit`` characters).

    Args:
        value: Any parsed TOML value (or a Python value of the same kinds).
        limit: Longest text returned; longer renderings end in ``...``.

    Returns:
        ``true``, ``"text"``, ``[1, 2]``, ``{ a = 1 }``, ``nan``, ...
    """
    if isinstance(value, bool):
        text = "true" if value else "false"
    elif isinstance(value, str):
        text = json.dumps(value, ensure_ascii=False)
    elif isinstance(value, float) and not math.isfinite(value):
        text = "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    elif isinstance(value, (list, tuple)):
        text = "[" + ", ".join(show(v, limit) for v in value) + "]"
    elif isinstance(value, dict):
        text = "{ " + ", ".join(f"{k} = {show(v, limit)}" for k, v in value.items()) + " }" if value else "{}"
    else:
        text = str(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def join_or(parts: Sequence[str]) -> str:
    """Return ``a``, ``a or b``, ``a, b or c`` for one, two, three or more parts."""
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " or " + parts[-1]


def with_hint(message: str, hint: str) -> str:
    """Return ``message (hint)``, or ``message`` alone when ``hint`` is empty."""
    return f"{message} ({hint})" if hint else message


CUTOFF = 0.6  # difflib.get_close_matches' default similarity bound


def close_matches(word: str, choices: Iterable[str] | Mapping[str, str], n: int = 1) -> list[str]:
    """Return up to ``n`` choices close to ``word``, ignoring case; an exact match ignoring case comes alone.

    Args:
        choices: The valid names; or a mapping from the text to match against to the name to
            suggest (e.g. ``{"resnet18": "torchvision.resnet18"}`` to match bare builder names).

    Returns:
        The suggested names, closest first (``difflib.get_close_matches`` with cutoff 0.6).
    """
    table = dict(choices) if isinstance(choices, Mapping) else {c: c for c in choices}
    lowered: dict[str, str] = {}
    for match_text, name in table.items():
        lowered.setdefault(match_text.lower(), name)
    word = word.lower()
    if word in lowered:
        return [lowered[word]]
    return [lowered[c] for c in difflib.get_close_matches(word, list(lowered), n=n, cutoff=CUTOFF)]


def suggest(candidates: Sequence[str], render: Callable[[str], str] = show) -> str:
    """Return ``did you mean "a" or "b"?`` for ``candidates`` (empty text when there are none).

    Args:
        render: How each is written: :func:`~runner.spec.wording.show` (quoted, the default) for
            names and values, ``str`` for dotted keys.
    """
    return f"did you mean {join_or([render(c) for c in candidates])}?" if candidates else ""


def did_you_mean(
    word: object,
    choices: Iterable[str] | Mapping[str, str],
    n: int = 1,
    render: Callable[[str], str] = show,
) -> str:
    """Return ``did you mean "x"?`` for the choices closest to ``word``, or empty text.

    Put it in a message with :func:`~runner.spec.wording.with_hint`: ``unknown key "mdoe"
    (did you mean "mode"?)``.

    Args:
        word: What the user wrote (non-strings are compared as ``str(word)``).
        choices: Valid names, or a mapping as in :func:`close_matches`.
        render: How each suggestion is written (see :func:`suggest`).
    """
    return suggest(close_matches(str(word), choices, n), render)

"""How values, choices and hints are written in every spec message: TOML values, "a, b or c", "message (hint)"."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
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

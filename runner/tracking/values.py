"""How values and names are written to MLflow: param strings, safe keys, length limits, batch sizes.

mlflow is imported inside functions, never when this module is imported.
"""

from __future__ import annotations

import json
import re
from typing import Any

PARAMS_PER_BATCH = 100  # MLflow's limit for params (and tags) in one log_batch request
METRICS_PER_BATCH = 1000  # MLflow's limit for metrics in one log_batch request
_BAD_KEY_CHARS = re.compile(r"[^/\w.\- :]")


def param_value(value: Any) -> str:
    """Render one flattened spec value as an MLflow param string, stably.

    ``True`` -> ``"true"``, ``1`` -> ``"1"``, ``1.0`` -> ``"1.0"`` (floats use ``repr``),
    lists and tables -> JSON, strings unchanged.

    Args:
        value: A JSON-able scalar, list or dict.
    """
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, (list, tuple, dict)):
        return json.dumps(value, default=str)
    return str(value)


def safe_key(key: str) -> str:
    """Replace the characters MLflow rejects in param, tag and metric names with ``_``.

    MLflow accepts letters, digits, ``_``, ``-``, ``.``, ``/``, spaces and ``:``
    (``mlflow.utils.validation``); ``model.kwargs.hidden|x`` becomes ``model.kwargs.hidden_x``.
    """
    return _BAD_KEY_CHARS.sub("_", key)


def shorten(text: str, limit: int, where: str) -> str:
    """Cut ``text`` to ``limit`` characters with a marker saying how long it was and where the rest is.

    Args:
        text: The value.
        limit: Most characters kept, marker included.
        where: Where the full text can be found, e.g. ``"artifact spec/resolved.toml"``.
    """
    if len(text) <= limit:
        return text
    marker = f"...[truncated from {len(text)} chars; full text in {where}]"
    return text[: max(0, limit - len(marker))] + marker


def max_tag_chars() -> int:
    """MLflow's limit on the length of a tag value (``MAX_TAG_VAL_LENGTH``, 8000 in MLflow 3)."""
    from mlflow.utils.validation import MAX_TAG_VAL_LENGTH

    return int(MAX_TAG_VAL_LENGTH)


def max_param_chars() -> int:
    """MLflow's limit on the length of a param value (``MAX_PARAM_VAL_LENGTH``, 6000 in MLflow 3)."""
    from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH

    return int(MAX_PARAM_VAL_LENGTH)

"""The base of every spec table: strict, finite, no unknown keys, frozen, with its cross-key rule.

The conventions every table of the spec keeps (docs/design.md): counts are strict integers
(``2.0`` is rejected); hyperparameters are floats (``lr = 1`` is stored as ``1.0``); booleans are
strict (``1`` is not ``true``); every number is finite (``inf`` and ``nan`` are rejected); unknown
keys are rejected; a validated table is frozen. Integers that reach torch or NumPy as C integers are
bounded by what those take: :data:`INT64_LIMIT` (``torch.manual_seed``, ``torch.Generator``, tensor
sizes) and :data:`UINT32_LIMIT` (NumPy's legacy ``RandomState``, which seeds Optuna's samplers).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, model_validator

INT64_LIMIT = 2**63
"""Exclusive upper bound of a seed or size passed to torch as a C ``int64`` (``seed + epoch`` stays below ``2**64``)."""
UINT32_LIMIT = 2**32
"""Exclusive upper bound of a seed passed to ``numpy.random.RandomState`` (Optuna's samplers)."""


class SpecTable(BaseModel):
    """Base of every spec table: strict, finite, no unknown keys, frozen; ``rule`` runs once its keys are valid."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, validate_default=True, allow_inf_nan=False)
    rule: ClassVar[Callable[[Any], None] | None] = None  # a runner.spec.rules check_* of this table

    @model_validator(mode="after")
    def _check_rule(self) -> SpecTable:
        rule = type(self).rule
        if rule is not None:
            rule(self)
        return self

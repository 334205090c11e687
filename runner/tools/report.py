"""What ``runner sweep`` and ``runner bench`` print: their report as a table or JSON, and whether part of it failed."""

from __future__ import annotations

import json
import sys
from typing import Any, Protocol

from runner.errors import mask_secrets


class ToolReport(Protocol):
    """A sweep's or a bench's report: a table, its JSON, and how many parts (trials, configurations) failed."""

    @property
    def failed(self) -> int: ...

    def table(self) -> str: ...

    def to_json(self) -> dict[str, Any]: ...


def print_report(report: ToolReport, *, as_json: bool, failure: str) -> bool:
    """Print ``report`` as a table (or JSON); when part of it failed, say ``failure`` on standard error.

    Returns:
        Whether part of the report failed (the command then exits 1).
    """
    print(mask_secrets(json.dumps(report.to_json(), indent=2) if as_json else report.table()))
    if report.failed:
        print(f"runner: {mask_secrets(failure)}", file=sys.stderr)
        return True
    return False

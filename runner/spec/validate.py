"""``runner validate``: check spec files one by one (with the specs that extend them) and report each.

Every file is checked, so one call reports all bad files: ``ok FILE`` or ``error FILE`` on
standard output, each problem (``FILE:LINE: dotted.key: ...``) indented on standard error.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from runner.errors import SpecError
from runner.spec.loading import load_spec

EXIT_OK = 0


def validate_files(files: Sequence[str], dependents_in: Sequence[str] = ()) -> int:
    """Validate ``files``; a file extended by specs under ``dependents_in`` is checked through them.

    Args:
        files: Spec files as named on the command line.
        dependents_in: Folders whose specs are also checked when their ``extends`` chain reaches a
            file of ``files`` (:func:`runner.spec.dependents.plan_validation`); empty: ``files`` alone.

    Returns:
        The exit status: 0 when every file is valid, else the ``exit_code`` of :class:`SpecError` (2).
    """
    checked: list[str | Path] = list(files)
    if dependents_in:
        from runner.spec.dependents import plan_validation

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
            print(_indent(str(exc)), file=sys.stderr)
    return status


def _indent(text: str) -> str:
    return "\n".join("  " + line for line in text.splitlines())

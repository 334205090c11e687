"""Folders a spec names, checked on this machine before anything is written: can runner create files there?

Kept out of validation (``runner validate`` answers the same on any machine); the driver asks
:func:`folder_problem` about ``checkpoint.dir`` before the run exists (docs/design.md §1).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def folder_problem(folder: Path) -> str | None:
    """Why runner could not create files in ``folder`` (creating it first when missing), or ``None``.

    The nearest existing ancestor must be a folder in which a file can be made: a probe folder is
    created there and removed at once (``os.access`` says yes to root for ``/proc``, where nothing
    can be created). Nothing is left behind.

    Args:
        folder: An absolute folder, which need not exist.

    Returns:
        ``None`` when files can be created there, else what stands in the way, e.g.
        ``/proc does not let a folder be created in it (No such file or directory)``.
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

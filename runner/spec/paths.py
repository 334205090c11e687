"""Folders a spec names, checked on this machine before anything is written: can runner create files there?

Kept out of validation (``runner validate`` answers the same on any machine); the driver asks
:func:`folder_problem` about ``checkpoint.dir`` before the run exists (docs/design.md §1).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from urllib.parse import urlparse


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


def default_checkpoint_dir(tracking_uri: str | None, spec_dir: str | None, run_key: str) -> Path:
    """Folder for one run's checkpoints.

    Args:
        tracking_uri: The MLflow tracking URI; for a ``sqlite:///`` or file store the folder
            sits next to it (``<store dir>/checkpoints/<run_key>``), otherwise in the working
            directory.
        spec_dir: ``checkpoint.dir`` from the spec (absolute), which replaces the base folder.
        run_key: The MLflow run id (or a local id when tracking is off).

    Returns:
        An absolute path (not created).
    """
    if spec_dir:
        return Path(spec_dir) / run_key
    base = Path.cwd()
    if tracking_uri:
        parsed = urlparse(tracking_uri)
        if parsed.scheme == "sqlite":
            base = Path(tracking_uri[len("sqlite:///") :]).parent
        elif parsed.scheme in ("", "file"):
            base = Path(parsed.path).parent
    return (base / "checkpoints" / run_key).resolve()

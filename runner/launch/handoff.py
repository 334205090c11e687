"""A ddp job's run, made by the driver while its workers start, and handed to them in a file.

Under ``runner exec`` with ``mode = "ddp"`` the driver starts the workers first and, on a thread of
its own, checks the spec's parts, opens the store and creates (or reopens) the run (docs/design.md
§6): the workers import torch and build their parts meanwhile, then wait for the file
:data:`RUN_FILE` in the launcher's folder. It holds the run id, the checkpoint folder and whether
to resume; or ``{"abort": true}`` when the driver's checks failed, and the workers then end
without training (the driver reports the error, exit 2, and no run exists). The file is written
once, atomically (a rename), so a worker never reads half of it.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from runner.launch.worker import WorkerArgs

RUN_FILE = "run.json"
POLL_S = 0.02


class Cancelled(Exception):
    """The launch ended before the driver's preparation created the run: it creates none."""


@dataclass(frozen=True)
class HandedRun:
    """What a worker learns from the driver once the run exists.

    Attributes:
        run_id: The run to log to, or ``None`` (tracking off, or another node's driver owns it).
        checkpoint_dir: The folder of the run's checkpoints.
        resume: Load the newest valid checkpoint of ``checkpoint_dir`` before training.
    """

    run_id: str | None
    checkpoint_dir: str
    resume: bool


class Handoff:
    """Runs the driver's preparation on a thread while the workers start; writes its outcome to ``path``.

    Args:
        prepare: Called on the thread as ``prepare(go_on)``; returns the workers' arguments once
            the run exists. It calls ``go_on()`` just before it creates the run, which raises
            :class:`Cancelled` once :meth:`finish` was called (the launch already ended).
    """

    def __init__(self, prepare: Callable[[Callable[[], None]], WorkerArgs]) -> None:
        self._prepare = prepare
        self._cancelled = threading.Event()
        self._thread: threading.Thread | None = None
        self.args: WorkerArgs | None = None
        self.error: BaseException | None = None

    def start(self, path: Path) -> None:
        """Start the preparation; the workers read its outcome from ``path``."""
        self._thread = threading.Thread(target=self._run, args=(path,), name="runner-prepare", daemon=True)
        self._thread.start()

    def finish(self) -> WorkerArgs | None:
        """Wait for the preparation; a run it has not created yet is not created. Returns its arguments, if any."""
        self._cancelled.set()
        if self._thread is not None:
            self._thread.join()
        return self.args

    def _go_on(self) -> None:
        if self._cancelled.is_set():
            raise Cancelled()

    def _run(self, path: Path) -> None:
        try:
            args = self._prepare(self._go_on)
            self.args = args
            content = {"run_id": args.run_id, "checkpoint_dir": args.checkpoint_dir, "resume": args.resume}
        except BaseException as exc:  # reported by the driver once the workers are gone
            self.error = exc
            content = {"abort": True}
        with contextlib.suppress(OSError):  # the launch already ended, its folder is gone: no worker waits
            write_run_file(path, content)


def write_run_file(path: Path, content: Mapping[str, object]) -> None:
    """Write ``content`` as JSON to ``path`` in one step (a rename of a file written beside it)."""
    part = path.with_name(f".{path.name}.{os.getpid()}")
    part.write_text(json.dumps(content), encoding="utf-8")
    os.replace(part, path)


def wait_for_run(path: str | os.PathLike[str]) -> HandedRun | None:
    """On a worker: wait for the driver's run file; the run, or ``None`` when the driver's checks failed.

    The wait has no time limit: a worker whose driver dies is killed with it
    (:func:`runner.launch.watch.die_with_parent`).
    """
    file = Path(path)
    while not file.is_file():
        time.sleep(POLL_S)
    data = json.loads(file.read_text(encoding="utf-8"))
    if data.get("abort"):
        return None
    return HandedRun(data["run_id"], str(data["checkpoint_dir"]), bool(data["resume"]))

"""Who owns a run: the process recorded on it (host, pid, start time), whether it still lives, ending orphaned runs.

The driver records itself on the run it creates or reopens (docs/design.md §12): tags
``runner.owner.host``, ``runner.owner.pid`` and ``runner.owner.start_time`` (seconds since the
epoch, as ``psutil.Process.create_time`` gives it, so a pid reused by another process is told
apart). A run that is RUNNING while its owner is gone was left behind by a driver killed hard (or a
machine that stopped): :func:`settle` marks it KILLED. On another host the owner cannot be checked;
that is said, and nothing is changed. When no live process uses it, what the run's spool kept while
the tracking store was away (tag ``runner.checkpoint_dir`` says where) is sent first, and a final
status kept there is applied instead of KILLED.
"""

from __future__ import annotations

import os
import shlex
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from runner.errors import UsageError

if TYPE_CHECKING:  # pragma: no cover
    from runner.tracking.spool import Sent

Liveness = Literal["alive", "gone", "unknown"]
TAGS = ("runner.owner.host", "runner.owner.pid", "runner.owner.start_time")
_SAME_START_S = 0.5  # create times of one process agree to the clock tick; a reused pid differs by more


@dataclass(frozen=True)
class Owner:
    """The process that owns a run.

    Attributes:
        start_time: When it started, seconds since the epoch.
    """

    host: str
    pid: int
    start_time: float

    @classmethod
    def this_process(cls) -> Owner:
        """The calling process."""
        import psutil

        return cls(socket.gethostname(), os.getpid(), psutil.Process().create_time())

    @classmethod
    def from_tags(cls, tags: Mapping[str, str]) -> Owner | None:
        """The owner recorded in a run's tags, or ``None`` when there is none (runs made before owners were)."""
        try:
            return cls(tags[TAGS[0]], int(tags[TAGS[1]]), float(tags[TAGS[2]]))
        except (KeyError, ValueError):
            return None

    def tags(self) -> dict[str, str]:
        """The run tags that record this owner."""
        return dict(zip(TAGS, (self.host, str(self.pid), f"{self.start_time:.2f}"), strict=True))

    def liveness(self) -> Liveness:
        """``alive``; ``gone`` (no such process, a zombie, another process under the pid); ``unknown`` (other host)."""
        if self.host != socket.gethostname():
            return "unknown"
        import psutil

        try:
            process = psutil.Process(self.pid)
            if process.status() == psutil.STATUS_ZOMBIE:
                return "gone"
            started = process.create_time()
        except psutil.NoSuchProcess:
            return "gone"
        except psutil.Error:  # AccessDenied: another user's process still exists
            return "alive"
        return "alive" if abs(started - self.start_time) <= _SAME_START_S else "gone"

    def describe(self) -> str:
        """``pid 123 on host node1``."""
        return f"pid {self.pid} on host {self.host}"


@dataclass(frozen=True)
class Settled:
    """A run after :func:`settle`.

    Attributes:
        status: Its MLflow status now (``KILLED`` when it was just marked so).
        owner: The recorded owner, or ``None``.
        liveness: The owner's liveness (``unknown`` without an owner).
        marked_killed: Whether :func:`settle` ended the run.
        uri: The run's store, for the command that continues it.
        sent: What :func:`settle` sent from the run's spool, or ``None``.
    """

    run_id: str
    status: str
    owner: Owner | None
    liveness: Liveness
    marked_killed: bool = False
    uri: str = ""
    sent: Sent | None = None

    def line(self) -> str:
        """What ``runner status`` prints about the run."""
        return self._state() + (self._sent() if self.sent is not None else "")

    def _sent(self) -> str:
        assert self.sent is not None
        ended = f", and its final status {self.sent.ended}" if self.sent.ended else ""
        return f"; sent the {self.sent.metrics} metric values its spool kept{ended}"

    def _state(self) -> str:
        who = self.owner.describe() if self.owner else "no owner recorded"
        if self.marked_killed:
            return (
                f"{self.run_id}  KILLED   its owner ({who}) is gone and never ended it: marked KILLED; "
                f"continue it with: {resume_command(self.run_id, self.uri)}"
            )
        if self.status != "RUNNING":
            return f"{self.run_id}  {self.status:<8} ({who})"
        state = {
            "alive": "owner alive",
            "gone": "owner gone",
            "unknown": "on another host: this host cannot tell whether it is alive",
        }[self.liveness]
        if self.owner is None:
            state = "no owner recorded: cannot tell whether it is alive"
        return f"{self.run_id}  RUNNING  {who}, {state}"


def settle(uri: str, run_id: str) -> Settled:
    """Check the owner of a run and mark the run KILLED when it is RUNNING and its owner is gone on this host.

    Raises:
        UsageError: No such run.
        TrackingError: MLflow rejects a request.
    """
    from runner.tracking import runs as tracking
    from runner.tracking.stored import run_info

    info = run_info(uri, run_id)
    owner = Owner.from_tags(info.tags)
    liveness: Liveness = owner.liveness() if owner is not None else "unknown"
    sent = None
    if info.status != "RUNNING" or (owner is not None and liveness == "gone"):  # no live process uses the spool
        sent = _send_spool(uri, run_id, info.tags)
        if sent is not None and sent.ended:
            return Settled(run_id, sent.ended, owner, liveness, uri=uri, sent=sent)
    if info.status != "RUNNING" or liveness != "gone" or owner is None:
        return Settled(run_id, info.status, owner, liveness, uri=uri, sent=sent)
    error = (
        f"the run's owner ({owner.describe()}) is gone and never ended the run (it was killed hard, or its "
        "machine stopped); marked KILLED by runner"
    )
    tracking.end_run(uri, run_id, "KILLED", error)
    return Settled(run_id, "KILLED", owner, liveness, marked_killed=True, uri=uri, sent=sent)


def _send_spool(uri: str, run_id: str, tags: Mapping[str, str]) -> Sent | None:
    """Send what the run's spool kept (its folder is tag ``runner.checkpoint_dir``), or ``None`` without one."""
    from runner.tracking.spool import send_spool, spool_path

    folder = tags.get("runner.checkpoint_dir")
    return send_spool(uri, run_id, spool_path(folder)) if folder else None


def status_lines(tracking_uri: str | None, run_id: str | None) -> list[str]:
    """What ``runner status`` prints: one run, or every RUNNING run of the store, after :func:`settle`.

    Args:
        tracking_uri: The store as given (``--tracking-uri``), or ``None`` for ``$MLFLOW_TRACKING_URI``,
            else ``./mlflow.db``.
        run_id: One run, or ``None`` for every RUNNING run.

    Raises:
        UsageError: No such run, or no store at the URI (a read-only command creates none).
        TrackingError: The store cannot be used.
    """
    from runner.tracking.stored import STORE_HINT, running_runs, store_uri
    from runner.tracking.uri import local_store_missing, open_store

    uri = store_uri(tracking_uri)
    if local_store_missing(uri):
        raise UsageError(f"no tracking store at {uri}: there are no runs to show; {STORE_HINT}")
    open_store(uri)
    if run_id is not None:
        return [settle(uri, run_id).line()]
    running = running_runs(uri)
    if not running:
        return [f"no RUNNING run at {uri}"]
    return [f"{settle(uri, info.run_id).line()}  [{info.experiment}]" for info in running]


def resume_command(run_id: str, uri: str, verb: str = "resume") -> str:
    """The command that continues ``run_id``, as printed when a run is interrupted.

    ``runner resume RUN_ID`` (or ``runner <verb> RUN_ID``), with ``--tracking-uri URI`` only when
    the command run from here would not look in ``uri`` by itself (a spec with ``tracking.uri``, say),
    so it works as printed.
    """
    from runner.tracking.uri import default_tracking_uri

    words = ["runner", verb, run_id]
    if uri != default_tracking_uri():
        words += ["--tracking-uri", uri]
    return shlex.join(words)

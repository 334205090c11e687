"""Why a launched job failed, in words: the rank's error, the signal or exit code that ended it, the OOM killer, a hang.

The elastic launcher reports a failed worker as a ``ProcessFailure`` (``exitcode``, the error file
its ``@record`` wrote, ``timestamp``); a worker killed hard leaves no error file, only its exit code,
``-N`` for signal ``N``. This module turns that into one sentence for the run's ``runner.error`` tag
and the command line: ``rank 1 was killed by signal 9 (SIGKILL, exit code -9) ...``. It also keeps the
launcher's own log lines about a collective timeout off the terminal, where they would repeat a torch
traceback that the sentence already explains. torch is not imported here.
"""

from __future__ import annotations

import json
import logging
import re
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from runner.errors import first_line

if TYPE_CHECKING:
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

COLLECTIVE_TIMEOUT = re.compile(
    r"Timed out waiting \d+ ?ms|collective operation timeout|Watchdog caught|DistBackendError.*timed? ?out", re.I
)
HangReports = dict[int, dict[str, Any]]  # rank -> the JSON report its hang watch wrote (rank, where it was stuck)
HUNG_MARKER = "hung-rank-{rank}.json"  # written by a rank's hang watch (runner.launch.worker) before it ends
_LAUNCHER_LOGGERS = ("torch.distributed.elastic", "torch.multiprocessing")


@dataclass(frozen=True)
class JobContext:
    """What the driver knew about the job when it failed.

    Attributes:
        timeout_s: ``parallel.timeout_s``, seconds a collective waits before it fails.
        oom_kills_before: The OOM-kill count of this process's cgroup before the launch, or ``None``.
        hung: Hang reports of ranks that ended themselves (``{"rank", "where", "grace_s"}``), by rank.
    """

    timeout_s: float
    oom_kills_before: int | None = None
    hung: HangReports = field(default_factory=dict)


def describe_failure(exc: BaseException, context: JobContext) -> str:
    """One sentence for a failed job: the rank at the root of it and what ended it.

    Args:
        exc: What the launcher raised (``ChildFailedError`` with ``failures``) or any exception.
        context: See :class:`JobContext`.

    Returns:
        E.g. ``rank 1 was killed by signal 9 (SIGKILL, exit code -9); ...``, ``rank 1 hung: ...``,
        ``rank 0 failed: RuntimeError: ...``.
    """
    from runner.errors import TrainingError

    if isinstance(exc, TrainingError):  # runner's own words already name the cause and the fix
        return str(exc)
    failures: dict[int, Any] = getattr(exc, "failures", None) or {}
    if not failures:
        return f"{type(exc).__name__}: {first_line(exc)}"
    rank, failure = min(failures.items(), key=lambda item: (item[1].exitcode >= 0, item[1].timestamp, item[0]))
    error = python_error(failure)
    if error and COLLECTIVE_TIMEOUT.search(error):
        return _hung(rank, error, context)
    if error:
        return f"rank {rank} failed: {error}"
    return f"rank {rank} {ended_by(int(failure.exitcode), context.oom_kills_before)}"


def python_error(failure: ProcessFailure) -> str:
    """The Python error a failed rank recorded (``Type: message``), or ``""`` when it left none.

    The last line of its traceback; all of a runner error's message (a user-code error has several lines).
    """
    data = getattr(failure, "error_file_data", None) or {}
    inner = data.get("message", {}) if isinstance(data, dict) else {}
    if isinstance(inner, dict):
        trace = inner.get("extraInfo", {}).get("py_callstack", "")
        if trace.strip():
            lines = trace.strip().splitlines()
            own = max((i for i, x in enumerate(lines) if x.startswith("runner.errors.")), default=len(lines) - 1)
            text = "\n".join(lines[own:])
            return re.sub(r"^runner\.errors\.(TrainingError|UserCodeError): ", "", text)
        return str(inner.get("message", ""))
    text = str(inner)
    return "" if text == "<NONE>" else text


def ended_by(exitcode: int, oom_kills_before: int | None) -> str:
    """What ended a process that left no Python error: a signal (and whether the OOM killer sent it), or its exit code.

    Args:
        exitcode: The process's exit code; ``-N`` means it was killed by signal ``N``.
        oom_kills_before: :func:`oom_kill_count` before the job started, to tell an OOM kill.
    """
    if exitcode >= 0:
        return (
            f"exited with code {exitcode} without a Python error (os._exit, sys.exit from a library, "
            "or a crash in native code)"
        )
    number = -exitcode
    try:
        name = signal.Signals(number).name
    except ValueError:
        name = f"signal {number}"
    text = f"was killed by signal {number} ({name}, exit code {exitcode})"
    now = oom_kill_count()
    if oom_kills_before is not None and now is not None and now > oom_kills_before:
        return text + (
            f": the kernel's OOM killer ended {now - oom_kills_before} process(es) of this job "
            "(cgroup memory events, oom_kill): it ran out of host memory; lower data.batch_size or data.num_workers"
        )
    if number == signal.SIGKILL:
        return text + (
            ": nothing in the job asked for it, so the kernel's OOM killer (see `dmesg`), a scheduler or a user sent it"
        )
    return text


def oom_kill_count() -> int | None:
    """Processes of this process's cgroup killed by the OOM killer so far (cgroup v2 ``memory.events``,
    v1 ``memory.oom_control``), or ``None`` where the kernel does not say (not Linux, no memory controller)."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    candidates = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        rel = path.lstrip("/")
        if controllers == "":
            candidates += [Path("/sys/fs/cgroup", rel, "memory.events"), Path("/sys/fs/cgroup/memory.events")]
        elif "memory" in controllers.split(","):
            base = Path("/sys/fs/cgroup/memory")
            candidates += [base / rel / "memory.oom_control", base / "memory.oom_control"]
    for candidate in candidates:
        try:
            for entry in candidate.read_text().splitlines():
                key, _, value = entry.partition(" ")
                if key == "oom_kill":
                    return int(value)
        except (OSError, ValueError):
            continue
    return None


def _hung(rank: int, error: str, context: JobContext) -> str:
    """A collective timed out on ``rank``: name the rank that hung and where, when it said so."""
    cause = error.split("] ", 1)[-1]  # gloo prefixes its source location
    waited = f"waited parallel.timeout_s = {context.timeout_s:g} s in a collective and gave up ({cause})"
    if not context.hung:
        return (
            f"a rank hung: rank {rank} {waited}; the rank it waited for neither answered nor failed "
            "(a collective that only some ranks call, or a rank stuck in I/O or a lock)"
        )
    first, report = min(context.hung.items())
    others = [str(r) for r in sorted(context.hung) if r != first]
    also = f" (so did rank {', '.join(others)})" if others else ""
    return (
        f"rank {first} hung at {report.get('where', 'an unknown place')}{also}: rank {rank} {waited}; "
        f"rank {first} made no progress for {report.get('grace_s', 0):g} s after SIGTERM, so it was killed"
    )


def read_hang_reports(folder: Path) -> HangReports:
    """The hang reports ranks left in ``folder`` (see :data:`HUNG_MARKER`), by rank."""
    reports = {}
    for path in folder.glob(HUNG_MARKER.format(rank="*")):
        try:
            report = json.loads(path.read_text())
            reports[int(report["rank"])] = report
        except (OSError, ValueError, KeyError):
            continue
    return reports


class QuietCollectiveTimeouts(logging.Filter):
    """Drops the launcher's log records about a collective timeout and its SIGTERM/SIGKILL of the other ranks.

    They repeat the failed rank's torch traceback; :func:`describe_failure` says what happened instead.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        if "via signal SIGTERM" in text or "forcefully exiting via SIGKILL" in text:
            return False
        if record.exc_info:
            text += logging.Formatter().formatException(record.exc_info)
        return not COLLECTIVE_TIMEOUT.search(text)


def quiet_launcher_logs() -> QuietCollectiveTimeouts:
    """Install :class:`QuietCollectiveTimeouts` on torch's launcher loggers (undo: :func:`restore_launcher_logs`)."""
    quiet = QuietCollectiveTimeouts()
    for name in _LAUNCHER_LOGGERS:
        for logger in _loggers_under(name):
            logger.addFilter(quiet)
    return quiet


def restore_launcher_logs(quiet: QuietCollectiveTimeouts) -> None:
    """Remove what :func:`quiet_launcher_logs` installed."""
    for name in _LAUNCHER_LOGGERS:
        for logger in _loggers_under(name):
            logger.removeFilter(quiet)


def _loggers_under(name: str) -> list[logging.Logger]:
    """The logger ``name`` and every logger below it that exists (filters do not propagate to children)."""
    found = [logging.getLogger(name)]
    found += [
        lg
        for key, lg in logging.Logger.manager.loggerDict.items()
        if key.startswith(name + ".") and isinstance(lg, logging.Logger)
    ]
    return found

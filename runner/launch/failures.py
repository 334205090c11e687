"""Why a launched job failed, in words (the error, signal, OOM kill or hang); a worker's two guards.

The elastic launcher reports a failed worker as a ``ProcessFailure`` (``exitcode``, the error file
its ``@record`` wrote, ``timestamp``); a worker killed hard leaves no error file, only its exit code,
``-N`` for signal ``N``. This module turns that into one sentence for the run's ``runner.error`` tag
and the command line: ``rank 1 was killed by signal 9 (SIGKILL, exit code -9) ...``. It also keeps the
launcher's own log lines about a collective timeout off the terminal, where they would repeat a torch
traceback that the sentence already explains. torch is not imported here.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import re
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from runner.errors import TrainingError, first_line, signal_name

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
    """What the driver knew when the job failed: ``parallel.timeout_s``, the cgroup's OOM kills before, hang reports."""

    timeout_s: float
    oom_kills_before: int | None = None
    hung: HangReports = field(default_factory=dict)


def describe_failure(exc: BaseException, context: JobContext) -> str:
    """One sentence for a failed job: the rank at its root and what ended it (``rank 1 hung: ...``, ``rank 0 failed:
    RuntimeError: ...``)."""
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


_INTERRUPTED = re.compile(r"runner\.errors\.Interrupted: interrupted by signal (\d+)(?: \(\w+\))?(?: at rank (\d+))?")


def interruption(exc: BaseException) -> tuple[int, int | None] | None:
    """``(signal, rank)`` when a failed job's ranks stopped on a signal after their checkpoint, else ``None``."""
    failures: dict[int, Any] = getattr(exc, "failures", None) or {}
    found = [_INTERRUPTED.search(python_error(f)) for f in failures.values()]
    if not found or not any(found):
        return None
    first = next(m for m in found if m is not None)
    return int(first.group(1)), (int(first.group(2)) if first.group(2) else None)


def python_error(failure: ProcessFailure) -> str:
    """The failed rank's Python error (``Type: message``; a runner error's whole message), or ``""``."""
    data = getattr(failure, "error_file_data", None) or {}
    inner = data.get("message", {}) if isinstance(data, dict) else {}
    if isinstance(inner, dict):
        trace = inner.get("extraInfo", {}).get("py_callstack", "")
        if trace.strip():
            lines = trace.strip().splitlines()
            own = max((i for i, x in enumerate(lines) if x.startswith("runner.errors.")), default=None)
            if own is not None:  # runner's own error: every line of it
                return re.sub(r"^runner\.errors\.(TrainingError|UserCodeError): ", "", "\n".join(lines[own:]))
            return first_line("\n".join(lines[_exception_start(lines) :]))
        return str(inner.get("message", ""))
    text = str(inner)
    return "" if text == "<NONE>" else text


def _exception_start(lines: list[str]) -> int:
    """Where a traceback's exception line is: after its last frame (``  File ...``, then its code and the carets under
    it, indented). The message may span lines (a multi-line repr): its last line, once taken, was ``)``."""
    frames = [i for i, line in enumerate(lines) if line.startswith('  File "')]
    if not frames:
        return len(lines) - 1
    start = frames[-1] + 1
    while start < len(lines) - 1 and lines[start].startswith("    "):
        start += 1
    return start


def ended_by(exitcode: int, oom_kills_before: int | None) -> str:
    """What ended a process with no Python error: a signal (an OOM kill when the count grew) or its exit code."""
    if exitcode >= 0:
        return (
            f"exited with code {exitcode} without a Python error (os._exit, sys.exit from a library, "
            "or a crash in native code)"
        )
    number = -exitcode
    text = f"was killed by signal {number} ({signal_name(number)}, exit code {exitcode})"
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
    """Processes of this process's cgroup killed by the OOM killer so far (cgroup v2 ``memory.events``, v1
    ``memory.oom_control``), or ``None`` where the kernel does not say (not Linux, no memory controller)."""
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
    """Moves the launcher's error records (a worker's whole traceback, the repeated timeout, the other ranks' kills)
    into a log file at :attr:`path`; :func:`describe_failure` says what happened instead."""

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = path
        self.written = False

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        if record.exc_info:
            text += logging.Formatter().formatException(record.exc_info)
        ending = "via signal SIGTERM" in text or "forcefully exiting via SIGKILL" in text
        if record.levelno < logging.ERROR and not ending and not COLLECTIVE_TIMEOUT.search(text):
            return True
        with contextlib.suppress(OSError), open(self.path, "a", encoding="utf-8") as log:
            log.write(f"{time.strftime('%H:%M:%S')} {record.levelname} {record.name}: {text}\n")
            self.written = True
        return False


@contextlib.contextmanager
def quiet_launcher_logs(path: Path) -> Iterator[QuietCollectiveTimeouts]:
    """:class:`QuietCollectiveTimeouts` on torch's launcher loggers and every one below them (filters do not
    propagate), while the block runs; the registry is read as a copy: the hub thread may make loggers meanwhile."""
    quiet = QuietCollectiveTimeouts(path)
    below = tuple(f"{name}." for name in _LAUNCHER_LOGGERS)
    existing = [lg for key, lg in logging.Logger.manager.loggerDict.copy().items() if key.startswith(below)]
    loggers = [logging.getLogger(name) for name in _LAUNCHER_LOGGERS]
    loggers += [lg for lg in existing if isinstance(lg, logging.Logger)]  # not the manager's placeholders
    for logger in loggers:
        logger.addFilter(quiet)
    try:
        yield quiet
    finally:
        for logger in loggers:
            logger.removeFilter(quiet)


HANG_GRACE_S = 10.0  # the default of parallel.hang_grace_s
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_SAMPLE_S = 0.25
_BUSY_FILES = ("runner/training/checkpoint.py",)  # a rank writing its checkpoint is not hung


def die_with_parent(expected_parent: int | None = None, signum: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send ``signum`` to this process when its parent thread ends (``PR_SET_PDEATHSIG``); a parent
    other than ``expected_parent`` means already orphaned, and the process ends. Returns whether it was asked."""
    if not sys.platform.startswith("linux"):
        return False
    parent = os.getppid() if expected_parent is None else expected_parent
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signum, 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if parent == 1 or os.getppid() != parent:  # orphaned before the request took effect
        os.kill(os.getpid(), signal.SIGKILL)
    return True


class HangWatch:
    """After SIGTERM or SIGINT, end this process when its main thread stands still ``grace_s`` seconds, reporting to
    ``report_dir``."""

    def __init__(self, rank: int, report_dir: str | None, grace_s: float = HANG_GRACE_S):
        self.rank = rank
        self.report_dir = report_dir
        self.grace_s = grace_s
        self._stopped = threading.Event()
        self._reader: socket.socket | None = None
        self._writer: socket.socket | None = None
        self._previous_fd = -1

    def start(self) -> None:
        """Route signal wake-ups to the watch thread and start it (call on the main thread, after the handlers)."""
        if threading.current_thread() is not threading.main_thread():
            return
        self._reader, self._writer = socket.socketpair()
        self._writer.setblocking(False)
        self._previous_fd = signal.set_wakeup_fd(self._writer.fileno(), warn_on_full_buffer=False)
        threading.Thread(target=self._watch, name=f"runner-hang-watch-{self.rank}", daemon=True).start()

    def stop(self) -> None:
        """Stop watching and give the wake-up fd back (the process is leaving training normally)."""
        self._stopped.set()
        if self._writer is None:
            return
        if threading.current_thread() is threading.main_thread():
            signal.set_wakeup_fd(self._previous_fd)
        with contextlib.suppress(OSError):
            self._writer.send(b"\0")  # wake the thread so it can return

    def _watch(self) -> None:
        assert self._reader is not None
        stop_signals = {signal.SIGTERM.value, signal.SIGINT.value}
        while not self._stopped.is_set():
            received = self._reader.recv(64)
            if self._stopped.is_set() or not received:
                return
            if stop_signals & set(received):
                break
        main = threading.main_thread().ident
        last, still_since = None, time.monotonic()
        while not self._stopped.wait(_SAMPLE_S):
            frame = sys._current_frames().get(main) if main is not None else None
            if frame is None:
                return
            stack, busy = _stack(frame)
            if stack != last or busy:
                last, still_since = stack, time.monotonic()
            elif time.monotonic() - still_since >= self.grace_s:
                self._end(frame)
                return

    def _end(self, frame: FrameType) -> None:
        """Report where the main thread is stuck, then SIGKILL this process."""
        where = f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno} in {frame.f_code.co_name}"
        print(
            f"runner: rank {self.rank} made no progress for {self.grace_s:g} s after the stop signal "
            f"(stuck at {where}): ending it",
            file=sys.stderr,
            flush=True,
        )
        if self.report_dir is not None:
            report = {"rank": self.rank, "where": where, "grace_s": self.grace_s}
            with contextlib.suppress(OSError):
                Path(self.report_dir, f"hung-rank-{self.rank}.json").write_text(json.dumps(report))
        os.kill(os.getpid(), signal.SIGKILL)


def _stack(frame: FrameType | None) -> tuple[tuple[tuple[int, int], ...], bool]:
    """Each frame's code object and instruction (they change as Python runs), and whether one is in ``_BUSY_FILES``."""
    out = []
    busy = False
    while frame is not None:
        out.append((id(frame.f_code), frame.f_lasti))
        busy = busy or frame.f_code.co_filename.replace(os.sep, "/").endswith(_BUSY_FILES)
        frame = frame.f_back
    return tuple(out), busy

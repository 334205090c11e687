"""A launched worker's two guards: it dies with the process that started it, and ends itself when hung after a stop.

* :func:`die_with_parent`: ``prctl(PR_SET_PDEATHSIG, SIGKILL)`` (Linux, through ctypes), so that a
  worker never outlives its launcher: when the driver is killed hard, the kernel kills its workers
  instead of leaving them to train and write checkpoints on their own.
* :class:`HangWatch`: a stop signal (SIGTERM, SIGINT) asks the training loop to checkpoint and stop
  at the end of its step. A rank stuck in a call that never returns (waiting for a peer that is
  gone, a lock, I/O) cannot, and the launcher would wait 30 s before it kills it. The watch learns
  of the signal through ``signal.set_wakeup_fd`` (which the interpreter writes to even while the main
  thread is blocked in C code) and, when the main thread's Python stack then does not move for
  ``parallel.hang_grace_s`` seconds (writing a checkpoint does not count), reports the place it is
  stuck at and ends the process with SIGKILL.

Neither is used when the worker runs in the driver's own process (``none``, ``dp``): there the user's
second Ctrl-C stops a stuck step (docs/design.md §12).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from types import FrameType

HANG_GRACE_S = 10.0  # the default of parallel.hang_grace_s
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_SAMPLE_S = 0.25
_BUSY_FILES = ("runner/training/checkpoint.py",)  # a rank writing its checkpoint is not hung


def die_with_parent(expected_parent: int | None = None) -> bool:
    """Ask the kernel to SIGKILL this process when the thread that started it ends (Linux ``PR_SET_PDEATHSIG``).

    If the parent is already gone (it died before this call), the process ends at once.

    Args:
        expected_parent: The pid of the process that started this one, when known (the driver passes
            its own); a different parent then means this process was orphaned and adopted.

    Returns:
        Whether the request was made (``False`` off Linux or without ``prctl``).
    """
    if not sys.platform.startswith("linux"):
        return False
    parent = os.getppid() if expected_parent is None else expected_parent
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if parent == 1 or os.getppid() != parent:  # orphaned before the request took effect
        os.kill(os.getpid(), signal.SIGKILL)
    return True


class HangWatch:
    """After SIGTERM or SIGINT, end this process when its main thread makes no progress for ``grace_s`` seconds.

    Args:
        rank: The global rank, named in the report.
        report_dir: Folder the driver reads hang reports from (``hung-rank-<rank>.json``), or ``None``.
        grace_s: Seconds the main thread's stack may stand still after the signal.
    """

    def __init__(self, rank: int, report_dir: str | None, grace_s: float = HANG_GRACE_S):
        self.rank, self.report_dir, self.grace_s = rank, report_dir, grace_s
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
            stack = _stack(frame)
            if stack != last or _busy(frame):
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


def _stack(frame: FrameType | None) -> tuple[tuple[int, int], ...]:
    """Where every frame of a stack is: code object and instruction (changes whenever Python runs)."""
    out = []
    while frame is not None:
        out.append((id(frame.f_code), frame.f_lasti))
        frame = frame.f_back
    return tuple(out)


def _busy(frame: FrameType | None) -> bool:
    while frame is not None:
        if frame.f_code.co_filename.replace(os.sep, "/").endswith(_BUSY_FILES):
            return True
        frame = frame.f_back
    return False

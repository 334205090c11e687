"""The pipe between the training processes and the driver: rank 0 talks, the driver's hub listens; no torch, no mlflow.

The driver is the only process that imports MLflow (docs/design.md §6, the process model). Rank 0 of the
job connects to the driver's ``Hub`` over a Unix socket (``multiprocessing.connection``, with a
random key) and sends, in order, one frozen dataclass per message (:data:`Message`):

* :class:`Built`: the parts were built (or the spec error found while building them); the driver then
  creates or reopens the run and answers with the run id, the checkpoint folder and whether to resume;
* :class:`Restored`: what the checkpoint said (values recorded, resumed or not); the driver answers notes;
* :class:`Metrics`, :class:`Tags`, :class:`Artifact`, :class:`Data`, :class:`LoggedModel`: what the run records,
  without waiting; metric values logged within 0.2 s of the last message wait, stamped with the time they were
  taken, and go in one :class:`Metrics` with the next call (each message costs both processes CPU on a busy
  machine: a message per step cost rank 0 about 2.5 % of its time under ddp-2 logging every step on 2 cores, and
  woke the hub as often);
* :class:`Flush` and :class:`Close`: answered once everything before them reached the store (or its spool);
* :class:`Result` or :class:`Failed`: how the rank ended.

A message is a type, not a string and a tuple, so the driver's session is called by type
(:meth:`runner.launch.session.RunSession.handle`) and a field a sender forgot fails where it is sent.
"""

from __future__ import annotations

import contextlib
import math
import os
import secrets
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Connection, Listener
from pathlib import Path
from typing import Any

from runner.errors import RunnerError, SpecError, TrackingError


@dataclass(frozen=True)
class Built:
    """Rank 0 built the parts (``error``: the spec issue a rank found instead), with the notes of what differs between
    modes; answered with a :class:`HandedRun`."""

    error: SpecError | None
    notes: list[str]


@dataclass(frozen=True)
class Restored:
    """What the checkpoint said: metric values the run had ``recorded``, whether training ``resumed`` from it, whether
    the run is ``continuing`` (a resume or a restart); answered with the driver's notes."""

    recorded: int
    resumed: bool
    continuing: bool


@dataclass(frozen=True)
class Metrics:
    """Metric values logged since the last message: ``(values, step, timestamp in ms)`` each."""

    logged: list[tuple[dict[str, float], int, int]]


@dataclass(frozen=True)
class Tags:
    """Tags to set on the run."""

    tags: dict[str, Any]


@dataclass(frozen=True)
class Artifact:
    """A file or folder of rank 0's to upload, under ``artifact_path`` of the run."""

    path: str
    artifact_path: str | None


@dataclass(frozen=True)
class Data:
    """The data's figures and fingerprints (:class:`runner.training.data.DatasetInfo`), for a new run's inputs."""

    info: dict[str, Any]


@dataclass(frozen=True)
class LoggedModel:
    """The trained model's state, saved by rank 0 to ``path`` (tensors and plain values), logged at ``step``."""

    path: str
    step: int
    normalization: tuple[float, float] | None


@dataclass(frozen=True)
class Flush:
    """Answered once what came before reached the store: the metric values the run has numbered."""


@dataclass(frozen=True)
class Close:
    """As :class:`Flush`, and rank 0 sends nothing more to record."""


@dataclass(frozen=True)
class Result:
    """How the rank ended: its :class:`runner.training.WorkerResult` as a dict."""

    result: dict[str, Any]


@dataclass(frozen=True)
class Failed:
    """What rank 0 failed of (runner's own exception, or a TrainingError naming another)."""

    error: BaseException


Recorded = Metrics | Tags | Artifact | Data | LoggedModel  # what the run records: not answered
Message = Built | Restored | Recorded | Flush | Close | Result | Failed
ANSWERED = (Built, Restored, Flush, Close)  # the messages the hub answers


@dataclass(frozen=True)
class HubAddress:
    """Where rank 0 reaches the driver's hub: a Unix socket path and the key that authenticates it."""

    path: str
    key: bytes


@dataclass(frozen=True)
class HandedRun:
    """The driver's answer to ``built``: the run and its checkpoint folder (``None`` for both without one);
    ``abort``."""

    run_id: str | None
    checkpoint_dir: str
    resume: bool
    abort: bool = False


class Link:
    """Rank 0's end of the pipe. Every method is safe to call from the training thread only."""

    def __init__(self, address: HubAddress) -> None:
        self._conn: Connection = Client(address.path, family="AF_UNIX", authkey=address.key)
        self._lock = threading.Lock()

    def send(self, message: Message) -> None:
        """Send a message that the hub does not answer; returns once it is written to the socket."""
        with self._lock:
            self._conn.send(message)

    def ask(self, message: Message) -> Any:
        """Send a message the hub answers and wait; TrackingError carries the hub's error."""
        with self._lock:
            self._conn.send(message)
            ok, answer = self._conn.recv()
        if not ok:
            raise TrackingError(answer)
        return answer

    def close(self) -> None:
        self._conn.close()


class ChannelTracker:
    """Rank 0's :class:`Tracker`: writes its calls to a local socket for the driver's tracker to send; metric values
    logged within ``every_s`` of the last message go with the next call (module note)."""

    def __init__(self, link: Link, every_s: float = 0.2) -> None:
        self._link = link
        self._every_s = every_s
        self._pending: list[tuple[dict[str, float], int, int]] = []
        self._sent_at = -math.inf  # the first values go at once, however recently the machine booted
        self._recorded = 0
        self._closed = False

    def log_metrics(self, metrics: Mapping[str, float], step: int, timestamp_ms: int | None = None) -> None:
        if not isinstance(step, int):
            raise TypeError(f"step must be an int, not {type(step).__name__}")
        self._check_open()
        stamp = int(time.time() * 1000) if timestamp_ms is None else timestamp_ms
        self._pending.append(({k: float(v) for k, v in metrics.items()}, step, stamp))
        if time.monotonic() - self._sent_at >= self._every_s:
            self._send_pending()

    def log_artifact(self, path: str | os.PathLike[str], artifact_path: str | None = None) -> None:
        local = Path(path).resolve()
        if not local.exists():
            raise FileNotFoundError(f"artifact not found: {local}")
        self.send(Artifact(str(local), artifact_path))

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        self.send(Tags(dict(tags)))

    def flush(self) -> None:
        self._check_open()
        self._send_pending()
        self._recorded = int(self._link.ask(Flush()))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._send_pending()
        self._recorded = int(self._link.ask(Close()))

    def send(self, message: Any) -> None:
        """Send a :data:`Message` to the driver (:class:`Data`, :class:`LoggedModel`, ...), in order with the rest."""
        self._check_open()
        self._send_pending()
        self._link.send(message)

    def recorded(self) -> int:
        """Metric values the run has numbered, as of the last :meth:`flush` (what a checkpoint records)."""
        return self._recorded

    def _send_pending(self) -> None:
        if self._pending:
            self._link.send(Metrics(self._pending))
            self._pending = []
        self._sent_at = time.monotonic()

    def _check_open(self) -> None:
        if self._closed:
            raise TrackingError("the tracker was closed")


class Hub:
    """The driver's end: a socket and one thread serving rank 0's messages in order through ``handle(message)``.

    Its return value answers :data:`ANSWERED` kinds, its exception answers them as an error; ``before_accept`` runs
    first (the driver opens the store there while the training processes build)."""

    def __init__(self, handle: Callable[[Message], Any], before_accept: Callable[[], None] = lambda: None) -> None:
        self._handle = handle
        self._before = before_accept
        self.folder = tempfile.mkdtemp(prefix="runner-")
        self.address = HubAddress(str(Path(self.folder) / "hub.sock"), secrets.token_bytes(16))
        self._listener = Listener(self.address.path, family="AF_UNIX", authkey=self.address.key)
        self._thread = threading.Thread(target=self._serve, name="runner-hub", daemon=True)
        self._stopped = threading.Event()

    def start(self) -> None:
        self._thread.start()

    def stop(self, wait_s: float = 30.0) -> None:
        """Stop listening and wait (at most ``wait_s``) for the last message to be handled; remove the folder."""
        self._stopped.set()
        # A hub still waiting for rank 0 is woken by a connection of its own, made on a thread: it must not
        # block this one when the hub is busy with rank 0's last messages.
        threading.Thread(target=self._wake, name="runner-hub-wake", daemon=True).start()
        self._thread.join(wait_s)
        self._listener.close()
        shutil.rmtree(self.folder, ignore_errors=True)

    def _wake(self) -> None:
        with contextlib.suppress(OSError, EOFError):
            Client(self.address.path, family="AF_UNIX", authkey=self.address.key).close()

    def _serve(self) -> None:
        with contextlib.suppress(Exception):  # the handler keeps what went wrong for the answer to rank 0
            self._before()
        while not self._stopped.is_set():
            try:
                conn = self._listener.accept()
            except (AuthenticationError, EOFError, ConnectionError):
                continue  # a stranger without the key, or a peer gone before the handshake
            except OSError:
                return
            if self._stopped.is_set():
                conn.close()
                return
            with conn:  # an error of the handler's own ends the hub (traceback on stderr); rank 0 finds its pipe closed
                self._serve_one(conn)

    def _serve_one(self, conn: Connection) -> None:
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                return
            try:
                answer = (True, self._handle(message))
            except Exception as exc:
                if not isinstance(message, ANSWERED):
                    raise
                answer = (False, str(exc) if isinstance(exc, RunnerError) else f"{type(exc).__name__}: {exc}")
            if isinstance(message, ANSWERED):
                try:
                    conn.send(answer)
                except OSError:
                    return

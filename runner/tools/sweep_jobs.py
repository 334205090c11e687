"""Warm worker processes of a sweep: ``jobs`` processes pulling trial after trial, spread over GPUs, stopped together.

A worker process is started once (``spawn``), sets its device view (``CUDA_VISIBLE_DEVICES``
before CUDA initialises) and runs :func:`runner.tools.sweep_run.work` against the study, so
the interpreter start-up and the torch and MLflow imports are paid once per process, not
once per trial (docs/design.md §16). Trials whose device view differs from trial to trial
(``devices`` swept) get one process each.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import queue as queue_module
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from runner.errors import Interrupted, mask_secrets
from runner.tools.sweep_report import first_line
from runner.tools.sweep_space import SweepDefinition, Trial, TrialResult

if TYPE_CHECKING:
    from multiprocessing.process import BaseProcess
    from multiprocessing.queues import Queue

    from runner.plan import Plan
    from runner.spec.schema import ExperimentSpec
    from runner.tools.sweep_run import TrialSetup
    from runner.tools.sweep_study import SweepStudy

TERMINATE_GRACE_S = 30.0  # how long stopped worker processes get to end their runs KILLED
RESTARTS = 3  # processes started in place of one that died, per worker (a crash at start-up stops there)
_FAILED_TAIL_CHARS = 2000
_POLL_S = 0.2
Message = tuple[str, int, Any]  # (kind, worker index, payload): the payload's type depends on the kind


def device_pool(spec: ExperimentSpec, plans: Sequence[Plan], definition: SweepDefinition) -> list[int] | None:
    """GPU ids to spread concurrent single-GPU trials over, or ``None`` to leave devices alone."""
    if not plans or swept_devices(definition):
        return None
    if any(
        p.devices.accelerator != "cuda" or len(p.devices.requested_ids) != 1 or p.devices.world_size != 1 for p in plans
    ):
        return None
    ids = spec.devices.ids
    return list(ids) if isinstance(ids, list) else list(range(len(plans[0].devices.visible)))


def swept_devices(definition: SweepDefinition) -> bool:
    """Whether trials differ in their devices (then every trial needs a process of its own)."""
    return any(k == "devices" or k.startswith("devices.") for k, _ in definition.params)


@dataclass(frozen=True)
class WorkerConfig:
    """What a warm worker process needs (picklable: it crosses the ``spawn`` boundary).

    Attributes:
        index: Worker number, 0-based (names its log file).
        definition: The sweep definition (JSON form).
        setup: The trials' base spec, environment and this worker's extra ``--set`` (its GPU).
        env: Variables set in the process before anything else runs (device view, CPU threads).
        log: File that takes the process's output (several workers at once), or ``None``.
        max_trials: Trials before the process exits (1 when the device view changes per trial).
    """

    index: int
    url: str
    study: str
    definition: dict[str, Any]
    tracking_uri: str
    experiment: str
    setup: TrialSetup
    env: dict[str, str] = field(default_factory=dict)
    log: str | None = None
    max_trials: int | None = None


def worker_main(config: WorkerConfig, messages: Queue[Message]) -> None:
    """Entry of a warm worker process: join the study and run trials until none is left.

    Sends ``(kind, worker index, payload)`` on ``messages``: ``"start"`` with the Optuna trial
    number, ``"result"`` with the :class:`TrialResult` JSON, ``"error"`` with a traceback.
    Exits 0 when the queue is empty, 130 when interrupted, 1 on an error outside a trial.
    """
    os.environ.update(config.env)
    if config.log is not None:
        log = os.open(config.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
    from runner.tools.sweep_run import work
    from runner.tools.sweep_store import SweepStore, open_storage
    from runner.tools.sweep_study import SweepStudy

    code, me = 0, config.index
    try:
        with sigterm_interrupts():
            storage = open_storage(config.url)
            study = SweepStudy.join(storage, config.url, config.study, SweepDefinition.from_json(config.definition))
            store = SweepStore(config.tracking_uri, config.experiment)
            work(
                study,
                store,
                config.setup,
                lambda r: messages.put(("result", me, r.to_json())),
                config.max_trials,
                on_start=lambda number: messages.put(("start", me, number)),
            )
    except (Interrupted, KeyboardInterrupt):
        code = 130
    except Exception as exc:
        text = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
        print(f"runner: sweep worker {me} failed: {mask_secrets(text)}", file=sys.stderr, flush=True)
        messages.put(("error", me, text))
        code = 1
    messages.close()
    messages.join_thread()  # the queue's feeder thread delivers what was put before the process ends
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # the results are in the study; skip the teardown of torch's and MLflow's threads


class WorkerPool:
    """Run :class:`WorkerConfig` processes until the study has no WAITING trial; stop them all on a signal.

    A process that dies (a crash, the kernel's OOM killer) fails the trial it ran and is replaced,
    up to :data:`RESTARTS` times per worker, while trials wait.

    Args:
        study: The sweep's study (one-trial workers are started again while trials wait).
        progress: Called with each result as it arrives.
        on_dead: Called as ``on_dead(Optuna trial number, error)`` for a trial whose process died.
    """

    def __init__(
        self,
        study: SweepStudy,
        progress: Callable[[TrialResult], object],
        on_dead: Callable[[int, str], None],
    ) -> None:
        self.study, self.progress, self.on_dead = study, progress, on_dead
        self._context = multiprocessing.get_context("spawn")
        self._messages: Queue[Message] = self._context.Queue()
        self._running: dict[BaseProcess, WorkerConfig] = {}
        self._current: dict[int, int | None] = {}  # worker index -> the Optuna trial it runs
        self._restarts: dict[int, int] = {}  # worker index -> processes started after one died

    def run(self, configs: Sequence[WorkerConfig]) -> list[str]:
        """Start one process per config (again while trials wait, for one-trial workers); return worker errors.

        Raises:
            Interrupted, KeyboardInterrupt: Stopped by a signal; every process got SIGTERM first.
        """
        errors: list[str] = []
        try:
            for config in configs:
                self._start(config)
            while self._running:
                self._drain(errors, timeout=_POLL_S)
                for proc in [p for p in self._running if not p.is_alive()]:
                    self._ended(proc, errors)
        except BaseException:  # also KeyboardInterrupt: never leave worker processes behind
            _stop(list(self._running))
            self._drain(errors, timeout=0)
            raise
        return errors

    def _start(self, config: WorkerConfig) -> None:
        name = f"runner-sweep-worker-{config.index}"
        proc = self._context.Process(target=worker_main, args=(config, self._messages), name=name)
        proc.start()
        self._running[proc] = config
        self._current[config.index] = None

    def _drain(self, errors: list[str], timeout: float) -> None:
        """Handle the messages that arrived (waiting up to ``timeout`` for the first)."""
        while True:
            try:
                kind, worker, payload = self._messages.get(timeout=timeout) if timeout else self._messages.get_nowait()
            except (queue_module.Empty, EOFError, OSError):
                return
            timeout = 0
            if kind == "start":
                self._current[worker] = int(payload)
            elif kind == "result":
                self._current[worker] = None
                self.progress(TrialResult(**payload))
            else:
                errors.append(str(payload))

    def _ended(self, proc: BaseProcess, errors: list[str]) -> None:
        """A process exited: fail the trial it left RUNNING; start the next one-trial process while trials wait."""
        proc.join()
        self._drain(errors, timeout=0)
        config = self._running.pop(proc)
        number, code = self._current.pop(config.index, None), proc.exitcode
        died = code not in (0, 130)
        if number is not None and died:
            tail = _tail(config.log)
            self.on_dead(number, f"the sweep worker process exited with status {code}\n{tail}".strip())
        again = code == 0 and config.max_trials is not None
        if died and self._restarts.get(config.index, 0) < RESTARTS:  # a replacement takes over the queue
            self._restarts[config.index] = self._restarts.get(config.index, 0) + 1
            again = True
        if again and self.study.counts().get("WAITING", 0):
            self._start(config)


def _tail(log: str | None) -> str:
    if log is None or not Path(log).is_file():
        return ""
    return Path(log).read_text(encoding="utf-8", errors="replace")[-_FAILED_TAIL_CHARS:]


@contextlib.contextmanager
def sigterm_interrupts() -> Iterator[None]:
    """Turn SIGTERM into :class:`Interrupted` while trials run, so the sweep ends its runs KILLED.

    (SIGINT already raises KeyboardInterrupt; a training trial installs its own handlers
    for both and restores these afterwards.)
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handle(signum: int, frame: FrameType | None) -> None:
        raise Interrupted(signum)

    previous = signal.signal(signal.SIGTERM, handle)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _stop(procs: Sequence[BaseProcess]) -> None:
    """Ask worker processes to stop (their trials' runs end KILLED and are enqueued again), then kill what remains."""
    import time

    for proc in procs:
        if proc.is_alive() and proc.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + TERMINATE_GRACE_S
    for proc in procs:
        proc.join(timeout=max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join()


class Progress:
    """One line per finished trial: ``[sweep 2/4] trial 1 (optim.lr=0.01): FINISHED val/accuracy=0.93``.

    Args:
        done: Trials already finished (earlier runs of a resumed sweep, other workers).
    """

    def __init__(self, say: Callable[[str], None], total: int, metric: str, done: int = 0):
        self.say, self.total, self.metric, self.done = say, total, metric, done

    def __call__(self, result: TrialResult) -> TrialResult:
        self.done += 1
        value = "" if result.metric_value is None else f" {self.metric}={result.metric_value:.6g}"
        detail = f": {first_line(result.error)}" if result.error else ""
        pruned = f" (pruned after epoch {result.pruned_epoch})" if result.pruned else ""
        label = Trial(result.index, result.values).label()
        self.say(f"[sweep {self.done}/{self.total}] {label}: {result.status}{pruned}{value}{detail}")
        return result

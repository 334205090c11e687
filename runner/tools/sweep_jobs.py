"""Warm worker processes of a sweep: ``jobs`` processes pulling trial after trial, spread over GPUs, stopped together.

A worker process is started once (``spawn``), sets its device view (``CUDA_VISIBLE_DEVICES``
before CUDA initialises) and runs ``runner.tools.sweep_jobs.work`` against the study, so
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
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from runner.errors import Interrupted, RunnerError, echo, first_line
from runner.spec.loading import load_spec
from runner.tools.sweep_space import SweepDefinition, SweepStore, Trial, TrialResult
from runner.tools.sweep_study import SweepStudy, open_storage
from runner.tools.sweep_trials import OptunaPruning, trial_tags, without_sweep
from runner.tracking.runs import TrackedRun

if TYPE_CHECKING:
    from multiprocessing.process import BaseProcess
    from multiprocessing.queues import Queue

    import optuna

    from runner.plan import Plan
    from runner.spec.schema import ExperimentSpec


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
    return any(k == "devices" or k.startswith("devices.") for k in definition.params)


@dataclass(frozen=True)
class WorkerConfig:
    """What a warm worker process needs, picklable for ``spawn``: its index, the definition, the trial setup, the env
    set first, its log file, and ``max_trials`` before it exits."""

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
    """Entry of a warm worker: run trials until none is left, sending ``("start" | "result" | "error", index,
    payload)``.

    Exits 0 when the queue is empty, 130 when interrupted, 1 on an error outside a trial.
    """
    os.environ.update(config.env)
    if config.log is not None:
        log = os.open(config.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
    code = 0
    me = config.index
    try:
        with sigterm_interrupts():
            storage, definition = open_storage(config.url), SweepDefinition.model_validate(config.definition)
            study = SweepStudy.join(storage, config.url, config.study, definition)
            store = SweepStore(config.tracking_uri, config.experiment)
            work(
                study,
                store,
                config.setup,
                lambda r: messages.put(("result", me, asdict(r))),
                config.max_trials,
                on_start=lambda number: messages.put(("start", me, number)),
            )
    except (Interrupted, KeyboardInterrupt):
        code = 130
    except Exception as exc:
        text = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
        echo(f"runner: sweep worker {me} failed: {text}", err=True)
        messages.put(("error", me, text))
        code = 1
    messages.close()
    messages.join_thread()  # the queue's feeder thread delivers what was put before the process ends
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # the results are in the study; skip the teardown of torch's and MLflow's threads


class WorkerPool:
    """Run :class:`WorkerConfig` processes until the study has no WAITING trial; stop them all on a signal.

    A process that dies fails its trial (``on_dead``) and is replaced, up to :data:`RESTARTS` times per worker.
    """

    def __init__(
        self,
        study: SweepStudy,
        progress: Callable[[TrialResult], object],
        on_dead: Callable[[int, str], None],
    ) -> None:
        self.study = study
        self.progress = progress
        self.on_dead = on_dead
        self._context = multiprocessing.get_context("spawn")
        self._messages: Queue[Message] = self._context.Queue()
        self._running: dict[BaseProcess, WorkerConfig] = {}
        self._current: dict[int, int | None] = {}  # worker index -> the Optuna trial it runs
        self._restarts: dict[int, int] = {}  # worker index -> processes started after one died

    def run(self, configs: Sequence[WorkerConfig]) -> list[str]:
        """Start one process per config and return worker errors; a signal SIGTERMs every process, then raises."""
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
            tail = ""
            if config.log is not None and Path(config.log).is_file():
                tail = Path(config.log).read_text(encoding="utf-8", errors="replace")[-_FAILED_TAIL_CHARS:]
            self.on_dead(number, f"the sweep worker process exited with status {code}\n{tail}".strip())
        again = code == 0 and config.max_trials is not None
        if died and self._restarts.get(config.index, 0) < RESTARTS:  # a replacement takes over the queue
            self._restarts[config.index] = self._restarts.get(config.index, 0) + 1
            again = True
        if again and self.study.counts().get("WAITING", 0):
            self._start(config)


@contextlib.contextmanager
def sigterm_interrupts() -> Iterator[None]:
    """Turn SIGTERM into :class:`Interrupted` while trials run, so the sweep ends its runs KILLED."""
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
    """One line per finished trial: ``[sweep 2/4] trial 1 (optim.lr=0.01): FINISHED val/accuracy=0.93``."""

    def __init__(self, say: Callable[[str], None], total: int, metric: str, done: int = 0):
        self.say = say
        self.total = total
        self.metric = metric
        self.done = done

    def __call__(self, result: TrialResult) -> TrialResult:
        self.done += 1
        value = "" if result.metric_value is None else f" {self.metric}={result.metric_value:.6g}"
        detail = f": {first_line(result.error)}" if result.error else ""
        pruned = f" (pruned after epoch {result.pruned_epoch})" if result.pruned else ""
        label = Trial(result.index, result.values).label()
        self.say(f"[sweep {self.done}/{self.total}] {label}: {result.status}{pruned}{value}{detail}")
        return result


@dataclass(frozen=True)
class TrialSetup:
    """What every trial of one worker shares: base ``--set`` and ``--unset``, the environment, and ``extra``
    ``--set`` after the trial's values (a warm worker's GPU)."""

    path: Path
    overrides: tuple[str, ...]
    environ: Mapping[str, str]
    extra: tuple[str, ...] = ()
    unset: tuple[str, ...] = ()


def work(
    study: SweepStudy,
    store: SweepStore,
    setup: TrialSetup,
    report: Callable[[TrialResult], object],
    max_trials: int | None = None,
    *,
    on_start: Callable[[int], object] | None = None,
) -> None:
    """Run WAITING trials until none is left or ``max_trials`` ran.

    Raises Interrupted on SIGINT/SIGTERM, after enqueueing the running trial again.
    """
    import runner.launch.driver  # what every trial runs (torch, MLflow, the training code), once, before the first
    import runner.launch.worker
    import runner.tracking.trackers
    import runner.training.setup  # noqa: F401

    take_over(study, store)
    done = 0
    while max_trials is None or done < max_trials:
        trial = study.next_trial()
        if trial is None:
            take_over(study, store)  # a trial whose worker died is enqueued again: take it over
            trial = study.next_trial()
        if trial is None:
            break
        if on_start is not None:
            on_start(trial.number)
        report(run_trial(study, store, setup, trial))
        done += 1


def take_over(study: SweepStudy, store: SweepStore) -> None:
    """Enqueue again the trials whose worker died, and end their old MLflow runs KILLED."""
    taken = study.fail_stale()
    if taken:
        store.kill_taken_over(study.parent_run_id, taken)


def run_trial(study: SweepStudy, store: SweepStore, setup: TrialSetup, trial: optuna.Trial) -> TrialResult:
    """Run one Optuna trial as a child run; a failure becomes a FAILED result, a signal ends it KILLED and enqueues
    it again."""
    point = study.values_of(trial)
    parent_id = study.parent_run_id
    try:
        with study.heartbeat(trial):
            result = _execute(study, store, setup, trial, point, parent_id)
    except BaseException as exc:
        try:
            run_id = store.trial_run(parent_id, trial.number)
        except Exception:  # the store cannot answer: the trial's own error matters more
            run_id = None
        stopped = isinstance(exc, (Interrupted, KeyboardInterrupt))
        error = "interrupted" if stopped else f"{type(exc).__name__}: {exc}"
        if not stopped and not isinstance(exc, RunnerError):  # runner's own errors say enough; others bring a trace
            error += f"\n{traceback.format_exc()}"
        failed = TrialResult(point.index, point.values, run_id, "KILLED" if stopped else "FAILED", None, error)
        study.tell(trial, failed)  # a KILLED trial is enqueued again
        if stopped or not isinstance(exc, Exception):
            raise
        return failed
    if not study.tell(trial, result):  # the other worker's attempt counts: this run ends KILLED, saying why
        why = f"trial {point.index} was taken over by another worker while this one ran it: this result is dropped"
        echo(f"runner: {why}", err=True)
        if result.run_id is not None:
            with contextlib.suppress(Exception):  # a store in trouble: the note above is said all the same
                TrackedRun(store.uri, result.run_id).end("KILLED", why)
    return result


def _execute(
    study: SweepStudy, store: SweepStore, setup: TrialSetup, trial: optuna.Trial, point: Trial, parent_id: str
) -> TrialResult:
    """Load the trial's spec and run it with ``runner exec``'s driver; tag the run when the pruner stopped it."""
    from runner.launch.driver import exec_experiment
    from runner.launch.session import ExecOptions

    definition = study.definition
    loaded = without_sweep(load_spec(setup.path, [*setup.overrides, *point.overrides(), *setup.extra], setup.unset))
    pruning = None
    if definition.pruner != "none":
        pruning = OptunaPruning(study.url, study.name, trial.number, definition.to_json(), trial)
    options = ExecOptions(
        run_name=point.run_name(),
        parent_run_id=parent_id,
        tags=trial_tags(point, study.name, trial.number),
        environ=setup.environ,
        epoch_end=pruning,
        in_process=True,  # a trial reuses the sweep worker's process (its imports, its pool)
        started_at=time.time(),  # a trial's start-up counts from the trial's start, not the sweep's
    )
    out = exec_experiment(loaded, options)
    stopped = out.workers[0].stopped_after_epoch if out.workers else None
    if stopped is not None and out.run_id is not None:
        store.mark_pruned(out.run_id, stopped)
    value = None if (got := out.metrics.get(definition.metric)) is None else float(got)
    return TrialResult(
        point.index, point.values, out.run_id, "FINISHED", value, pruned=stopped is not None, pruned_epoch=stopped
    )

"""One training process: make the strategy and the tracker, then run the setup steps and the loop.

:func:`run_worker` is the function the elastic launcher starts once per rank (it must be
importable and its argument picklable); for ``none`` and ``dp`` the driver calls it in
its own process. It never launches processes and never ends the MLflow run: the driver
owns the run (docs/design.md §6) and sets its final status. The worker reads the launcher's
environment once (:class:`~runner.launch.environment.LauncherEnvironment`), makes the
tracker (MLflow lives in :mod:`runner.tracking`, never in :mod:`runner.training`) and calls
the named steps of :mod:`runner.training.setup`.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from torch.distributed.elastic.multiprocessing.errors import record

from runner.errors import Interrupted, RunnerError, user_code_error

if TYPE_CHECKING:
    from runner.devices.resolve import DevicePlan
    from runner.launch.environment import LauncherEnvironment
    from runner.spec.loading import LoadedSpec
    from runner.strategies.base import Strategy
    from runner.tracking.trackers import Tracker
    from runner.training.data import DatasetInfo
    from runner.training.setup import TrainingParts, WorkerResult


@dataclass(frozen=True)
class WorkerArgs:
    """Everything a worker needs, picklable so it crosses the ``spawn`` boundary.

    Attributes:
        loaded: The :class:`runner.spec.loading.LoadedSpec`.
        plan: The :class:`runner.devices.resolve.DevicePlan` resolved by the driver.
        run_id: The MLflow run to log into, or ``None`` (tracking off, or another node owns it).
        tracking_uri: Absolute tracking URI, or ``None`` when tracking is off.
        checkpoint_dir: Folder of this run's checkpoints.
        resume: Load the newest valid checkpoint of ``checkpoint_dir`` before training.
        sync_timing: Exact per-step timing on CUDA (see :class:`runner.training.loop.LoopParts`).
        epoch_end: Decides on the logging rank after each epoch whether to stop there (a sweep's
            pruner); every rank follows its answer. ``None``: train to the end.
        launcher_pid: The process that started this worker (the driver, for the elastic launcher):
            the worker dies with it; ``None``: whatever process is the parent when the worker starts.
        report_dir: Folder where a rank that hung after a stop signal says where it was stuck, or ``None``.
        run_file: Where the driver hands over the run once it exists (:mod:`runner.launch.handoff`):
            ``run_id``, ``checkpoint_dir`` and ``resume`` above are then read from it after the parts are
            built. ``None``: they are final.
        dtype: The dtype the model, its inputs and its loss train in (``ExecOptions.dtype``), or ``None``.
        nudge: Nudge the initial weights by one ulp (``ExecOptions.nudge``).
    """

    loaded: LoadedSpec
    plan: DevicePlan
    run_id: str | None
    tracking_uri: str | None
    checkpoint_dir: str
    resume: bool = False
    sync_timing: bool = False
    epoch_end: Callable[[int, dict[str, float]], bool] | None = None
    launcher_pid: int | None = None
    report_dir: str | None = None
    run_file: str | None = None
    dtype: str | None = None
    nudge: bool = False


@record
def run_worker(args: WorkerArgs) -> WorkerResult | None:
    """Train one rank to the end (or to a stop signal).

    Args:
        args: See :class:`WorkerArgs`.

    Returns:
        The rank's :class:`~runner.training.setup.WorkerResult`; ``None`` when the driver's checks failed
        before the run existed (``args.run_file`` says so), and nothing was trained.

    Raises:
        Interrupted: SIGINT/SIGTERM arrived; a checkpoint was written first.
        SpecError: A name in the spec (model, dataset, kwargs) turned out not to build.
        Exception: Anything the training code raises; the driver marks the run FAILED.
    """
    from runner.devices.env import apply_threads
    from runner.launch.environment import LauncherEnvironment
    from runner.launch.watch import HangWatch, die_with_parent
    from runner.strategies.registry import make_strategy

    apply_threads(args.plan)  # one rule for every mode, before any work (docs/design.md §4)
    env = LauncherEnvironment.detect()  # the one read of the launcher's variables in a worker
    if env.external:  # a process of its own, started by the elastic launcher, torchrun or a scheduler
        die_with_parent(args.launcher_pid)
    strategy = make_strategy(args.loaded.spec.parallel, args.plan, env, args.loaded.spec.train.amp)
    stop = _StopFlag(announce=env.rank == 0)
    grace_s = args.loaded.spec.parallel.hang_grace_s
    watch = HangWatch(env.rank, args.report_dir, grace_s) if env.external else None
    try:
        strategy.setup()
        stop.install()
        if watch is not None:
            watch.start()
        try:
            result = _train(args, strategy, env, stop)
        except RunnerError:
            raise
        except Exception as exc:  # an error in the user's model, data, loss or metric: their file and line
            located = user_code_error(exc)
            if located is None:
                raise
            raise located from exc
        strategy.barrier()  # every rank is done with collectives before any destroys the group
        return result
    finally:
        if watch is not None:
            watch.stop()
        stop.uninstall()
        strategy.teardown()


def _train(args: WorkerArgs, strategy: Strategy, env: LauncherEnvironment, stop: _StopFlag) -> WorkerResult | None:
    """Set up on an initialised strategy, resume if asked, fit, log the outputs; the setup steps are named.

    Kept apart from :func:`run_worker` so that the model, DDP wrapper and optimizer are
    released when it returns, before the process group is destroyed. With ``args.run_file`` the
    parts are built while the driver creates the run, then the run is read from the file; ``None``
    is returned when the driver's checks failed.
    """
    from runner.tracking.spool import spool_path
    from runner.tracking.system import start_system_metrics
    from runner.tracking.trackers import make_tracker, skip_logged_steps
    from runner.training import setup
    from runner.training.seeding import seed_everything

    spec, uri = args.loaded.spec, args.tracking_uri
    seed_info = seed_everything(spec.seed, rank=strategy.rank, deterministic=spec.deterministic)
    parts = setup.build_parts(spec, args.loaded.path.parent, strategy, dtype=args.dtype, nudge=args.nudge)
    if args.run_file is not None:
        from runner.launch.handoff import wait_for_run

        handed = wait_for_run(args.run_file)
        if handed is None:
            return None
        args = dataclasses.replace(
            args, run_id=handed.run_id, checkpoint_dir=handed.checkpoint_dir, resume=handed.resume, run_file=None
        )
    run_id, log_rank, checkpoint_dir = _agree_on_run(strategy, args.run_id, args.checkpoint_dir)
    folder, is_log_rank = Path(checkpoint_dir), strategy.rank == log_rank
    restored = setup.restore(parts, strategy, folder, resume=args.resume, restarted=env.restarted)
    if is_log_rank and uri is not None and run_id is not None and (args.resume or env.restarted):
        restored.notes += _adopt_spool(uri, run_id, folder, restored.metrics_recorded)
    tracker = make_tracker(
        uri,
        run_id,
        is_logger=is_log_rank,
        flush_every_s=spec.tracking.flush_every_s,
        spool=spool_path(folder),
        first_seq=restored.metrics_recorded,
    )
    monitor = None
    try:
        if restored.resumed_from is not None:
            tracker = skip_logged_steps(tracker, uri, run_id)
        notes = list(restored.notes)
        if spec.deterministic:
            settings = setup.describe_settings(seed_info)
            notes.append(f"deterministic mode: {settings}")
            tracker.set_tags({"runner.deterministic_settings": settings})
        if is_log_rank:
            from runner.launch.driver import show_notes

            show_notes(notes)
        logged_run = run_id if is_log_rank else None
        if logged_run is not None and restored.resumed_from is None and parts.data is not None:
            _record_data(uri, logged_run, parts.data)
        if logged_run is not None and spec.tracking.system_metrics:
            monitor = start_system_metrics(uri, logged_run, resumed=restored.resumed_from is not None)
        checkpointer = setup.Checkpointer(
            parts, strategy, folder, args.loaded, run_id=run_id, writer=is_log_rank, tracker=tracker
        )
        epoch_end = _agreed_epoch_end(args.epoch_end, strategy, is_log_rank)
        loop = setup.loop_parts(
            parts, strategy, tracker, checkpointer, stop.is_set, sync_timing=args.sync_timing, epoch_end=epoch_end
        )
        fitted = setup.train(loop, spec, restored.state)
        if spec.tracking.log_model:  # a collective where the parameters are sharded
            parts.raw_model = strategy.full_module(parts.model)
        if logged_run is not None:
            _log_outputs(args, logged_run, tracker, parts, folder, fitted.state.global_step)
        return setup.finish(fitted, strategy, restored.resumed_from, notes)
    finally:
        if monitor is not None:
            monitor.finish()
        tracker.close()


def _adopt_spool(uri: str, run_id: str, folder: Path, recorded: int) -> list[str]:
    """Before a resumed job logs: send what the run's spool kept from before the checkpoint; drop the rest.

    Values recorded after the checkpoint (``seq >= recorded``) are computed again, so they are not sent.
    """
    from runner.tracking.spool import send_spool, spool_path

    path = spool_path(folder)
    sent = send_spool(uri, run_id, path, before_seq=recorded, apply_end=False)
    if sent is None:
        return []
    return [f"sent {sent.metrics} metric values kept in {path.name} while the tracking store was away"]


def _record_data(uri: str | None, run_id: str, info: DatasetInfo) -> None:
    """On the logging rank of a new run: the data as dataset inputs and the split fingerprint tag."""
    from runner.tracking.datasets import DatasetRecord, record_data

    if uri is None:
        return
    parts = [("train", "training", info.num_train, info.train_digest)]
    if info.num_val and info.val_digest is not None:
        parts.append(("val", "validation", info.num_val, info.val_digest))
    records = [
        DatasetRecord(f"{info.name} {part}", digest, context, count, info.source, info.input_shape)
        for part, context, count, digest in parts
    ]
    record_data(uri, run_id, records, info.val_split_sha256)


def _log_outputs(
    args: WorkerArgs, run_id: str, tracker: Tracker, parts: TrainingParts, folder: Path, step: int
) -> None:
    """On the logging rank: upload the last checkpoint and the trained model to the run, as the spec asks."""
    from runner.tracking.models import log_model
    from runner.training.checkpoint import list_checkpoints

    spec = args.loaded.spec
    if spec.checkpoint.enabled and spec.checkpoint.log_to_mlflow:
        saved = list_checkpoints(folder)
        if saved:
            tracker.log_artifact(str(saved[-1]), "checkpoints")
    if spec.tracking.log_model:
        tracker.flush()  # the metrics of the last step are linked to the model: they must be in MLflow
        stats = parts.data.normalization if parts.data is not None else None
        example = parts.example_input()
        if stats is not None:  # the model takes samples before normalisation; it normalises them itself
            example = example * stats[1] + stats[0]
        log_model(args.tracking_uri, run_id, parts.raw_model, example, step=step, normalization=stats)


def _agreed_epoch_end(
    decide: Callable[[int, dict[str, float]], bool] | None, strategy: Strategy, is_log_rank: bool
) -> Callable[[int, dict[str, float]], bool] | None:
    """The loop's ``epoch_end``: the logging rank asks ``decide``, every rank gets its answer (one gather per epoch)."""
    if decide is None:
        return None

    def epoch_end(epoch: int, metrics: dict[str, float]) -> bool:
        answer = bool(decide(epoch, metrics)) if is_log_rank else None
        return any(strategy.all_gather_object(answer))

    return epoch_end


def _agree_on_run(strategy: Strategy, local_run_id: str | None, local_dir: str) -> tuple[str | None, int, str]:
    """Find the run id, the rank that logs to it, and the checkpoint folder every rank uses.

    On one node every rank already has the run id. With several nodes (or under torchrun)
    only the workers whose driver created the run have it: all ranks gather ``(run id,
    checkpoint folder)`` and the lowest rank holding a run id becomes the logging rank; its
    folder is used by all (resuming on several nodes therefore needs a shared filesystem).
    """
    gathered = strategy.all_gather_object((local_run_id, local_dir))
    for rank, (rid, folder) in enumerate(gathered):
        if rid is not None:
            return rid, rank, folder
    return None, 0, gathered[0][1]


STOPPING = "runner: stopping after this step, a checkpoint first; Ctrl-C again (a second later) stops at once\n"


class _StopFlag:
    """SIGINT/SIGTERM handler: the first signal asks the loop to stop (:mod:`runner.training.loop` says at which step).

    A second SIGINT more than one second after the first raises ``KeyboardInterrupt`` at once
    (a terminal Ctrl-C reaches the launcher and every worker together, and the launcher
    forwards it again, so signals within one second count as one). With ``announce`` (rank 0)
    the first signal prints :data:`STOPPING` to stderr.
    """

    def __init__(self, announce: bool = False) -> None:
        self._announce = announce
        self._event = threading.Event()
        self._first: float | None = None
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def is_set(self) -> bool:
        return self._event.is_set()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        import time

        now = time.monotonic()
        if self._first is not None and signum == signal.SIGINT and now - self._first > 1.0:
            raise KeyboardInterrupt
        if self._first is None:
            self._first = now
            self.signum = signum
            if self._announce:
                os.write(2, STOPPING.encode())  # not print(): the main thread may be inside a write to stderr
        self._event.set()


__all__ = ["Interrupted", "WorkerArgs", "run_worker"]

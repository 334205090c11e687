"""One training process: build strategy, data, model and optimizer from the spec, resume, train.

:func:`run_worker` is the function the elastic launcher starts once per rank (it must be
importable and its argument picklable); for ``none`` and ``dp`` the driver calls it in
its own process. It never launches processes and never ends the MLflow run: the driver
owns the run (DESIGN §6) and sets its final status.
"""

from __future__ import annotations

import gc
import os
import signal
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch.distributed.elastic.multiprocessing.errors import record

from runner.errors import Interrupted


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
    """

    loaded: Any
    plan: Any
    run_id: str | None
    tracking_uri: str | None
    checkpoint_dir: str
    resume: bool = False
    sync_timing: bool = False


@dataclass
class WorkerResult:
    """What a worker returns (only the logging rank's is used by the driver).

    Attributes:
        rank: Global rank of the process.
        metrics: Last value of every metric.
        global_step: Optimizer steps taken at the end.
        history: ``(step, metrics)`` pairs, for tests and ``runner bench``.
        resumed_from: Checkpoint file the run continued from, if any.
        notes: Things the user should know (e.g. damaged checkpoints skipped).
        step_times_s: Wall time of each optimizer step, seconds.
        data_wait_s: Seconds of each step spent waiting for data.
        peak_memory_bytes: Peak memory of this rank: CUDA allocator peak on its device, else
            the process's peak resident set size.
        device: The device this rank trained on, e.g. ``cuda:0`` or ``cpu``.
    """

    rank: int
    metrics: dict[str, float] = field(default_factory=dict)
    global_step: int = 0
    history: list[Any] = field(default_factory=list)
    resumed_from: str | None = None
    notes: list[str] = field(default_factory=list)
    step_times_s: list[float] = field(default_factory=list)
    data_wait_s: list[float] = field(default_factory=list)
    peak_memory_bytes: int = 0
    device: str = "cpu"


@record
def run_worker(args: WorkerArgs) -> WorkerResult:
    """Train one rank to the end (or to a stop signal).

    Args:
        args: See :class:`WorkerArgs`.

    Returns:
        The rank's :class:`WorkerResult`.

    Raises:
        Interrupted: SIGINT/SIGTERM arrived; a checkpoint was written first.
        SpecError: A name in the spec (model, dataset, kwargs) turned out not to build.
        Exception: Anything the training code raises; the driver marks the run FAILED.
    """
    from runner.launch.environment import LauncherEnvironment
    from runner.strategies.registry import make_strategy

    strategy = make_strategy(args.loaded.spec.parallel, args.plan, LauncherEnvironment.detect())
    stop = _StopFlag()
    try:
        strategy.setup()
        stop.install()
        result = _train(args, strategy, stop)
        strategy.barrier()  # every rank is done with collectives before any destroys the group
        return result
    finally:
        stop.uninstall()
        gc.collect()  # free DDP's reducer and its pending work before the process group goes
        strategy.teardown()


def _train(args: WorkerArgs, strategy: Any, stop: _StopFlag) -> WorkerResult:
    """Build data, model and optimizer on an initialised strategy, resume if asked, and fit.

    Kept apart from :func:`run_worker` so that the model, DDP wrapper and optimizer are
    released when it returns, before the process group is destroyed.
    """
    import torch

    from runner.spec.loading import flatten_spec
    from runner.strategies.ddp import describe_unused_parameters_error, is_unused_parameters_error
    from runner.strategies.state_dicts import load_state_dict_flexible, unwrapped_state_dict
    from runner.tracking.models import log_model
    from runner.tracking.system import start_system_metrics
    from runner.tracking.trackers import make_tracker, skip_logged_steps
    from runner.training import checkpoint as ckpt
    from runner.training.data import build_datasets
    from runner.training.loaders import build_loaders
    from runner.training.loop import LoopParts, TrainState, fit
    from runner.training.models import build_model
    from runner.training.optim import amp_settings, build_loss, build_optimizer, build_scheduler, scheduler_interval
    from runner.training.seeding import capture_rng_state, restore_rng_state, seed_everything

    spec = args.loaded.spec
    spec_dir = args.loaded.path.parent
    tracker: Any = None
    monitor: Any = None
    try:
        seed_info = seed_everything(spec.seed, rank=strategy.rank, deterministic=spec.deterministic)
        run_id, log_rank, checkpoint_dir = _agree_on_run(strategy, args.run_id, args.checkpoint_dir)
        bundle = build_datasets(spec, spec_dir)
        torch.manual_seed(spec.seed)  # identical initialisation on every rank
        model = build_model(
            spec.model, spec_dir, input_shape=bundle.info.input_shape, num_classes=bundle.info.num_classes
        )
        loaders = build_loaders(spec, bundle, strategy.rank, strategy.world_size)
        wrapped = strategy.wrap(model)
        raw_model = strategy.unwrap(wrapped)
        optimizer = build_optimizer(spec.optim, raw_model.parameters())
        total_steps = len(loaders.global_batch_sizes) * spec.train.epochs
        if spec.train.max_steps is not None:
            total_steps = min(total_steps, spec.train.max_steps)
        scheduler = build_scheduler(spec.scheduler, optimizer, total_steps, spec.train.epochs)
        autocast_dtype, scaler = amp_settings(spec.train.amp, strategy.device)
        loss_fn, classification = build_loss(spec.train)
        tracker = make_tracker(
            args.tracking_uri, run_id, is_logger=strategy.rank == log_rank, flush_every_s=spec.tracking.flush_every_s
        )

        result = WorkerResult(rank=strategy.rank)
        state = TrainState()
        directory = Path(checkpoint_dir)
        auto_resume = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
        if args.resume or auto_resume:
            found = ckpt.load_latest(directory)
            if found is not None:
                payload = found.payload
                load_state_dict_flexible(raw_model, payload["model"])
                optimizer.load_state_dict(payload["optimizer"])
                if scheduler is not None and payload["scheduler"] is not None:
                    scheduler.load_state_dict(payload["scheduler"])
                if scaler is not None and payload["scaler"] is not None:
                    scaler.load_state_dict(payload["scaler"])
                state = TrainState(**payload["state"])
                rng = payload["rng"]
                if len(rng) == strategy.world_size:
                    restore_rng_state(rng[strategy.rank])
                else:
                    result.notes.append(
                        f"world size changed ({len(rng)} -> {strategy.world_size}): RNG states not restored"
                    )
                result.resumed_from = str(found.path)
                tracker = skip_logged_steps(tracker, args.tracking_uri, run_id)
                result.notes += [f"skipped {reason}" for _, reason in found.skipped]
            elif args.resume:
                result.notes.append(f"no checkpoint in {directory}: starting from step 0")

        spec_flat = flatten_spec(spec)  # the same for every checkpoint of this run

        def on_checkpoint(st: TrainState, reason: str) -> None:
            rng_states = strategy.all_gather_object(capture_rng_state())
            if strategy.rank == log_rank and spec.checkpoint.enabled:
                payload = ckpt.build_payload(
                    model_state=unwrapped_state_dict(wrapped),
                    optimizer=optimizer,
                    scheduler=scheduler,
                    scaler=scaler,
                    state=st,
                    rng_states=rng_states,
                    spec_flat=spec_flat,
                    spec_sha256=args.loaded.sha256,
                    run_id=run_id,
                )
                ckpt.save_checkpoint(directory, payload, spec.checkpoint.keep_last)
                # Metrics up to a checkpoint must be in MLflow before training goes on: a restart
                # resumes from the checkpoint and only re-logs what comes after it.
                tracker.flush()
            strategy.barrier()

        parts = LoopParts(
            model=wrapped,
            strategy=strategy,
            optimizer=optimizer,
            scheduler=scheduler,
            scheduler_interval=scheduler_interval(spec.scheduler),
            loss_fn=loss_fn,
            loaders=loaders,
            tracker=tracker,
            scaler=scaler,
            autocast_dtype=autocast_dtype,
            classification=classification,
            on_checkpoint=on_checkpoint,
            should_stop=stop.is_set,
            sync_timing=args.sync_timing,
        )
        if spec.deterministic:
            settings = ", ".join(f"{k}={v}" for k, v in seed_info.deterministic_settings.items())
            result.notes.append(f"deterministic mode: {settings}")
            tracker.set_tags({"runner.deterministic_settings": settings})
        for note in result.notes:
            if strategy.rank == log_rank:
                print(f"runner: {note}", flush=True)
        is_logger = strategy.rank == log_rank and run_id is not None
        if is_logger and spec.tracking.system_metrics:
            monitor = start_system_metrics(args.tracking_uri, run_id, resumed=result.resumed_from is not None)
        try:
            fit_result = fit(parts, spec.train, state, spec.checkpoint if spec.checkpoint.enabled else None)
        except RuntimeError as exc:
            if is_unused_parameters_error(exc):
                raise describe_unused_parameters_error(exc, raw_model) from None
            raise
        if is_logger and spec.checkpoint.enabled and spec.checkpoint.log_to_mlflow:
            saved = ckpt.list_checkpoints(directory)
            if saved:
                tracker.log_artifact(str(saved[-1]), "checkpoints")
        if is_logger and spec.tracking.log_model:
            tracker.flush()
            log_model(args.tracking_uri, run_id, raw_model, bundle.train[0][0].unsqueeze(0))
        result.metrics = fit_result.metrics
        result.global_step = fit_result.state.global_step
        result.history = fit_result.history
        result.step_times_s = fit_result.step_times_s
        result.data_wait_s = fit_result.data_wait_s
        result.peak_memory_bytes = _peak_memory_bytes(strategy.device)
        result.device = str(strategy.device)
        return result
    finally:
        if monitor is not None:
            monitor.finish()
        if tracker is not None:
            tracker.close()


def _agree_on_run(strategy: Any, local_run_id: str | None, local_dir: str) -> tuple[str | None, int, str]:
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


def _peak_memory_bytes(device: Any) -> int:
    """CUDA allocator peak of ``device``, else this process's peak resident set size (bytes)."""
    import torch

    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return peak_rss_bytes() or 0


def peak_rss_bytes() -> int | None:
    """Peak resident set size of this process image, bytes (``VmHWM``; Linux only, else ``None``).

    Unlike ``getrusage().ru_maxrss``, ``VmHWM`` starts afresh at ``exec``: a ``spawn``-ed worker
    does not inherit the peak of the process that started it.
    """
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


class _StopFlag:
    """SIGINT/SIGTERM handler: the first signal asks the loop to stop after the current step.

    A second SIGINT more than one second after the first raises ``KeyboardInterrupt`` at once
    (a terminal Ctrl-C reaches the launcher and every worker together, and the launcher
    forwards it again, so signals within one second count as one).
    """

    def __init__(self) -> None:
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

    def _handle(self, signum: int, frame: Any) -> None:
        import time

        now = time.monotonic()
        if self._first is not None and signum == signal.SIGINT and now - self._first > 1.0:
            raise KeyboardInterrupt
        if self._first is None:
            self._first = now
            self.signum = signum
        self._event.set()


__all__ = ["Interrupted", "WorkerArgs", "WorkerResult", "run_worker"]

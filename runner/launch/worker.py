"""One training process: make the strategy and the tracker, then run the setup steps and the loop.

``run_worker`` is the function the elastic launcher starts once per rank (it must be
importable and its argument picklable); for ``none`` and ``dp`` the driver calls it in
its own process. It never launches processes and never ends the MLflow run: the driver
owns the run (docs/design.md §6) and sets its final status. The worker reads the launcher's
environment once (``runner.devices.environment.LauncherEnvironment``), makes the
tracker (MLflow lives in ``runner.tracking``, never in ``runner.training``) and calls
the named steps of ``runner.training.setup``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pickle
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from runner.devices.environment import LauncherEnvironment
from runner.errors import RunnerError, SpecError, TrainingError, show_notes, stop_code, user_code_error
from runner.launch import channel
from runner.launch.channel import ChannelTracker, HandedRun, HubAddress, Link
from runner.launch.failures import HangWatch, die_with_parent

if TYPE_CHECKING:
    from runner.devices.resolve import DevicePlan
    from runner.spec.loading import LoadedSpec
    from runner.spec.schema import ExperimentSpec
    from runner.strategies.base import Strategy
    from runner.tracking.trackers import Tracker
    from runner.training import WorkerResult
    from runner.training.data import DatasetBundle
    from runner.training.loop import LoopParts, TrainingParts
    from runner.training.setup import Restored


@dataclass(frozen=True)
class WorkerArgs:
    """Everything a worker needs, picklable for the worker's process.

    ``run_id`` exists before the workers only outside ``runner exec``; ``hub`` is where rank 0 reports the build and
    receives the run, checkpoint folder and resume flag that replace those fields (``None``: bench, no driver);
    ``launcher_pid`` is the process the worker dies with; ``report_dir`` takes hang reports; ``epoch_end`` runs on the
    logging rank and every rank follows."""

    loaded: LoadedSpec
    plan: DevicePlan
    run_id: str | None
    checkpoint_dir: str
    resume: bool = False
    sync_timing: bool = False
    epoch_end: Callable[[int, dict[str, float]], bool] | None = None
    launcher_pid: int | None = None
    report_dir: str | None = None
    hub: HubAddress | None = None
    dtype: str | None = None
    nudge: bool = False
    started_at: float | None = None


def torchrun_env(
    rank: int,
    world_size: int,
    port: str,
    *,
    address: str = "127.0.0.1",
    local: tuple[int, int] | None = None,
    node_rank: int = 0,
) -> dict[str, str]:
    """The variables torchrun gives the worker of global ``rank``: what :class:`LauncherEnvironment` reads back.

    The one place these variables are written (a Slurm per-device task and bench's warm ranks set them; the elastic
    agent sets them for the workers it starts). ``local`` is ``(local rank, workers on this node)``, by default the
    global ones (one node).
    """
    local_rank, local_size = (rank, world_size) if local is None else local
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(local_rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(local_size),
        "GROUP_RANK": str(node_rank),
        "MASTER_ADDR": address,
        "MASTER_PORT": port,
    }


def run_worker(args: WorkerArgs) -> WorkerResult | None:
    """Train one rank to the end or a stop signal; the rank's result, or ``None`` when the driver made no run.

    Raises Interrupted after a checkpoint on SIGINT/SIGTERM, SpecError for a part that did not build."""
    from runner.devices.resolve import apply_threads
    from runner.strategies import make_strategy

    apply_threads(args.plan)  # one rule for every mode, before any work (docs/design.md §4)
    env = LauncherEnvironment.detect()  # the one read of the launcher's variables in a worker
    if env.external or args.launcher_pid is not None:  # a process of its own: it dies with the one that started it
        die_with_parent(args.launcher_pid)
    strategy = make_strategy(args.loaded.spec.parallel, args.plan, env, args.loaded.spec.train.amp)
    stop = _StopFlag(announce=env.rank == 0, rank=env.rank)
    grace_s = args.loaded.spec.parallel.hang_grace_s
    watch = HangWatch(env.rank, args.report_dir, grace_s) if env.external else None
    link = Link(args.hub) if args.hub is not None and env.rank == 0 else None
    try:
        strategy.setup()
        stop.install()
        if watch is not None:
            watch.start()
        try:
            result = _train(args, strategy, env, stop, link)
        except RunnerError:
            raise
        except Exception as exc:  # an error in the user's model, data, loss or metric: their file and line
            located = user_code_error(exc)
            if located is None:
                raise
            raise located from exc
        strategy.barrier()  # every rank is done with collectives before any destroys the group
        if link is not None and result is not None:
            link.send(channel.Result(dataclasses.asdict(result)))
        return result
    except BaseException as exc:
        if link is not None:
            _report_failure(link, exc)
        raise
    finally:
        if watch is not None:
            watch.stop()
        stop.uninstall()
        strategy.teardown()
        if link is not None:
            link.close()


def _train(
    args: WorkerArgs, strategy: Strategy, env: LauncherEnvironment, stop: _StopFlag, link: Link | None
) -> WorkerResult | None:
    """Build, report, resume, fit, send; its own frame frees the parts before the group goes (``None``: no run)."""
    from runner.tracking.trackers import NullTracker
    from runner.training import setup
    from runner.training.data import seed_everything

    spec = args.loaded.spec
    seeded = seed_everything(spec.seed, deterministic=spec.deterministic)
    parts, handed = _build_and_report(args, strategy, link)
    if parts is None:
        return None
    folder, is_log_rank = Path(handed.checkpoint_dir), strategy.rank == 0
    restored = setup.restore(parts, strategy, folder, resume=handed.resume, restarted=env.restarted)
    tracker: Tracker = NullTracker()
    if link is not None:
        resumed = restored.resumed_from is not None
        continuing = handed.resume or env.restarted
        restored.notes += link.ask(channel.Restored(restored.metrics_recorded, resumed, continuing))
        tracker = ChannelTracker(link)
    return _fit(args, strategy, parts, restored, tracker, handed, seeded, stop, is_log_rank)


def _fit(
    args: WorkerArgs,
    strategy: Strategy,
    parts: TrainingParts,
    restored: Restored,
    tracker: Tracker,
    handed: HandedRun,
    seeded: dict[str, str],
    stop: _StopFlag,
    is_log_rank: bool,
) -> WorkerResult:
    """Train on built and restored parts, then send the outputs and the result (rank 0)."""
    from runner.training import flops_uncounted, setup
    from runner.training.callbacks import CallbackContext
    from runner.training.loop import LoopParts

    spec, folder = args.loaded.spec, Path(handed.checkpoint_dir)
    try:
        notes = _announce(spec, parts, restored, tracker, seeded, is_log_rank)
        checkpointer = setup.Checkpointer(
            parts, strategy, folder, args.loaded, run_id=handed.run_id, writer=is_log_rank, tracker=tracker
        )
        epoch_end = _agreed_epoch_end(args.epoch_end, strategy, is_log_rank)
        if parts.callbacks is not None:
            files = folder / "callbacks" / f"rank{strategy.rank}"
            parts.callbacks.ctx = CallbackContext(strategy.rank, parts.raw_model, tracker, files)
        loop = LoopParts(
            **vars(parts),
            strategy=strategy,
            tracker=tracker,
            on_checkpoint=checkpointer,
            should_stop=stop.code,
            sync_timing=args.sync_timing,
            epoch_end=epoch_end,
            started_at=args.started_at,
            count_flops=flops_uncounted(spec, args.sync_timing) is None,
        )
        try:
            with setup.profiled(loop, spec, folder) as loop:
                fitted = setup.train(loop, spec, restored.state)
        except BaseException:
            with contextlib.suppress(Exception):  # the failure or stop is what the run ends with
                checkpointer.wait()
            raise
        checkpointer.wait()  # the last background save is in place before the run ends
        fitted = _final_model(args, loop, fitted, folder)
        if is_log_rank:
            _send_outputs(args, tracker, loop, folder, fitted.global_step)
        ended = [why for why in (fitted.stop_reason, setup.describe_best(fitted.best)) if why]
        if is_log_rank:
            show_notes(ended)
        result = setup.finish(fitted, strategy, notes + ended + setup.profile_notes(spec, strategy.rank, folder))
    finally:
        tracker.close()
    return result


def _announce(
    spec: ExperimentSpec,
    parts: TrainingParts,
    restored: Restored,
    tracker: Tracker,
    seeded: dict[str, str],
    is_log_rank: bool,
) -> list[str]:
    """Before training: the notes so far (restore, deterministic settings), said once by the logging rank, which
    also sends a new run's data for the driver to record as dataset inputs. Returns the notes."""
    from runner.training import setup

    notes = list(restored.notes)
    if spec.deterministic:
        settings = setup.describe_settings(seeded)
        notes.append(f"deterministic mode: {settings}")
        tracker.set_tags({"runner.deterministic_settings": settings})
    if is_log_rank:  # parity and sweeps train several runs in one process: a note is said once
        show_notes([note for note in notes if note not in _SHOWN_NOTES])
        _SHOWN_NOTES.update(note for note in notes if note.startswith("deterministic mode: "))
    if is_log_rank and restored.resumed_from is None and parts.data is not None:
        fields = ["name", "num_train", "train_digest", "num_val", "val_digest", "num_test", "test_digest", "source"]
        fields += ["input_shape", "val_split_sha256", "split"]
        tracker.send(channel.Data({name: getattr(parts.data, name) for name in fields}))
    return notes


def _final_model(args: WorkerArgs, loop: LoopParts, fitted: WorkerResult, folder: Path) -> WorkerResult:
    """The result with ``checkpoint.monitor``'s best checkpoint, and the final model: the best checkpoint's weights
    when there is one, their moving average with ``train.ema_decay``. It is scored on the test split (``test/*``,
    logged at the step of the weights scored, as ``runner test`` logs them) and made whole for the logged model (a
    collective where it is sharded)."""
    from runner.training import setup
    from runner.training.loop import evaluate

    spec = args.loaded.spec
    strategy = loop.strategy
    best = setup.best_checkpoint(spec, folder, strategy)
    if best is not None:
        fitted = dataclasses.replace(fitted, best=setup.best_record(spec, best))
    if not spec.tracking.log_model and loop.loaders.test is None:
        return fitted
    if best is not None:
        setup.load_weights(loop, strategy, best)
    if loop.ema is not None:
        loop.ema.copy_to_model()
    if loop.loaders.test is not None:
        scored = evaluate(loop, "test")
        loop.tracker.log_metrics(scored, step=fitted.best[2] if fitted.best is not None else fitted.global_step)
        fitted = dataclasses.replace(fitted, metrics={**fitted.metrics, **scored})
    if spec.tracking.log_model:
        loop.raw_model = strategy.full_module(loop.model)
    return fitted


def _build_and_report(
    args: WorkerArgs, strategy: Strategy, link: Link | None
) -> tuple[TrainingParts | None, HandedRun]:
    """Build on every rank, agree, and rank 0 reports to the driver, which then makes the run: ``(parts, handed)``."""
    from runner.launch.prebuild import difference_notes
    from runner.training import setup

    spec = args.loaded.spec
    spec_dir = args.loaded.path.parent
    parts, (notes, bundle, spec_error, failure) = None, _check_or_load(args, strategy)
    first_error = next((e for e in strategy.all_gather_object(spec_error) if e is not None), None)
    if first_error is None and failure is None:
        try:
            parts = setup.build_parts(spec, spec_dir, strategy, dtype=args.dtype, nudge=args.nudge, bundle=bundle)
            if strategy.rank == 0:  # a factory's model is first built here: its random layers are named now
                notes += [note for note in difference_notes(parts.raw_model, spec) if note not in notes]
        except SpecError as exc:
            spec_error = exc
        except Exception as exc:
            failure = exc
    if first_error is None:
        first_error = next((e for e in strategy.all_gather_object(spec_error) if e is not None), None)
    handed = HandedRun(args.run_id, args.checkpoint_dir, args.resume)
    if link is not None:
        handed = link.ask(channel.Built(first_error, notes))
    handed = strategy.all_gather_object(handed)[0]
    if first_error is not None and args.hub is None and strategy.rank == 0:
        raise first_error  # no driver to report it to (runner bench's own processes)
    if handed.abort or first_error is not None:
        return None, handed
    if failure is not None:
        raise failure
    return parts, handed


def _check_or_load(
    args: WorkerArgs, strategy: Strategy
) -> tuple[list[str], DatasetBundle | None, SpecError | None, Exception | None]:
    """Rank 0 checks what needs no build while the others load data: ``(notes, datasets, spec error, failure)``."""
    from runner.launch.prebuild import check_parts
    from runner.training.data import build_datasets
    from runner.training.losses import check_objectives

    try:
        if strategy.rank == 0:  # loss and metrics, then every part by build or signature
            check_objectives(args.loaded.spec, args.loaded.path.parent)
            return *check_parts(args.loaded, strategy.world_size), None, None
        return [], build_datasets(args.loaded.spec, args.loaded.path.parent), None, None
    except SpecError as exc:
        return [], None, exc, None
    except Exception as exc:
        if strategy.rank == 0:
            raise
        return [], None, None, exc


def _report_failure(link: Link, exc: BaseException) -> None:
    """Tell the driver what rank 0 failed of: runner's own exception itself when it crosses a pipe, any other as a
    TrainingError with its type and text. The driver imports no torch: torch's ``InductorError`` (no C++ compiler
    under ``train.compile``) did not unpickle there, and the run failed as "exited without a Python error"."""
    text = TrainingError(f"{type(exc).__name__}: {exc}")
    error = exc if isinstance(exc, (RunnerError, KeyboardInterrupt)) else text
    try:
        pickle.loads(pickle.dumps(error))  # some exceptions pickle but do not unpickle (a custom __init__)
    except Exception:
        error = text
    with contextlib.suppress(OSError, ValueError):
        link.send(channel.Failed(error))


def _send_outputs(args: WorkerArgs, tracker: Tracker, parts: TrainingParts, folder: Path, step: int) -> None:
    """On the logging rank: the last checkpoint and the trained model, for the driver to upload as the spec asks."""
    from runner.training.checkpoint import list_checkpoints
    from runner.training.models import resolve_data_refs

    spec = args.loaded.spec
    if spec.checkpoint.enabled and spec.checkpoint.log_to_mlflow:
        saved = list_checkpoints(folder)
        if saved:
            newest = saved[-1]  # a folder: its files go under its name
            tracker.log_artifact(str(newest), f"checkpoints/{newest.name}")
    if spec.profile is not None and (folder / "profile").is_dir():  # every profiled rank's, on one filesystem
        tracker.log_artifact(str(folder / "profile"), "profile")
    if spec.tracking.log_model and args.hub is not None:  # a driver to log it: save the model for it
        import torch

        stats = parts.data.normalization if parts.data is not None else None
        example = parts.example_input()
        if stats is not None:  # the model takes samples before normalisation; it normalises them itself
            example = example * stats[1] + stats[0]
        example = {k: v.cpu() for k, v in example.items()} if isinstance(example, dict) else example.cpu()
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f".model-{os.getpid()}.pt"
        info = parts.data  # what the driver's build of the model needs, as the ranks' build had it
        built = {"input_shape": list(info.input_shape), "num_classes": info.num_classes} if info is not None else {}
        if info is not None:  # the driver builds the model as the ranks did: "${data.NAME}" values resolved
            built["kwargs"] = resolve_data_refs(spec.model.kwargs, info, parts.train_set)
        torch.save({"state": parts.raw_model.cpu().state_dict(), "example": example, **built}, path)
        try:
            tracker.flush()
            tracker.send(channel.LoggedModel(str(path), step, stats))
            tracker.flush()  # answered once the driver logged it
        finally:
            path.unlink(missing_ok=True)


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


_SHOWN_NOTES: set[str] = set()  # deterministic-mode notes this process printed already
STOPPING = "runner: stopping after this step, a checkpoint first; Ctrl-C again (a second later) stops at once\n"


class _StopFlag:
    """The first SIGINT/SIGTERM asks the loop to stop (rank 0 prints ``STOPPING``); a SIGINT 1 s on interrupts."""

    def __init__(self, announce: bool = False, rank: int = 0) -> None:
        self._announce = announce
        self._rank = rank
        self.signum = 0
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

    def code(self) -> int:
        """0, or the :func:`~runner.errors.stop_code` of the first signal and this rank (the loop's ``should_stop``)."""
        return stop_code(self.signum, self._rank) if self._first is not None else 0

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        now = time.monotonic()
        if self._first is not None and signum == signal.SIGINT and now - self._first > 1.0:
            raise KeyboardInterrupt
        if self._first is None:
            self.signum = signum  # before _first, which code() reads
            self._first = now
            if self._announce and signum == signal.SIGINT:  # a SIGTERM also comes from the launcher when a peer failed
                os.write(2, STOPPING.encode())  # not print(): the main thread may be inside a write to stderr

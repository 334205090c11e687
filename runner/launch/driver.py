"""Driver of ``runner exec``: owns the MLflow run, starts the workers, sets the final status.

The driver is the process that launches (docs/design.md, "run ownership"):

* ``none`` / ``dp``: the worker runs in the driver's own process;
* ``ddp``: the driver starts ``nproc_per_node`` workers through torch's elastic launcher
  (``torch.distributed.launcher.api.elastic_launch``, the machinery behind ``torchrun``)
  with a c10d rendezvous (``localhost:0`` on one node: the OS picks a free port);
* started by ``torchrun`` or a scheduler (``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` set):
  this process is a worker and launches nothing; rank 0 owns the run;
* a task of a Slurm job step (docs/design.md §15): one task per device is a worker (its
  torchrun variables are set from Slurm's), one task per node is its node's elastic launcher
  (rendezvous on the first host of the node list); either way the job has one run, tagged
  ``runner.slurm.job_id``, and a requeued job (``SLURM_RESTART_COUNT > 0``) resumes it from
  its last checkpoint.

Whatever happens, the run ends FINISHED, FAILED (with the error) or KILLED in ``finally``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from runner.errors import Interrupted, SpecError, TrainingError, mask_secrets
from runner.spec.loading import relocate_issues

if TYPE_CHECKING:  # pragma: no cover
    from runner.launch.ending import Spooled
    from runner.launch.failures import HangReports
    from runner.launch.handoff import Handoff
    from runner.launch.worker import WorkerArgs, WorkerResult
    from runner.plan import Plan
    from runner.spec.loading import LoadedSpec


@dataclass(frozen=True)
class ExecOptions:
    """Command-line options of ``runner exec`` beyond the spec.

    Attributes:
        run_name: MLflow run name (overrides ``tracking.run_name``).
        resume: Run id to continue, ``"last"`` for the newest run of the experiment, or ``None``.
        allow_spec_change: Dotted keys that may differ from the resumed run's spec.
        parent_run_id: Make the run a child of this run (``mlflow.parentRunId``), for sweeps and bench.
        tags: Extra MLflow tags for the run.
        sync_timing: Exact per-step timing on CUDA (``runner bench``).
        nested: Allow starting while an MLflow fluent run is active in this process (the new
            run becomes its child); without it that is an error.
        tracking_uri: The store to use instead of the spec's (``runner resume`` and ``reproduce``
            use the store the run was found in).
        environ: The environment the plan is made against (default ``os.environ``); a sweep
            passes its own without Slurm's variables, so that a trial is never a Slurm job's run.
        epoch_end: Called on every rank after each epoch as ``epoch_end(epoch, metrics)``; True
            stops training after that epoch (a sweep's pruner). Must be picklable for ddp.
        dtype: ``"float64"`` trains the model, its inputs and its loss in that dtype (``runner parity``);
            ``None``: as built (float32).
        nudge: Nudge every initial weight up by one ulp of its dtype (``runner parity``'s control).
    """

    run_name: str | None = None
    resume: str | None = None
    allow_spec_change: tuple[str, ...] = ()
    parent_run_id: str | None = None
    tags: tuple[tuple[str, str], ...] = ()
    sync_timing: bool = False
    nested: bool = False
    tracking_uri: str | None = None
    environ: Mapping[str, str] | None = None
    epoch_end: Callable[[int, dict[str, float]], bool] | None = None
    dtype: str | None = None
    nudge: bool = False


@dataclass
class ExecResult:
    """Outcome of ``runner exec``.

    Attributes:
        run_id: The MLflow run (``None`` when tracking is off).
        status: ``FINISHED`` (failures raise instead).
        metrics: Final metrics from the logging rank.
        tracking_uri: Where the run is stored.
        experiment: MLflow experiment name.
        checkpoint_dir: Folder of the run's checkpoints.
        history: ``(step, metrics)`` pairs from the logging rank.
        notes: Messages for the user (devices, resume, skipped checkpoints).
        workers: Every rank's result on this node, by rank.
        rank: Global rank of this process (0 unless a launcher started it as one worker of a job).
        notes_shown: The notes were printed before training, so :meth:`summary` does not repeat them.
        spooled: Metric values (and whether the final status) that could not reach the tracking
            store and wait in the run's spool file (docs/design.md §12).
    """

    run_id: str | None
    status: str
    metrics: dict[str, float]
    tracking_uri: str | None
    experiment: str
    checkpoint_dir: str
    history: list[tuple[int, dict[str, float]]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    workers: list[WorkerResult] = field(default_factory=list)
    rank: int = 0
    notes_shown: bool = False
    spooled: Spooled | None = None

    def summary(self) -> str:
        """What ``runner exec`` prints: notes, status, run id, final metrics, how to open the MLflow UI.

        Returns:
            The lines, joined; empty on ranks other than 0 (one process of a job reports).
        """
        if self.rank != 0:
            return ""
        lines = [] if self.notes_shown else [f"note: {note}" for note in self.notes]
        lines.append(f"status: {self.status}" + (self.spooled.describe(self.run_id) if self.spooled else ""))
        if self.run_id:
            lines.append(f"run id: {self.run_id}  (experiment {self.experiment!r})")
        width = max([21, *(len(key) for key in self.metrics)])  # long custom metric names stay aligned
        lines += [f"  {key:<{width}}  {self.metrics[key]:.6g}" for key in sorted(self.metrics)]
        if self.tracking_uri:
            lines.append(f"open the UI: mlflow ui --backend-store-uri {self.tracking_uri}")
        return "\n".join(lines)


def exec_experiment(loaded: LoadedSpec, options: ExecOptions = ExecOptions()) -> ExecResult:
    """Run the experiment of ``loaded`` to the end and record it in MLflow.

    Args:
        loaded: The validated spec.
        options: See :class:`ExecOptions`.

    Returns:
        The :class:`ExecResult` of a FINISHED run.

    Raises:
        SpecError, DeviceError, UsageError, TrackingError: before any training (exit 2);
            no MLflow run is left behind.
        TrainingError: training failed on some rank; the run is FAILED (exit 1).
        Interrupted: stopped by SIGINT/SIGTERM after a checkpoint; the run is KILLED (exit 130).
    """
    from runner.launch.ending import Spooled
    from runner.launch.handoff import Handoff
    from runner.launch.prepare import NOT_YET, Prepared, apply_plan_env, prepare, worker_args
    from runner.plan import make_plan

    plan = make_plan(loaded, env=options.environ, tracking_uri=options.tracking_uri)
    if plan.launch == "elastic":  # the workers start while the driver checks the parts and creates the run
        apply_plan_env(plan)
        made: list[Prepared] = []

        def prepare_run(go_on: Callable[[], None]) -> WorkerArgs:
            made.append(prepare(plan, options, go_on))
            return worker_args(plan, options, made[0])

        workers = _run_to_the_end(plan, worker_args(plan, options, NOT_YET), None, Handoff(prepare_run))
        ready = made[0]
    else:
        ready = prepare(plan, options)
        apply_plan_env(plan)
        workers = _run_to_the_end(plan, worker_args(plan, options, ready), ready.run_id)
    result, run_id = workers[0], ready.run_id
    resume_notes = ready.resume.notes if ready.resume else []
    return ExecResult(
        spooled=Spooled.of(ready.checkpoint_dir) if run_id is not None and plan.owns_run else None,
        run_id=run_id,
        status="FINISHED",
        metrics=result.metrics,
        tracking_uri=plan.tracking_uri,
        experiment=plan.experiment,
        checkpoint_dir=ready.checkpoint_dir,
        history=result.history,
        notes=plan.notes + resume_notes + result.notes,
        workers=sorted(workers, key=lambda w: w.rank),
        rank=ready.rank,
        notes_shown=ready.shown,
    )


def show_notes(notes: list[str]) -> None:
    """Print each note as ``runner: note: ...`` on standard error, before training (docs/design.md §10).

    Standard output carries the run's summary (and ``--json`` reports); notes are for the person watching.
    """
    for note in notes:
        print(f"runner: note: {mask_secrets(note)}", file=sys.stderr, flush=True)


def _run_to_the_end(
    plan: Plan, args: WorkerArgs, run_id: str | None, handoff: Handoff | None = None
) -> list[WorkerResult]:
    """Launch the workers and end the run with their outcome, when this process owns it (``args.run_id``).

    ``run_id`` is the job's run, named in the interrupt hint on every rank. With a ``handoff`` the
    driver's checks and the run are still being made on its thread while the workers start: its
    failure is this job's error, and the run it made (if any) is the one ended here.

    Raises:
        Interrupted: SIGINT/SIGTERM; the run ends KILLED.
        SpecError: A name or kwarg that only fails when built; the new run is deleted (a resumed
            one ends FAILED), so no stray run is left.
        TrainingError: Any other failure; the run ends FAILED with the cause.
    """
    from runner.launch.elastic import is_signal, spec_error_of_child
    from runner.launch.ending import end_run_or_spool
    from runner.launch.failures import JobContext, describe_failure, oom_kill_count
    from runner.tracking import runs as tracking

    loaded = plan.loaded
    status, error = "FAILED", None
    oom_before = oom_kill_count()
    hangs: HangReports = {}
    try:
        workers = _launch(plan, args, hangs, handoff)
        if handoff is not None:
            args, run_id = _handed(handoff, args)
        status = "FINISHED"
        return workers
    except (Interrupted, KeyboardInterrupt) as exc:
        status = "KILLED"
        if handoff is not None:
            args = handoff.finish() or args
            run_id = args.run_id
        raise _interrupted(getattr(exc, "signum", 2), plan, run_id, args.checkpoint_dir, hangs) from None
    except _PreparationFailed as failed:
        status, args = "DELETE", failed.made or args
        raise failed.error from None
    except Exception as exc:
        if handoff is not None:
            try:
                args, run_id = _handed(handoff, args, failed=True)
            except _PreparationFailed as failed:  # a bad spec, which the workers also met
                raise failed.error from None
        if is_signal(exc):
            status = "KILLED"
            raise _interrupted(getattr(exc, "sigval", 15), plan, run_id, args.checkpoint_dir, hangs) from None
        bad_spec = exc if isinstance(exc, SpecError) else spec_error_of_child(exc)
        if bad_spec is not None:
            # A kwarg or name that only fails when built: still a bad spec (exit 2), and the run
            # made for it is removed so that no stray run is left behind.
            status = "DELETE"
            raise relocate_issues(bad_spec, loaded) from None
        error = describe_failure(exc, JobContext(loaded.spec.parallel.timeout_s, oom_before, hangs))
        raise TrainingError(error) from None
    finally:
        owned, uri = args.run_id, plan.tracking_uri
        if owned is not None and uri is not None:
            if status == "DELETE" and not args.resume:
                tracking.delete_run(uri, owned)
            else:
                end_run_or_spool(uri, owned, "FAILED" if status == "DELETE" else status, error, args.checkpoint_dir)


class _PreparationFailed(Exception):
    """The driver's checks or its creation of the run failed while the workers started (they trained nothing)."""

    def __init__(self, error: BaseException, made: WorkerArgs | None) -> None:
        super().__init__(str(error))
        self.error, self.made = error, made


def _handed(handoff: Handoff, args: WorkerArgs, failed: bool = False) -> tuple[WorkerArgs, str | None]:
    """The workers' arguments and the run once the driver's preparation is over (a run not made yet never is).

    Raises:
        _PreparationFailed: The preparation failed; with ``failed`` (the workers failed too) only when it
            found a bad spec, which is then the job's error (exit 2) rather than what a worker made of it.
    """
    from runner.launch.handoff import Cancelled

    made = handoff.finish()
    error = handoff.error
    if error is not None and not isinstance(error, Cancelled) and (not failed or isinstance(error, SpecError)):
        raise _PreparationFailed(error, made)
    return (made or args), (made.run_id if made is not None else None)


def _interrupted(
    signum: int, plan: Plan, run_id: str | None, folder: str = "", hangs: HangReports | None = None
) -> Interrupted:
    """The interruption, with the checkpoint that exists and the command that continues the run."""
    from runner.launch.resume import resume_command

    uri = plan.tracking_uri
    command = resume_command(run_id, uri) if run_id is not None and uri is not None else None
    return Interrupted(int(signum), run_id=run_id, command=command, checkpoint=checkpoint_note(folder, hangs or {}))


def checkpoint_note(folder: str, hangs: HangReports) -> str:
    """Which checkpoint a stopped job left: the stop's own, or (a rank hung before writing it) an older one or none."""
    from pathlib import Path

    from runner.training.checkpoint import list_checkpoints

    saved = list_checkpoints(Path(folder)) if folder else []
    newest = saved[-1].name if saved else None
    if hangs:
        ranks = ", ".join(str(rank) for rank in sorted(hangs))
        older = f"the newest is {newest}, from before the stop" if newest else "the run has none"
        return f"no checkpoint was written at the stop (rank {ranks} hung first); {older}"
    return f"a checkpoint was written at the stop ({newest})" if newest else "it has no checkpoint"


def _launch(
    plan: Plan, args: WorkerArgs, hangs: HangReports | None = None, handoff: Handoff | None = None
) -> list[WorkerResult]:
    """Run the workers; return their results, the logging rank's first.

    ``hangs`` receives the reports of ranks that hung after a stop signal (elastic launch only).
    """
    from runner.launch.worker import run_worker

    if plan.launch == "elastic":
        from runner.launch.elastic import launch_elastic

        return launch_elastic(plan, args, hangs, handoff)
    result = run_worker(args)
    if result is None:  # torch's @record turns a worker's sys.exit(0) into None
        raise TrainingError("the worker exited without a result (sys.exit(0) during training)")
    return [result]

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

import dataclasses
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from runner.errors import Interrupted, SpecError, SpecIssue, TrainingError
from runner.spec.loading import relocate_issues

if TYPE_CHECKING:  # pragma: no cover
    from runner.launch.ending import Spooled
    from runner.launch.failures import JobContext
    from runner.launch.resume import ResumePoint
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
        lines += [f"  {key:<22} {self.metrics[key]:.6g}" for key in sorted(self.metrics)]
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
    from runner.devices.env import apply_device_env
    from runner.launch.ending import Spooled
    from runner.launch.prebuild import check_checkpoint_folder, check_parts
    from runner.launch.resume import prepare_resume
    from runner.launch.worker import WorkerArgs
    from runner.plan import make_plan
    from runner.tracking.lookup import set_run_tags
    from runner.tracking.store import open_store
    from runner.training.checkpoint import default_checkpoint_dir

    plan = make_plan(loaded, env=options.environ, tracking_uri=options.tracking_uri)
    spec = loaded.spec
    _check_objectives(loaded)
    check_parts(loaded, plan.devices.world_size)
    check_checkpoint_folder(loaded, plan.tracking_uri)
    owner = plan.owns_run
    uri = plan.tracking_uri
    if uri is not None:
        open_store(uri)  # reachable, writable; a new sqlite store is created under its lock
    resume = prepare_resume(plan, options) if options.resume is not None else _requeued_run(plan, owner)
    apply_device_env(plan.devices)
    if plan.slurm is not None and plan.slurm.kind == "per-device":
        os.environ.update(plan.slurm.worker_env(os.environ))  # this task is now the worker torchrun would start
    rank = plan.launcher.rank if plan.launch == "external" else 0
    shown = rank == 0 and options.parent_run_id is None  # a sweep's or bench's trials report to their tool
    if shown:  # before training, where the user looks first; workers print their own notes
        show_notes([*plan.notes, *(resume.notes if resume else [])])
    run_id = _open_run(plan, options, owner, resume)
    # Checkpoints are keyed by run id; ranks without one (other nodes, tracking off) adopt the
    # logging rank's folder once the process group exists (see runner.launch.worker).
    run_key = run_id or f"local-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    checkpoint_dir = default_checkpoint_dir(uri, spec.checkpoint.dir, run_key)
    args = WorkerArgs(
        loaded=loaded,
        plan=plan.devices,
        run_id=run_id if owner else None,
        tracking_uri=uri,
        checkpoint_dir=str(checkpoint_dir),
        resume=resume is not None or _requeued(plan),
        sync_timing=options.sync_timing,
        epoch_end=options.epoch_end,
    )
    if run_id is not None and owner and uri is not None:  # where the run's checkpoints and spool are
        set_run_tags(uri, run_id, {"runner.checkpoint_dir": str(checkpoint_dir)})
    workers = _run_to_the_end(plan, args, run_id)
    result = workers[0]
    return ExecResult(
        spooled=Spooled.of(checkpoint_dir) if run_id is not None and owner else None,
        run_id=run_id,
        status="FINISHED",
        metrics=result.metrics,
        tracking_uri=uri,
        experiment=plan.experiment,
        checkpoint_dir=str(checkpoint_dir),
        history=result.history,
        notes=plan.notes + (resume.notes if resume else []) + result.notes,
        workers=sorted(workers, key=lambda w: w.rank),
        rank=rank,
        notes_shown=shown,
    )


def _check_objectives(loaded: LoadedSpec) -> None:
    """``[loss]`` and ``[metrics]`` names import and their arguments fit, before any run exists (exit 2, FILE:LINE)."""
    from runner.training.losses import check_objectives

    try:
        check_objectives(loaded.spec, loaded.path.parent)
    except SpecError as exc:
        raise relocate_issues(exc, loaded) from None


def show_notes(notes: list[str]) -> None:
    """Print each note as ``runner: note: ...`` on standard error, before training (docs/design.md §10).

    Standard output carries the run's summary (and ``--json`` reports); notes are for the person watching.
    """
    for note in notes:
        print(f"runner: note: {note}", file=sys.stderr, flush=True)


def _open_run(plan: Plan, options: ExecOptions, owner: bool, resume: ResumePoint | None) -> str | None:
    """The MLflow run of this job: reopened on resume, handed down by the driver, or started here.

    The process that creates or reopens the run records itself as its owner (:mod:`runner.launch.owner`).

    Returns:
        The run id, or ``None`` when tracking is off or another process owns the run.
    """
    from runner.launch.owner import Owner
    from runner.tracking import runs as tracking
    from runner.tracking.lookup import set_run_tags

    if resume is not None:
        if owner:
            spec_change = json.dumps(resume.changes) if resume.changes else None
            tracking.reopen_run(resume.uri, resume.run_id, spec_change=spec_change)
            set_run_tags(resume.uri, resume.run_id, Owner.this_process().tags())  # docs/design.md §12
        return resume.run_id
    if not owner or plan.tracking_uri is None:
        return None
    if plan.launch == "external" and plan.launcher.run_id:
        return plan.launcher.run_id
    tags = {**dict(options.tags), **Owner.this_process().tags()}
    if plan.slurm is not None:
        tags[SLURM_JOB_TAG] = plan.slurm.job.job_id
    if options.parent_run_id:
        tags["mlflow.parentRunId"] = options.parent_run_id
    handle = tracking.start_run(
        plan.loaded,
        plan.describe(),
        run_name=options.run_name or plan.run_name,
        extra_tags=tags,
        uri=plan.tracking_uri,
        nested=options.nested,
    )
    return handle.run_id


SLURM_JOB_TAG = "runner.slurm.job_id"


def _requeued(plan: Plan) -> bool:
    """Whether this is a Slurm job that Slurm requeued: every rank then resumes from the run's checkpoint."""
    return plan.slurm is not None and plan.slurm.job.restart_count > 0


def _requeued_run(plan: Plan, owner: bool) -> ResumePoint | None:
    """On the run's owner of a requeued Slurm job: the job's run to continue (tag ``runner.slurm.job_id``).

    Returns:
        The run found, or ``None`` (not requeued, tracking off, another rank's run, or the job's
        first attempt ended before it created one).
    """
    from runner.launch.resume import ResumePoint, claim_run
    from runner.tracking.runs import find_run_by_tag

    if not (owner and _requeued(plan) and plan.tracking_uri is not None):
        return None
    assert plan.slurm is not None
    job = plan.slurm.job
    run_id = find_run_by_tag(plan.tracking_uri, plan.experiment, SLURM_JOB_TAG, job.job_id)
    if run_id is None:
        return None
    note = f"Slurm requeued job {job.job_id} ({job.restart_count}x): continuing its run {run_id}"
    return ResumePoint(run_id, plan.tracking_uri, {}, [note, *claim_run(plan.tracking_uri, run_id)])


def _run_to_the_end(plan: Plan, args: WorkerArgs, run_id: str | None) -> list[WorkerResult]:
    """Launch the workers and end the run with their outcome, when this process owns it (``args.run_id``).

    ``run_id`` is the job's run, named in the interrupt hint on every rank.

    Raises:
        Interrupted: SIGINT/SIGTERM; the run ends KILLED.
        SpecError: A name or kwarg that only fails when built; the new run is deleted (a resumed
            one ends FAILED), so no stray run is left.
        TrainingError: Any other failure; the run ends FAILED with the cause.
    """
    from runner.launch.ending import end_run_or_spool
    from runner.launch.failures import JobContext, oom_kill_count
    from runner.tracking import runs as tracking

    loaded = plan.loaded
    status, error = "FAILED", None
    oom_before, hangs = oom_kill_count(), dict[int, dict[str, Any]]()
    try:
        workers = _launch(plan, args, hangs)
        status = "FINISHED"
        return workers
    except (Interrupted, KeyboardInterrupt) as exc:
        status = "KILLED"
        raise _interrupted(getattr(exc, "signum", 2), plan, run_id) from None
    except Exception as exc:
        if _is_signal(exc):
            status = "KILLED"
            raise _interrupted(getattr(exc, "sigval", 15), plan, run_id) from None
        bad_spec = exc if isinstance(exc, SpecError) else _spec_error_of_child(exc)
        if bad_spec is not None:
            # A kwarg or name that only fails when built: still a bad spec (exit 2), and the run
            # made for it is removed so that no stray run is left behind.
            status = "DELETE"
            raise relocate_issues(bad_spec, loaded) from None
        error = _describe_failure(exc, JobContext(loaded.spec.parallel.timeout_s, oom_before, hangs))
        raise TrainingError(error) from None
    finally:
        owned, uri = args.run_id, plan.tracking_uri
        if owned is not None and uri is not None:
            if status == "DELETE" and not args.resume:
                tracking.delete_run(uri, owned)
            else:
                end_run_or_spool(uri, owned, "FAILED" if status == "DELETE" else status, error, args.checkpoint_dir)


def _interrupted(signum: int, plan: Plan, run_id: str | None) -> Interrupted:
    """The interruption, with the command that continues the run (``runner resume RUN_ID``)."""
    from runner.launch.resume import resume_command

    uri = plan.tracking_uri
    command = resume_command(run_id, uri) if run_id is not None and uri is not None else None
    return Interrupted(int(signum), run_id=run_id, spec=str(plan.loaded.path), command=command)


def _launch(plan: Plan, args: WorkerArgs, hangs: dict[int, dict[str, Any]] | None = None) -> list[WorkerResult]:
    """Run the workers; return their results, the logging rank's first.

    ``hangs`` receives the reports of ranks that hung after a stop signal (elastic launch only).
    """
    from runner.launch.failures import quiet_launcher_logs, read_hang_reports, restore_launcher_logs
    from runner.launch.worker import run_worker

    if plan.launch != "elastic":
        result = run_worker(args)
        if result is None:  # torch's @record turns a worker's sys.exit(0) into None
            raise TrainingError("the worker exited without a result (sys.exit(0) during training)")
        return [result]
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    par, rdzv = plan.loaded.spec.parallel, plan.rendezvous
    assert rdzv is not None  # the plan has one for every elastic launch
    config = LaunchConfig(
        min_nodes=rdzv.nnodes,
        max_nodes=rdzv.nnodes,
        nproc_per_node=plan.devices.nproc_per_node,
        run_id=rdzv.run_id,
        rdzv_backend="c10d",
        rdzv_endpoint=rdzv.endpoint or "localhost:0",
        rdzv_configs={"is_host": rdzv.node_rank == 0} if rdzv.nnodes > 1 else {},
        max_restarts=par.max_restarts,
        monitor_interval=0.1,
        start_method="spawn",
    )
    with tempfile.TemporaryDirectory(prefix="runner-elastic-") as log_dir:
        # The launcher keeps per-attempt error files here, the workers their hang reports; removed when the job ends.
        config.logs_specs = DefaultLogsSpecs(log_dir=log_dir)
        launched = dataclasses.replace(args, launcher_pid=os.getpid(), report_dir=log_dir)
        quiet = quiet_launcher_logs()
        try:
            results = elastic_launch(config, run_worker)(launched)
        finally:
            restore_launcher_logs(quiet)
            if hangs is not None:
                hangs.update(read_hang_reports(Path(log_dir)))
    done = [r for r in results.values() if r is not None]
    done.sort(key=lambda r: (not r.metrics, r.rank))
    return done


def _is_signal(exc: BaseException) -> bool:
    return type(exc).__name__ == "SignalException"


def _spec_error_of_child(exc: BaseException) -> SpecError | None:
    """The SpecError a DDP worker raised while building, recovered from the launcher's failure record."""
    marker = "runner.errors.SpecError: "
    for failure in (getattr(exc, "failures", None) or {}).values():
        data = getattr(failure, "error_file_data", None) or {}
        inner = data.get("message", {}) if isinstance(data, dict) else {}
        trace = inner.get("extraInfo", {}).get("py_callstack", "") if isinstance(inner, dict) else ""
        if marker in trace:
            text = trace.rsplit(marker, 1)[1].strip()
            issues = []
            for line in text.splitlines():
                key, sep, message = line.partition(": ")
                issues.append(
                    SpecIssue(None, None, key, message) if sep and " " not in key else SpecIssue(None, None, "", line)
                )
            return SpecError(issues)
    return None


def _describe_failure(exc: BaseException, context: JobContext) -> str:
    """A readable message for a failed job: the root rank's error, or the signal or exit code that ended it."""
    from runner.launch.failures import describe_failure

    return describe_failure(exc, context)

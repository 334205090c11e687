"""What the driver does before its workers train: check the spec's parts, open the store, create or reopen the run.

:func:`prepare` runs the checks that must pass before a run exists (a bad spec exits 2 and leaves
no run, docs/design.md §1), then opens the run (:func:`open_run`). For ``none`` and ``dp`` the
driver calls it before training in its own process; for ``ddp`` on a thread while the workers
start (:mod:`runner.launch.handoff`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from runner.errors import SpecError, SpecIssue, TrackingError
from runner.spec.loading import relocate_issues

if TYPE_CHECKING:  # pragma: no cover
    from runner.launch.driver import ExecOptions
    from runner.launch.resume import ResumePoint
    from runner.launch.worker import WorkerArgs
    from runner.plan import Plan
    from runner.spec.loading import LoadedSpec


@dataclass(frozen=True)
class Prepared:
    """What exists once the driver's checks passed.

    Attributes:
        run_id: The run, or ``None`` (tracking off, or another process owns it).
        resume: The run being continued and its notes, or ``None``.
        checkpoint_dir: Folder of the run's checkpoints.
        rank: Global rank of this process (0 unless a launcher started it as one worker of a job).
        shown: The notes were printed before training.
    """

    run_id: str | None
    resume: ResumePoint | None
    checkpoint_dir: str
    rank: int
    shown: bool


NOT_YET = Prepared(None, None, "", rank=0, shown=False)  # the workers' arguments until the run exists


def prepare(plan: Plan, options: ExecOptions, go_on: Callable[[], None] = lambda: None) -> Prepared:
    """Check every part, open the store, find the run to resume, then create or reopen the run.

    ``go_on`` is called just before the run is created; it raises to stop there (the launch ended).

    Raises:
        SpecError, DeviceError, UsageError, TrackingError: before the run exists (exit 2).
    """
    from runner.launch.prebuild import check_checkpoint_folder, check_parts
    from runner.launch.resume import prepare_resume
    from runner.tracking.lookup import set_run_tags
    from runner.tracking.store import open_store
    from runner.training.checkpoint import default_checkpoint_dir

    loaded = plan.loaded
    check_objectives(loaded)
    plan = dataclasses.replace(plan, part_notes=tuple(check_parts(loaded, plan.devices.world_size)))
    check_checkpoint_folder(loaded, plan.tracking_uri)
    owner, uri = plan.owns_run, plan.tracking_uri
    if uri is not None:
        try:
            open_store(uri)  # reachable, writable; a new sqlite store is created under its lock
        except TrackingError as exc:
            raise store_error_at(exc, loaded, options.tracking_uri) from None
    resume = prepare_resume(plan, options) if options.resume is not None else requeued_run(plan, owner)
    rank = plan.launcher.rank if plan.launch == "external" else 0
    shown = rank == 0 and options.parent_run_id is None  # a sweep's or bench's trials report to their tool
    if shown:  # before training, where the user looks first; workers print their own notes
        from runner.launch.driver import show_notes

        show_notes([*plan.notes, *(resume.notes if resume else [])])
    go_on()
    run_id = open_run(plan, options, owner, resume)
    # Checkpoints are keyed by run id; ranks without one (other nodes, tracking off) adopt the
    # logging rank's folder once the process group exists (see runner.launch.worker).
    run_key = run_id or f"local-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    checkpoint_dir = default_checkpoint_dir(uri, loaded.spec.checkpoint.dir, run_key)
    if run_id is not None and owner and uri is not None:  # where the run's checkpoints and spool are
        set_run_tags(uri, run_id, {"runner.checkpoint_dir": str(checkpoint_dir)})
    return Prepared(run_id, resume, str(checkpoint_dir), rank, shown)


def store_error_at(error: TrackingError, loaded: LoadedSpec, given: str | None) -> TrackingError:
    """``error`` placed where its URI was typed: ``--tracking-uri``, ``FILE:LINE: tracking.uri`` (or its ``--set``),
    or ``MLFLOW_TRACKING_URI``; the default store (``./mlflow.db``) is left as it is."""
    if given is not None:
        return TrackingError(f"--tracking-uri: {error}")
    if loaded.spec.tracking.uri is not None:
        issue = SpecIssue(None, None, "tracking.uri", str(error))
        return TrackingError(relocate_issues(SpecError(issue), loaded).issues[0].format())
    if os.environ.get("MLFLOW_TRACKING_URI", "").strip():
        return TrackingError(f"MLFLOW_TRACKING_URI: {error}")
    return error


def apply_plan_env(plan: Plan) -> None:
    """Make the plan's devices (and a Slurm task's worker variables) this process's environment."""
    from runner.devices.env import apply_device_env

    apply_device_env(plan.devices)
    if plan.slurm is not None and plan.slurm.kind == "per-device":
        os.environ.update(plan.slurm.worker_env(os.environ))  # this task is now the worker torchrun would start


def worker_args(plan: Plan, options: ExecOptions, ready: Prepared) -> WorkerArgs:
    """What every worker gets: spec, devices, the run (the owner's workers only) and its checkpoint folder."""
    from runner.launch.worker import WorkerArgs

    return WorkerArgs(
        loaded=plan.loaded,
        plan=plan.devices,
        run_id=ready.run_id if plan.owns_run else None,
        tracking_uri=plan.tracking_uri,
        checkpoint_dir=ready.checkpoint_dir,
        resume=ready.resume is not None or requeued(plan),
        sync_timing=options.sync_timing,
        epoch_end=options.epoch_end,
        dtype=options.dtype,
        nudge=options.nudge,
    )


def check_objectives(loaded: LoadedSpec) -> None:
    """``[loss]`` and ``[metrics]`` names import and their arguments fit, before any run exists (exit 2, FILE:LINE)."""
    from runner.training.losses import check_objectives

    try:
        check_objectives(loaded.spec, loaded.path.parent)
    except SpecError as exc:
        raise relocate_issues(exc, loaded) from None


def open_run(plan: Plan, options: ExecOptions, owner: bool, resume: ResumePoint | None) -> str | None:
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


def requeued(plan: Plan) -> bool:
    """Whether this is a Slurm job that Slurm requeued: every rank then resumes from the run's checkpoint."""
    return plan.slurm is not None and plan.slurm.job.restart_count > 0


def requeued_run(plan: Plan, owner: bool) -> ResumePoint | None:
    """On the run's owner of a requeued Slurm job: the job's run to continue (tag ``runner.slurm.job_id``).

    Returns:
        The run found, or ``None`` (not requeued, tracking off, another rank's run, or the job's
        first attempt ended before it created one).
    """
    from runner.launch.resume import ResumePoint, claim_run
    from runner.tracking.runs import find_run_by_tag

    if not (owner and requeued(plan) and plan.tracking_uri is not None):
        return None
    assert plan.slurm is not None
    job = plan.slurm.job
    run_id = find_run_by_tag(plan.tracking_uri, plan.experiment, SLURM_JOB_TAG, job.job_id)
    if run_id is None:
        return None
    note = f"Slurm requeued job {job.job_id} ({job.restart_count}x): continuing its run {run_id}"
    return ResumePoint(run_id, plan.tracking_uri, {}, [note, *claim_run(plan.tracking_uri, run_id)])

"""What the driver does around its training processes: the checks before they start, their arguments, the run.

:func:`before_launch` runs what needs no build (a resume whose owner lives is refused there, before any
training process starts); rank 0 checks and builds the parts (:mod:`runner.launch.prebuild`), and
:func:`open_run` creates or reopens the run once it reports the build (:mod:`runner.launch.session`), so a
spec error found while building leaves no run (docs/design.md §1).
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING

from runner.errors import SpecError, SpecIssue, TrackingError
from runner.spec.loading import relocate_issues

if TYPE_CHECKING:  # pragma: no cover
    from runner.launch.channel import HubAddress
    from runner.launch.driver import ExecOptions
    from runner.launch.resume import ResumePoint
    from runner.launch.worker import WorkerArgs
    from runner.plan import Plan
    from runner.spec.loading import LoadedSpec


def before_launch(plan: Plan, options: ExecOptions) -> ResumePoint | None:
    """What the driver checks before any training process starts: the checkpoint folder, and the run to continue.

    A resume (``--resume``, a requeued Slurm job) opens the store here and is refused while its owner lives
    (docs/design.md §12), so no training process is started for it.

    Raises:
        SpecError, UsageError, TrackingError: exit 2, before anything started.
    """
    from runner.launch.prebuild import check_checkpoint_folder
    from runner.launch.resume import prepare_resume

    check_checkpoint_folder(plan.loaded, plan.tracking_uri)
    if options.resume is None:
        return requeued_run(plan, plan.owns_run)
    _open_store(plan, options)
    return prepare_resume(plan, options)


def _open_store(plan: Plan, options: ExecOptions) -> None:
    from runner.tracking.uri import open_store

    if plan.tracking_uri is None:
        return
    try:
        open_store(plan.tracking_uri)  # reachable, writable; a new sqlite store is created under its lock
    except TrackingError as exc:
        raise store_error_at(exc, plan.loaded, options.tracking_uri) from None


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
    from runner.devices.inventory import apply_device_env

    apply_device_env(plan.devices)
    if plan.slurm is not None and plan.slurm.kind == "per-device":
        os.environ.update(plan.slurm.worker_env(os.environ))  # this task is now the worker torchrun would start


def worker_args(plan: Plan, options: ExecOptions, hub: HubAddress | None) -> WorkerArgs:
    """What every worker gets: spec, devices, and where rank 0 reaches the driver (which hands down the run)."""
    from runner.launch.worker import WorkerArgs

    return WorkerArgs(
        loaded=plan.loaded,
        plan=plan.devices,
        run_id=None,
        tracking_uri=plan.tracking_uri,
        checkpoint_dir="",
        resume=requeued(plan),
        sync_timing=options.sync_timing,
        epoch_end=options.epoch_end,
        hub=hub,
        dtype=options.dtype,
        nudge=options.nudge,
    )


def open_run(plan: Plan, options: ExecOptions, owner: bool, resume: ResumePoint | None) -> str | None:
    """The MLflow run of this job: reopened on resume, handed down by the driver, or started here.

    The process that creates or reopens the run records itself as its owner (:mod:`runner.launch.resume`).

    Returns:
        The run id, or ``None`` when tracking is off or another process owns the run.
    """
    from runner.launch.resume import Owner
    from runner.tracking import runs as tracking
    from runner.tracking.stored import set_run_tags

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

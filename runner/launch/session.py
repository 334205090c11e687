"""The driver's side of a run: open the store, create the run once rank 0 reports the build, record what it sends, and
end it (or keep its status in the spool while the store does not answer).

``RunSession`` answers the messages of ``runner.launch.channel`` on the hub's thread. It is the
only place that creates, reopens, records into and ends the run of ``runner exec`` (docs/design.md §6,
"Process model"). The training processes never import MLflow.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from runner.errors import SpecError, SpecIssue, TrackingError, echo, show_notes
from runner.launch.channel import (
    Artifact,
    Built,
    Close,
    Data,
    Failed,
    Flush,
    HandedRun,
    LoggedModel,
    Message,
    Metrics,
    Recorded,
    Restored,
    Result,
    Tags,
)
from runner.launch.prebuild import check_checkpoint_folder
from runner.launch.resume import Owner, ResumePoint, claim_run, drop_claim, prepare_resume, take_claim
from runner.launch.worker import WorkerArgs, torchrun_env
from runner.spec.loading import relocate_issues
from runner.tracking.runs import TrackedRun
from runner.tracking.uri import check_reachable, local_store_missing, open_store

if TYPE_CHECKING:
    from runner.launch.channel import HubAddress
    from runner.launch.resume import ResumePoint
    from runner.plan import Plan
    from runner.spec.loading import LoadedSpec
    from runner.tracking.trackers import MlflowTracker


@dataclass(frozen=True)
class ExecOptions:
    """Command-line options of ``runner exec`` beyond the spec.

    ``resume`` is a run id or ``"last"``; ``parent_run_id`` makes the run a child (sweeps, bench); ``nested`` allows an
    active MLflow fluent run; ``tracking_uri`` overrides the spec's store; ``environ`` is what the plan is made against
    (a sweep's lacks Slurm's variables); ``epoch_end(epoch, metrics)`` runs on every rank after each epoch and stops
    training when True (picklable for ddp); ``dtype`` and ``nudge`` serve ``runner parity``; ``in_process`` trains a
    one-process job in this process; start-up is measured from ``started_at`` (default: process start)."""

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
    in_process: bool = False
    started_at: float | None = None


class RunSession:
    """One job's run, made and recorded by the driver; no run exists after a ``build_error`` or ``store_error``."""

    def __init__(self, plan: Plan, options: ExecOptions, resume: ResumePoint | None) -> None:
        self.plan = plan
        self.options = options
        self.resume = resume
        self.run: TrackedRun | None = None  # once made; None with tracking off, or on a node that does not own it
        self.experiment_id = ""  # known when this process created the run (for the printed link)
        self.checkpoint_dir = ""
        self.build_error: SpecError | None = None
        self.store_error: TrackingError | None = None
        self.result: dict[str, Any] | None = None
        self.failure: BaseException | None = None
        self.shown = False
        self._tracker: MlflowTracker | None = None
        self._last_steps: dict[str, int] = {}  # metric name -> the last step a resumed run holds
        self._monitor: Any = None
        self._deferred: BaseException | None = None
        self._opened = resume is not None  # a resume opened the store before anything started

    # -- the hub's hooks -------------------------------------------------------------------

    def open_store(self, *, early: bool = True) -> None:
        """Reach the store while the training processes start; a new sqlite file is made only once the build is
        reported."""
        uri = self.plan.tracking_uri
        if uri is None or self._opened or (early and local_store_missing(uri)):
            return
        self._opened = True
        try:
            open_store(uri)
        except TrackingError as exc:
            self.store_error = store_error_at(exc, self.plan.loaded, self.options.tracking_uri)

    def handle(self, message: Message) -> Any:
        """Answer one message of rank 0 (:mod:`runner.launch.channel`), by its type. What the run records is not
        answered: an error recording it is raised at the next :class:`Flush` or :class:`Close`, as a buffered tracker
        would."""
        if isinstance(message, Recorded):
            try:
                self._record(message)
            except Exception as exc:
                self._deferred = self._deferred or exc
            return None
        if isinstance(message, (Flush, Close)) and self._deferred is not None:
            deferred = self._deferred
            self._deferred = None
            raise deferred
        match message:
            case Built(build_error, notes):
                return self._built(build_error, notes)
            case Restored(recorded, resumed, continuing):
                return self._restored(recorded, resumed, continuing)
            case Flush():
                return self._flush()
            case Close():
                return self._close()
            case Result(result):
                self.result = result
            case Failed(failure):
                self.failure = failure
        return None

    def _record(self, message: Recorded) -> None:
        match message:
            case Metrics(logged):
                self._metrics(logged)
            case Tags(tags) if self._tracker is not None:
                self._tracker.set_tags(tags)
            case Artifact(path, artifact_path) if self._tracker is not None:
                self._tracker.log_artifact(path, artifact_path)
            case Data(info):
                self._data(info)
            case LoggedModel(path, step, normalization):
                self._model(path, step, normalization)

    def launch_pointless(self) -> bool | None:
        """For the wait on a training child: ``True`` once the store failed to open (no run will be made), ``None``
        once the run is handed to the workers (it never will be), else ``False`` (not known yet)."""
        if self.store_error is not None:
            return True
        return None if self.checkpoint_dir else False

    # -- messages ----------------------------------------------------------------------------

    def _built(self, error: SpecError | None, notes: list[str]) -> HandedRun:
        if error is not None:
            self.build_error = error
            return HandedRun(None, "", False, abort=True)
        self.open_store(early=False)
        if self.store_error is not None:
            return HandedRun(None, "", False, abort=True)
        if self.checkpoint_dir:  # the elastic agent restarted the workers: the same run, from its checkpoint
            return HandedRun(self.run_id, self.checkpoint_dir, True)
        self.plan = dataclasses.replace(self.plan, part_notes=tuple(notes))
        rank = self.plan.launcher.rank if self.plan.launch == "external" else 0
        self.shown = rank == 0 and self.options.parent_run_id is None  # trials report to their tool
        if self.shown:
            show_notes([*self.plan.notes, *(self.resume.notes if self.resume else [])])
        self._create()
        return HandedRun(self.run_id, self.checkpoint_dir, self.resume is not None or requeued(self.plan))

    @property
    def run_id(self) -> str | None:
        return self.run.run_id if self.run is not None else None

    def _create(self) -> None:
        from runner.tracking.stored import CHECKPOINT_DIR_TAG

        plan = self.plan
        self.run, self.experiment_id = open_run(plan, self.options, plan.owns_run, self.resume)
        run_key = self.run_id or f"local-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
        folder = self.resume.folder if self.resume is not None else plan.checkpoint_root / run_key
        self.checkpoint_dir = str(folder)
        if self.run is not None:  # where the run's checkpoints and spool are
            if plan.owns_run:  # a resume claimed it already; a new run is claimed before any rank trains
                take_claim(folder, self.run.run_id)
            self.run.log(tags={CHECKPOINT_DIR_TAG: self.checkpoint_dir})

    def _restored(self, recorded: int, resumed: bool, continuing: bool) -> list[str]:
        """Make the run's tracker once rank 0 restored its checkpoint; send what the spool kept from before it."""
        from runner.tracking.spool import SPOOL_NAME, send_spool, spool_path
        from runner.tracking.trackers import MlflowTracker

        run = self.run
        spec = self.plan.loaded.spec
        notes: list[str] = []
        if run is None:
            return notes
        folder = Path(self.checkpoint_dir)
        if continuing:
            # Send what the spool kept from before the checkpoint; values recorded after it (seq >= recorded) are
            # computed again, so they are dropped.
            sent = send_spool(run, spool_path(folder), before_seq=recorded, apply_end=False)
            if sent is not None:
                notes.append(
                    f"sent {sent.metrics} metric values kept in {SPOOL_NAME} while the tracking store was away"
                )
        self._last_steps = run.last_logged_steps() if resumed else {}  # a resumed run logs no step twice
        self._tracker = MlflowTracker(
            run, flush_every_s=spec.tracking.flush_every_s, spool=spool_path(folder), first_seq=recorded
        )
        if spec.tracking.system_metrics:
            from runner.tracking.trackers import start_system_metrics

            self._monitor = start_system_metrics(run, resumed=resumed)
        return notes

    def _metrics(self, logged: list[tuple[dict[str, float], int, int]]) -> None:
        if self._tracker is not None:
            for metrics, step, timestamp_ms in logged:
                fresh = {k: v for k, v in metrics.items() if step > self._last_steps.get(k, -1)}
                if fresh:
                    self._tracker.log_metrics(fresh, step, timestamp_ms)

    def _data(self, info: dict[str, Any]) -> None:
        """Record the data as dataset inputs and the split fingerprint (a new run only)."""
        from runner.tracking.stored import DatasetRecord, record_data
        from runner.tracking.tags import spec_params

        run = self.run
        if run is None:
            return
        parts = [("train", "training", info["num_train"], info["train_digest"])]
        if info["num_val"] and info["val_digest"] is not None:
            parts.append(("val", "validation", info["num_val"], info["val_digest"]))
        if info.get("num_test") and info.get("test_digest") is not None:
            parts.append(("test", "testing", info["num_test"], info["test_digest"]))
        records = [
            DatasetRecord(f"{info['name']} {part}", digest, context, count, info["source"], tuple(info["input_shape"]))
            for part, context, count, digest in parts
        ]
        record_data(run, records, info["val_split_sha256"])
        if info.get("split") and ":" in self.plan.loaded.spec.data.dataset:  # the factory's one set was split
            run.log(params=spec_params(self.plan.loaded.spec, split=True))

    def _model(self, path: str, step: int, normalization: tuple[float, float] | None) -> None:
        """Log the model whose state rank 0 saved to ``path`` with MLflow. The file holds tensors and plain values
        only (``{"state", "example", "input_shape", "num_classes"}``) and is read with ``weights_only``: the model is
        built here from the spec, as the ranks built it, and takes the saved state, so nothing from the checkpoint
        folder is unpickled as an object."""
        import torch

        from runner.tracking.stored import log_model
        from runner.training.models import build_model

        if self.run is None:
            return
        if self._tracker is not None:
            self._tracker.flush()  # the last step's metrics are linked to the model: they must be in MLflow
        saved = torch.load(path, weights_only=True)
        loaded = self.plan.loaded
        model = build_model(
            loaded.spec.model.model_copy(update={"kwargs": saved.get("kwargs", loaded.spec.model.kwargs)}),
            loaded.path.parent,
            input_shape=saved.get("input_shape"),
            num_classes=saved.get("num_classes"),
        )
        model.load_state_dict(saved["state"], assign=True)  # assign: the trained dtype, not the built one
        log_model(self.run, model, saved["example"], step=step, normalization=normalization)

    def _flush(self) -> int:
        if self._tracker is None:
            return 0
        self._tracker.flush()
        return self._tracker.recorded()

    def _close(self) -> int:
        if self._monitor is not None:
            monitor = self._monitor
            self._monitor = None
            monitor.finish()
        if self._tracker is None:
            return 0
        tracker = self._tracker
        self._tracker = None
        tracker.close()
        return tracker.recorded()

    # -- the end -----------------------------------------------------------------------------

    def end(self, status: str, error: str | None) -> None:
        """Close what rank 0 left open and give the run its final status (kept in the spool while the store is away)."""
        with contextlib.suppress(Exception):  # the run's status matters more than a last batch the store refused
            self._close()
        try:
            if self.run is not None and self.plan.owns_run:
                end_run_or_spool(self.run, status, error, self.checkpoint_dir)
        finally:  # the run has its end: another process may continue it
            drop_claim(self.checkpoint_dir)
            if self.resume is not None:  # claimed before the run was handed down (no run when the build failed)
                drop_claim(self.resume.folder)


@dataclass(frozen=True)
class Spooled:
    """What of a run waits in its spool: values, and the final status when it could not be set."""

    path: str
    metrics: int
    status: str | None

    @classmethod
    def of(cls, checkpoint_dir: str | Path) -> Spooled | None:
        """The run's spool, or ``None`` when nothing waits in it."""
        from runner.tracking.spool import read, spool_path

        path = spool_path(checkpoint_dir)
        if not path.is_file():
            return None
        contents, _ = read(path)
        if not contents.items and contents.end is None:
            return None
        return cls(str(path), len(contents.items), contents.end[0] if contents.end else None)

    def describe(self, run_id: str | None) -> str:
        """The end of the status line: what is only in the spool, and how it reaches MLflow."""
        kept = [f"{self.metrics} metric values"] if self.metrics else []
        if self.status:
            kept.append(f"the status {self.status}")
        return (
            f" (the tracking store did not answer: {' and '.join(kept)} could only be spooled to {self.path}; "
            f"`runner status {run_id}` sends them once it answers)"
        )


def end_run_or_spool(run: TrackedRun, status: str, error: str | None, checkpoint_dir: str) -> None:
    """Give the run its final status, or keep it in the spool while the store does not answer (one quick check)."""
    from runner.tracking.spool import append, spool_path

    try:
        check_reachable(run.uri)
        run.end(status, error)
    except TrackingError:
        path = spool_path(checkpoint_dir)
        append(path, end=(status, error))
        echo(
            f"runner: the tracking store at {run.uri} did not answer: run {run.run_id}'s status {status} is kept in "
            f"{path}; `runner status {run.run_id}` sets it once the store answers",
            err=True,
        )


def before_launch(plan: Plan, options: ExecOptions) -> ResumePoint | None:
    """Check the checkpoint folder and the run to continue before any training process starts (docs/design.md §12)."""
    check_checkpoint_folder(plan)
    if options.resume is None:
        return requeued_run(plan, plan.owns_run)
    if plan.tracking_uri is not None:
        try:
            open_store(plan.tracking_uri)  # reachable, writable; a new sqlite store is created under its lock
        except TrackingError as exc:
            raise store_error_at(exc, plan.loaded, options.tracking_uri) from None
    return prepare_resume(plan, options.resume, options.allow_spec_change)


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
    from runner.devices.resolve import apply_device_env

    apply_device_env(plan.devices)
    if plan.slurm is not None and plan.slurm.kind == "per-device":  # this task is now the worker torchrun would start
        job = plan.slurm.job
        host, _, port = plan.slurm.rendezvous_endpoint().rpartition(":")
        env = torchrun_env(
            job.procid,
            job.ntasks,
            os.environ.get("MASTER_PORT") or port,  # a rendezvous the user set wins
            address=os.environ.get("MASTER_ADDR") or host,
            local=(job.localid, job.local_tasks),
            node_rank=job.nodeid,
        )
        os.environ.update(env)


def worker_args(plan: Plan, options: ExecOptions, hub: HubAddress | None) -> WorkerArgs:
    """What every worker gets: spec, devices, and where rank 0 reaches the driver (which hands down the run)."""
    handed = {name: getattr(options, name) for name in ("sync_timing", "epoch_end", "dtype", "nudge", "started_at")}
    return WorkerArgs(
        loaded=plan.loaded,
        plan=plan.devices,
        run_id=None,
        checkpoint_dir="",
        resume=requeued(plan),
        hub=hub,
        **handed,
    )


def open_run(
    plan: Plan, options: ExecOptions, owner: bool, resume: ResumePoint | None
) -> tuple[TrackedRun | None, str]:
    """``(run, experiment id)`` of this job: reopened, handed down, or started here (recording its owner)."""
    from runner.tracking.runs import start_run

    if resume is not None:
        if owner:
            resume.run.reopen(spec_change=json.dumps(resume.changes) if resume.changes else None)
            resume.run.log(tags=Owner.this_process().tags())  # docs/design.md §12
        return resume.run, ""
    uri = plan.tracking_uri
    if not owner or uri is None:
        return None, ""
    if plan.launch == "external" and plan.launcher.run_id:
        return TrackedRun(uri, plan.launcher.run_id), ""
    tags = {**dict(options.tags), **Owner.this_process().tags()}
    if plan.slurm is not None:
        tags[SLURM_JOB_TAG] = plan.slurm.job.job_id
    if options.parent_run_id:
        tags["mlflow.parentRunId"] = options.parent_run_id
    record = start_run(
        plan.loaded,
        plan.describe(),
        run_name=options.run_name or plan.run_name,
        extra_tags=tags,
        uri=uri,
        nested=options.nested,
    )
    return TrackedRun(uri, record.run_id), record.experiment_id


SLURM_JOB_TAG = "runner.slurm.job_id"


def requeued(plan: Plan) -> bool:
    """Whether this is a Slurm job that Slurm requeued: every rank then resumes from the run's checkpoint."""
    return plan.slurm is not None and plan.slurm.job.restart_count > 0


def requeued_run(plan: Plan, owner: bool) -> ResumePoint | None:
    """The run to continue on the owner of a requeued Slurm job (tag ``runner.slurm.job_id``), or ``None``."""
    from runner.tracking.stored import run_checkpoint_dir, search_runs

    uri = plan.tracking_uri
    if not (owner and requeued(plan) and uri is not None):
        return None
    assert plan.slurm is not None
    job = plan.slurm.job
    found = search_runs(uri, plan.loaded.spec.experiment_name, {SLURM_JOB_TAG: job.job_id}, limit=1)
    if not found:
        return None
    run = TrackedRun(uri, found[0].run_id)
    note = f"Slurm requeued job {job.job_id} ({job.restart_count}x): continuing its run {run.run_id}"
    folder = run_checkpoint_dir(run, plan.checkpoint_root, found[0].tags)
    return ResumePoint(run, {}, [note, *claim_run(run, folder)], folder)

"""Driver of ``runner exec``: owns the MLflow run, starts the workers, sets the final status.

The driver is the process that launches, and the only one that imports MLflow (docs/design.md §6, "The
process model"): rank 0 reports its build to the driver's hub, the driver creates the run, and rank 0
streams what the run records over the same pipe.

* ``none`` / ``dp``: one child training process (``runner.launch.elastic``); ``ExecOptions.in_process``
  trains in this process instead (sweeps, bench, parity);
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

import contextlib
import dataclasses
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from runner import IMPORTED_AT
from runner.devices.inventory import HostLoad, peak_tflops
from runner.errors import Interrupted, SpecError, TrackingError, TrainingError
from runner.launch.channel import Hub
from runner.launch.elastic import LaunchFailed, launch_elastic, launch_failure, run_agent, run_child
from runner.launch.failures import JobContext, ended_by, oom_kill_count
from runner.launch.resume import resume_command
from runner.launch.session import ExecOptions, RunSession, Spooled, apply_plan_env, before_launch, worker_args
from runner.launch.worker import run_worker
from runner.spec.loading import relocate_issues
from runner.tracking.runs import TrackedRun, check_fluent_run
from runner.tracking.uri import ui_line
from runner.training import STARTUP_METRIC, flops_uncounted

if TYPE_CHECKING:  # pragma: no cover
    from runner.launch.failures import HangReports
    from runner.launch.worker import WorkerArgs
    from runner.plan import Plan
    from runner.spec.loading import LoadedSpec
    from runner.training import WorkerResult


@dataclass
class ExecResult:
    """Outcome of ``runner exec``: the run, the logging rank's final metrics and history, notes, every local rank's
    result, what waits in the spool (docs/design.md §12), and ``startup_s`` to the end of the first step."""

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
    startup_s: float | None = None
    experiment_id: str = ""
    host_note: str = ""
    compute: str = ""

    def summary(self) -> str:
        """What ``runner exec`` prints (notes, status, run id, metrics, the UI link); empty on ranks other than 0."""
        if self.rank != 0:
            return ""
        lines = [] if self.notes_shown else [f"note: {note}" for note in self.notes]
        lines.append(f"status: {self.status}" + (self.spooled.describe(self.run_id) if self.spooled else ""))
        if self.run_id:
            lines.append(f"run id: {self.run_id}  (experiment {self.experiment!r})")
        if self.startup_s is not None:
            lines.append(f"start-up: {self.startup_s:.1f} s to the end of the first step (metric {STARTUP_METRIC})")
        if self.compute:
            lines.append(self.compute)
        width = max([21, *(len(key) for key in self.metrics)])  # long custom metric names stay aligned
        lines += [f"  {key:<{width}}  {self.metrics[key]:.6g}" for key in sorted(self.metrics)]
        if self.host_note:
            lines.append(f"host: {self.host_note}")
        if self.tracking_uri and self.run_id and self.experiment_id:
            lines.append(ui_line(self.tracking_uri, self.experiment_id, self.run_id))
        elif self.tracking_uri:
            lines.append(f"open the UI: mlflow ui --backend-store-uri {self.tracking_uri}")
        return "\n".join(lines)


def exec_experiment(loaded: LoadedSpec, options: ExecOptions = ExecOptions()) -> ExecResult:
    """Run the experiment of ``loaded`` to the end and record it in MLflow, one path for every mode (docs/design.md §6).

    Raises SpecError, DeviceError, UsageError, TrackingError: before any training (exit 2); no MLflow run is left
    behind. TrainingError: training failed on some rank; the run is FAILED (exit 1). Interrupted: stopped by
    SIGINT/SIGTERM after a checkpoint; the run is KILLED (exit 130).

    This is where a spec issue found below (a key without a line: by the plan, a build, a check) is placed in the
    spec's files, once for every path of a run."""
    try:
        return _execute(loaded, options)
    except SpecError as exc:
        raise relocate_issues(exc, loaded) from None


def _execute(loaded: LoadedSpec, options: ExecOptions) -> ExecResult:
    """:func:`exec_experiment`, its spec issues not yet placed in the spec's files."""
    from runner.plan import make_plan

    if options.started_at is None:
        options = replace(options, started_at=process_started_at())
    plan = make_plan(loaded, env=options.environ, tracking_uri=options.tracking_uri)
    options = _with_fluent_parent(plan, options)
    resume = before_launch(plan, options)
    session = RunSession(plan, options, resume) if plan.owns_run else None
    apply_plan_env(plan)
    load_before = HostLoad.read()
    workers = _run_to_the_end(plan, options, session)
    result = workers[0]
    run = session.run if session is not None else None
    folder = session.checkpoint_dir if session is not None else ""
    spooled = Spooled.of(folder) if run is not None else None
    # A store that did not take the run's end is not asked again now: each request would wait out MLflow's HTTP
    # retries (minutes), and the spool already holds the run's values and status.
    answering = run is not None and not (spooled is not None and spooled.status is not None)
    host, compute = _record_end(plan, options, run if answering else None, workers, HostLoad.since(load_before))
    experiment_id = ""  # for the printed link: known when the driver created the run, else asked of the store
    if session is not None and run is not None:
        experiment_id = session.experiment_id or (run.experiment_id() if answering else "")
    return ExecResult(
        spooled=spooled,
        run_id=run.run_id if run is not None else None,
        status="FINISHED",
        metrics=result.metrics,
        tracking_uri=plan.tracking_uri,
        experiment=plan.loaded.spec.experiment_name,
        checkpoint_dir=folder,
        history=result.history,
        notes=plan.notes + (resume.notes if resume else []) + result.notes,
        workers=sorted(workers, key=lambda w: w.rank),
        rank=plan.launcher.rank if plan.launch == "external" else 0,
        notes_shown=session.shown if session is not None else False,
        startup_s=result.startup_s,
        experiment_id=experiment_id,
        host_note=host,
        compute=compute,
    )


def _record_end(
    plan: Plan, options: ExecOptions, run: TrackedRun | None, workers: list[WorkerResult], load: HostLoad
) -> tuple[str, str]:
    """Record host load, peak memory and compute per device; return the summary's host and compute lines."""
    used = plan.devices.nproc_per_node * plan.devices.threads_per_process
    metrics, compute, mfu = end_figures(plan, options, workers)
    if run is not None:
        with contextlib.suppress(TrackingError):  # figures beside the run: the run itself is recorded
            step = max((w.global_step for w in workers), default=0)
            ended_tags, ended = ending(workers[0]) if workers else ({}, {})
            tags = {**load.tags(used), "runner.mfu": mfu, **ended_tags}
            remarks = {"host load": load.describe(used), **ended}
            run.log(metrics=metrics, step=step, tags=tags, remarks=remarks)
    return host_note(plan, load), compute


def ending(result: WorkerResult) -> tuple[dict[str, str], dict[str, str]]:
    """Tags and description remarks on how training ended: early stopping (its step and why) and the best
    checkpoint (its step and value), each when it applies."""
    tags: dict[str, str] = {}
    remarks: dict[str, str] = {}
    if result.stop_reason is not None:
        tags["runner.stopped_early"] = f"step {result.global_step}"
        remarks["stopped early"] = f"at step {result.global_step}: {result.stop_reason}"
    if result.best is not None:
        metric, value, step = result.best
        tags["runner.best_checkpoint"] = f"step {step}: {metric} = {value:.6g}"
        remarks["best checkpoint"] = f"step {step}, {metric} = {value:.6g}"
    return tags, remarks


def host_note(plan: Plan, load: HostLoad) -> str:
    """The summary's note on a busy host, with advice on threads; ``""`` when the host was quiet."""
    used = plan.devices.nproc_per_node * plan.devices.threads_per_process
    if not load.busy(used):
        return ""
    advice = load.advice(used, plan.devices.threads_per_process, plan.devices.accelerator)
    return f"{load.describe(used)} (tag runner.host_load)" + (f"; {advice}" if advice else "")


def end_figures(plan: Plan, options: ExecOptions, workers: list[WorkerResult]) -> tuple[dict[str, float], str, str]:
    """Each device's peak memory and achieved compute, beside ``runner plan``'s estimate (docs/design.md §10).

    ``memory/peak_allocated_mib/deviceN`` on CUDA, ``memory/peak_rss_mib/rankN`` on CPU; ``perf/flops_per_step``;
    ``perf/tflops_per_s/<device>`` over the median step after the first two; ``perf/mfu/<device>`` only when the peak is
    known. Returns the metrics, the compute line and the ``runner.mfu`` tag."""
    from statistics import median  # only here, once the job has ended: not on the way to the first step

    metrics: dict[str, float] = {}
    for worker in workers:
        for i, held in enumerate(worker.device_peaks):
            metrics[f"memory/peak_allocated_mib/device{worker.rank + i}"] = held / 2**20
        if not worker.device_peaks:
            metrics[f"memory/peak_rss_mib/rank{worker.rank}"] = worker.peak_memory_bytes / 2**20
    if not workers or any(not w.step_flops or not w.step_times_s for w in workers):
        why = flops_uncounted(plan.loaded.spec, options.sync_timing) or "no step taken"
        return metrics, "", f"no FLOPs counted: {why}"
    dtype = {"no": "fp32", "bf16": "bf16", "fp16": "fp16"}[plan.loaded.spec.train.amp]
    dtype = "fp64" if options.dtype == "float64" else dtype
    cuda = plan.devices.accelerator == "cuda"
    name = plan.devices.names[0] if cuda and plan.devices.names else "cpu"
    given = plan.loaded.spec.devices.peak_tflops
    peak = (given, "devices.peak_tflops") if given else peak_tflops(name, dtype)
    counted = sum(w.step_flops or 0 for w in workers)  # this node's ranks; the other nodes' are alike
    metrics["perf/flops_per_step"] = float(counted * max(1, plan.devices.world_size // len(workers)))
    achieved = []
    for worker in workers:
        times = worker.step_times_s[2:] or worker.step_times_s[1:] or worker.step_times_s
        tflops = (worker.step_flops or 0) / median(times) / 1e12
        suffix = f"device{worker.rank}" if cuda else f"rank{worker.rank}"
        metrics[f"perf/tflops_per_s/{suffix}"] = tflops
        if peak is not None:
            metrics[f"perf/mfu/{suffix}"] = tflops / peak[0]
        achieved.append(tflops)
    mean = sum(achieved) / len(achieved)
    line = f"compute: {mean:.3g} TFLOP/s per device, {metrics['perf/flops_per_step']:.3g} FLOPs per step"
    if peak is None:
        tag = f"no MFU: peak {dtype} FLOP/s of {name} unknown; set devices.peak_tflops"
        return metrics, f"{line}; {tag}", tag
    return metrics, f"{line}, MFU {mean / peak[0]:.1%}", f"{peak[0]:g} TFLOP/s {dtype} peak per device: {peak[1]}"


def process_started_at(exec_gap_s: float = 5.0) -> float:
    """Clock time this process started (interpreter start-up and imports included). A process created over
    ``exec_gap_s`` before it imported runner ran another program first (``sh -c 'setup && runner ...'`` execs its last
    command in the shell's process): its start-up counts from the import of runner."""
    import psutil

    created = float(psutil.Process().create_time())
    return created if IMPORTED_AT - created <= exec_gap_s else IMPORTED_AT


def _with_fluent_parent(plan: Plan, options: ExecOptions) -> ExecOptions:
    """An active fluent run: the parent with ``options.nested``, else TrackingError (the hub's thread sees none)."""
    if "mlflow" not in sys.modules or plan.tracking_uri is None or not plan.owns_run:
        return options  # without mlflow imported, no fluent run can be active

    parent = check_fluent_run(options.nested)
    if parent is None or options.parent_run_id is not None:
        return options
    return dataclasses.replace(options, parent_run_id=parent)


def _run_to_the_end(plan: Plan, options: ExecOptions, session: RunSession | None) -> list[WorkerResult]:
    """Start the training processes and the hub, and end the run with their outcome (when this process owns it)."""
    hub = Hub(session.handle, session.open_store) if session is not None else None
    args = worker_args(plan, options, hub.address if hub is not None else None)
    status = "FAILED"
    error = None
    oom_before = oom_kill_count()
    hangs: HangReports = {}
    if hub is not None:
        hub.start()
    try:
        workers = _launch(plan, args, hangs, options, session)
        _raise_unmade(session)
        status = "FINISHED"
        return workers
    except (Interrupted, KeyboardInterrupt) as exc:
        status = "KILLED"
        raise _interrupted(getattr(exc, "signum", 2), session) from None
    except (SpecError, TrackingError) as exc:
        if session is None or session.run is None:
            raise exc from None
        error = str(exc)
        raise TrainingError(error) from None
    except Exception as exc:
        _raise_unmade(session)
        context = JobContext(plan.loaded.spec.parallel.timeout_s, oom_before, hangs)
        failed = exc if isinstance(exc, LaunchFailed) else launch_failure(exc, context)
        if failed.stopped is not None:
            status = "KILLED"
            signum, rank = failed.stopped
            raise _interrupted(signum, session, hangs, rank) from None
        if failed.spec_error is not None and (session is None or session.run is None):
            raise failed.spec_error from None
        error = failed.error
        raise TrainingError(error) from None
    finally:
        if hub is not None:
            hub.stop()
        if session is not None:
            session.end(status, error)


def _raise_unmade(session: RunSession | None) -> None:
    """Raise why the driver made no run: the spec error rank 0 found while building, or the store's error."""
    if session is not None and session.build_error is not None:
        raise session.build_error
    if session is not None and session.store_error is not None:
        raise session.store_error


def _interrupted(
    signum: int, session: RunSession | None, hangs: HangReports | None = None, rank: int | None = None
) -> Interrupted:
    """The interruption, with the checkpoint that exists and the command that continues the run."""
    run = session.run if session is not None else None
    folder = session.checkpoint_dir if session is not None else ""
    command = resume_command(run) if run is not None else None
    note = checkpoint_note(folder, hangs or {})
    run_id = run.run_id if run is not None else None
    return Interrupted(int(signum), run_id=run_id, command=command, checkpoint=note, rank=rank)


def checkpoint_note(folder: str, hangs: HangReports) -> str:
    """Which checkpoint a stopped job left: the stop's own, or (a rank hung before writing it) an older one or none."""
    from runner.training.checkpoint import list_checkpoints

    saved = list_checkpoints(Path(folder)) if folder else []
    newest = saved[-1].name if saved else None
    if hangs:
        ranks = ", ".join(str(rank) for rank in sorted(hangs))
        older = f"the newest is {newest}, from before the stop" if newest else "the run has none"
        return f"no checkpoint was written at the stop (rank {ranks} hung first); {older}"
    return f"a checkpoint was written at the stop ({newest})" if newest else "it has no checkpoint"


def _in_child(args: WorkerArgs, session: RunSession) -> WorkerResult:
    """Train ``args`` in a child process and return its result.

    Raises Interrupted on a stop, the RunnerError the child reported, or TrainingError when it ended without one.
    """
    from runner.training import WorkerResult

    code, oom_before = run_child(args, session.launch_pointless)
    if session.result is not None and code == 0:
        return WorkerResult(**session.result)
    if session.failure is not None:
        raise session.failure
    if session.build_error is not None or session.store_error is not None:
        return WorkerResult(rank=0)  # the driver raises why it made no run
    if code == 0:
        raise TrainingError("the worker exited without a result (sys.exit(0) during training)")
    if code == Interrupted.exit_code:
        raise Interrupted()
    raise TrainingError(f"the training process {ended_by(code, oom_before)}")


def _launch(
    plan: Plan, args: WorkerArgs, hangs: HangReports, options: ExecOptions, session: RunSession | None
) -> list[WorkerResult]:
    """Run the training processes; return their results, rank 0's first; ``hangs`` gets hung ranks' reports."""
    if plan.launch == "elastic":
        if plan.rendezvous is not None and plan.rendezvous.nnodes > 1:
            # c10d numbers the nodes by host name, then by the pid of the process that runs the launcher; the job's
            # rank 0 must be where its run's owner is (node 0 on one host, as the drivers start): launch here
            return launch_elastic(plan, args, hangs)
        return run_agent(plan, args, hangs)
    if session is not None and plan.launch != "elastic" and not options.in_process:
        # none and dp; and rank 0 started by torchrun or a Slurm task per device, which thus stays its job's
        # driver: the rank trains in a child that inherits its launcher's variables (docs/design.md §6)
        return [_in_child(args, session)]
    result = run_worker(args)
    if result is None:
        _raise_unmade(session)
        raise TrainingError("the worker exited without a result (sys.exit(0) during training)")
    return [result]

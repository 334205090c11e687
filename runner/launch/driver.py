"""Driver of ``runner exec``: owns the MLflow run, starts the workers, sets the final status.

The driver is the process that launches (DESIGN §5-§6):

* ``none`` / ``dp``: the worker runs in the driver's own process;
* ``ddp``: the driver starts ``nproc_per_node`` workers through torch's elastic launcher
  (``torch.distributed.launcher.api.elastic_launch``, the machinery behind ``torchrun``)
  with a c10d rendezvous (``localhost:0`` on one node: the OS picks a free port);
* started by ``torchrun`` or a scheduler (``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` set):
  this process is a worker and launches nothing; rank 0 owns the run.

Whatever happens, the run ends FINISHED, FAILED (with the error) or KILLED in ``finally``.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from runner.errors import Interrupted, SpecError, SpecIssue, TrainingError, UsageError
from runner.spec.loading import relocate_issues


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
    """

    run_name: str | None = None
    resume: str | None = None
    allow_spec_change: tuple[str, ...] = ()
    parent_run_id: str | None = None
    tags: tuple[tuple[str, str], ...] = ()
    sync_timing: bool = False
    nested: bool = False


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
        notes: Messages for the user (resume, skipped checkpoints).
        workers: Every rank's :class:`runner.launch.worker.WorkerResult` on this node, by rank.
    """

    run_id: str | None
    status: str
    metrics: dict[str, float]
    tracking_uri: str | None
    experiment: str
    checkpoint_dir: str
    history: list[Any] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    workers: list[Any] = field(default_factory=list)


def exec_experiment(loaded: Any, options: ExecOptions = ExecOptions()) -> ExecResult:
    """Run the experiment of ``loaded`` to the end and record it in MLflow.

    Args:
        loaded: The :class:`runner.spec.loading.LoadedSpec`.
        options: See :class:`ExecOptions`.

    Returns:
        The :class:`ExecResult` of a FINISHED run.

    Raises:
        SpecError, DeviceError, UsageError, TrackingError: before any training (exit 2);
            no MLflow run is left behind.
        TrainingError: training failed on some rank; the run is FAILED (exit 1).
        Interrupted: stopped by SIGINT/SIGTERM after a checkpoint; the run is KILLED (exit 130).
    """
    from runner.devices.resolve import apply_device_env
    from runner.plan import make_plan
    from runner.tracking import runs as tracking
    from runner.training.checkpoint import default_checkpoint_dir
    from runner.training.models import check_model_name

    plan = make_plan(loaded)
    spec = loaded.spec
    check_model_name(spec.model.name, loaded.path.parent)
    external = plan.launch == "external"
    rank = int(os.environ.get("RANK", "0")) if external else 0
    owner = rank == 0 if external else spec.parallel.node_rank == 0
    uri = plan.tracking_uri
    run_id: str | None = None
    resume = options.resume is not None
    notes: list[str] = list(plan.devices.notes)
    if uri is not None:
        tracking.check_reachable(uri)
    if resume:
        if uri is None:
            raise UsageError("--resume needs tracking.enabled = true: the run to resume is found in MLflow")
        run_id = _resolve_resume(uri, plan.experiment, options.resume)
        changes, complete, resume_notes = _check_resume(
            loaded, default_checkpoint_dir(uri, spec.checkpoint.dir, run_id), options.allow_spec_change
        )
        notes += resume_notes
        if complete and tracking.run_status(uri, run_id) == "FINISHED":
            raise UsageError(
                f"--resume {run_id}: the run already FINISHED with this spec; to train it further, change the "
                f"spec and name the change, e.g. --set train.epochs=N --allow-spec-change train.epochs"
            )
    apply_device_env(plan.devices)

    if owner and uri is not None and not resume:
        if external and os.environ.get("RUNNER_RUN_ID"):
            run_id = os.environ["RUNNER_RUN_ID"]
        else:
            tags = dict(options.tags)
            if options.parent_run_id:
                tags["mlflow.parentRunId"] = options.parent_run_id
            handle = tracking.start_run(
                loaded,
                plan.describe(),
                run_name=options.run_name or spec.tracking.run_name,
                extra_tags=tags,
                nested=options.nested,
            )
            run_id = handle.run_id
    elif owner and resume:
        tracking.reopen_run(uri, run_id, spec_change=json.dumps(changes) if changes else None)
    # Checkpoints are keyed by run id; ranks without one (other nodes, tracking off) adopt the
    # logging rank's folder once the process group exists (see runner.launch.worker).
    run_key = run_id or f"local-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    checkpoint_dir = default_checkpoint_dir(uri, spec.checkpoint.dir, run_key)

    from runner.launch.worker import WorkerArgs

    args = WorkerArgs(
        loaded=loaded,
        plan=plan.devices,
        run_id=run_id if owner else None,
        tracking_uri=uri,
        checkpoint_dir=str(checkpoint_dir),
        resume=resume,
        sync_timing=options.sync_timing,
    )
    status, error = "FAILED", None
    try:
        workers = _launch(plan, args)
        result = workers[0]
        status = "FINISHED"
    except (Interrupted, KeyboardInterrupt) as exc:
        status = "KILLED"
        raise Interrupted(getattr(exc, "signum", 2), run_id=run_id, spec=str(loaded.path)) from None
    except Exception as exc:
        if _is_signal(exc):
            status = "KILLED"
            raise Interrupted(getattr(exc, "sigval", 15), run_id=run_id, spec=str(loaded.path)) from None
        bad_spec = exc if isinstance(exc, SpecError) else _spec_error_of_child(exc)
        if bad_spec is not None:
            # A kwarg or name that only fails when built: still a bad spec (exit 2), and the run
            # made for it is removed so that no stray run is left behind.
            status = "DELETE"
            raise relocate_issues(bad_spec, loaded) from None
        error = _describe_failure(exc)
        raise TrainingError(error) from None
    finally:
        if owner and run_id is not None:
            if status == "DELETE" and not resume:
                tracking.delete_run(uri, run_id)
            else:
                tracking.end_run(uri, run_id, "FAILED" if status == "DELETE" else status, error)
    return ExecResult(
        run_id=run_id,
        status=status,
        metrics=result.metrics,
        tracking_uri=uri,
        experiment=plan.experiment,
        checkpoint_dir=str(checkpoint_dir),
        history=result.history,
        notes=notes + result.notes,
        workers=sorted(workers, key=lambda w: w.rank),
    )


def _launch(plan: Any, args: Any) -> list[Any]:
    """Run the workers; return their :class:`runner.launch.worker.WorkerResult`, the logging rank's first."""
    from runner.launch.worker import run_worker

    if plan.launch != "elastic":
        return [run_worker(args)]
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    par = plan.loaded.spec.parallel
    endpoint = par.rdzv_endpoint or "localhost:0"
    config = LaunchConfig(
        min_nodes=par.nnodes,
        max_nodes=par.nnodes,
        nproc_per_node=plan.devices.nproc_per_node,
        run_id=par.rdzv_id,
        rdzv_backend="c10d",
        rdzv_endpoint=endpoint,
        rdzv_configs={"is_host": par.node_rank == 0} if par.nnodes > 1 else {},
        max_restarts=par.max_restarts,
        monitor_interval=0.1,
        start_method="spawn",
    )
    with tempfile.TemporaryDirectory(prefix="runner-elastic-") as log_dir:
        # The launcher keeps per-attempt error files here; removed when the job ends.
        config.logs_specs = DefaultLogsSpecs(log_dir=log_dir)
        results = elastic_launch(config, run_worker)(args)
    done = [r for r in results.values() if r is not None]
    done.sort(key=lambda r: (not r.metrics, r.rank))
    return done


def _resolve_resume(uri: str, experiment: str, resume: str) -> str:
    from runner.tracking import runs as tracking

    if resume == "last":
        run_id = tracking.latest_run_id(uri, experiment)
        if run_id is None:
            raise UsageError(f"--resume last: experiment {experiment!r} at {uri} has no run to resume")
        return run_id
    if not tracking.run_exists(uri, resume):
        raise UsageError(
            f"--resume {resume}: no such run at {uri} (copy the run id from the MLflow UI or use --resume last)"
        )
    return resume


def _check_resume(
    loaded: Any, directory: Path, allowed: tuple[str, ...]
) -> tuple[dict[str, list[Any]], bool, list[str]]:
    """Refuse to resume with a spec that differs from the run's, unless each change is allowed.

    Returns:
        ``({dotted key: [old value, new value]}, complete, notes)``: the allowed changes, and
        whether the newest usable checkpoint already covers all the training the spec asks for.

    Raises:
        UsageError: The run has no readable checkpoint, or ``allowed`` names a key the spec does not have.
        SpecError: The spec differs in keys not listed in ``allowed``.
    """
    from runner.spec.dump import flatten_spec
    from runner.spec.suggest import did_you_mean
    from runner.spec.wording import with_hint
    from runner.training.checkpoint import CheckpointError, load_latest, spec_changes

    current = flatten_spec(loaded.spec)
    try:
        found = load_latest(directory)
    except CheckpointError as exc:
        raise UsageError(str(exc)) from None
    if found is None:
        raise UsageError(f"nothing to resume: no checkpoint in {directory}")
    saved = found.payload["spec"]
    known = set(saved) | set(current)
    for key in allowed:
        if not any(k == key or k.startswith(key + ".") for k in known):
            hint = did_you_mean(key, sorted(known), render=str)
            raise UsageError(with_hint(f"--allow-spec-change {key}: the spec has no such key", hint))
    changed = spec_changes(saved, current)
    unexpected = [k for k in changed if not any(k == a or k.startswith(a + ".") for a in allowed)]
    if unexpected:
        issues = [
            SpecIssue(
                loaded.path,
                None,
                key,
                f"differs from the resumed run: was {saved.get(key)!r}, now {current.get(key)!r} "
                f"(undo it, or pass --allow-spec-change {key})",
            )
            for key in unexpected
        ]
        raise SpecError(issues)
    notes = [f"resuming from {found.path.name}"]
    notes += [f"skipped {reason}" for _, reason in found.skipped]
    if changed:
        notes.append("spec changed on resume: " + ", ".join(changed))
    state, train = found.payload["state"], loaded.spec.train
    complete = state["epoch"] >= train.epochs or (
        train.max_steps is not None and state["global_step"] >= train.max_steps
    )
    return {k: [saved.get(k), current.get(k)] for k in changed}, complete, notes


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


def _describe_failure(exc: BaseException) -> str:
    """A readable message for a failed job; for DDP, the first failing rank's error."""
    failures = getattr(exc, "failures", None)
    if not failures:
        return f"{type(exc).__name__}: {exc}"
    rank, failure = min(failures.items())
    message = ""
    data = getattr(failure, "error_file_data", None) or {}
    if isinstance(data, dict):
        inner = data.get("message", {})
        if isinstance(inner, dict):
            message = inner.get("message", "")
            trace = inner.get("extraInfo", {}).get("py_callstack", "")
            if trace:
                message = trace.strip().splitlines()[-1]
        elif isinstance(inner, str):
            message = inner
    if not message:
        message = getattr(failure, "message", "") or f"exit code {failure.exitcode}"
    return f"rank {rank} failed: {message}"

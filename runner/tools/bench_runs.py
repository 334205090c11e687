"""The MLflow side of ``runner bench``: the parent run, one child run per configuration, their figures and files."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from runner.tools.bench_report import BenchReport, ConfigResult

if TYPE_CHECKING:
    from runner.spec.loading import LoadedSpec


class Parent(NamedTuple):
    """The bench's parent run, in ``experiment`` (``<training experiment>/bench``)."""

    uri: str
    run_id: str
    experiment: str


def start_parent(base: LoadedSpec, report: BenchReport, config_ids: list[str]) -> Parent | None:
    """Create the parent run (``None`` when tracking is off)."""
    from runner.tracking.runs import start_run
    from runner.tracking.uri import resolve_tracking_uri

    if not base.spec.tracking.enabled:
        return None
    uri = resolve_tracking_uri(base.spec)  # start_run checks it is reachable (runner.tracking.store.open_store)
    description = {
        "mode": "bench",
        "bench": {"configurations": config_ids, "steps": report.steps, "warmup": report.warmup},
        "global_batch_size": report.global_batch_size,
    }
    handle = start_run(
        base,
        description,
        run_name=f"bench-{report.name}",
        extra_tags={"runner.bench": "parent", "runner.bench.configs": ",".join(config_ids)},
        uri=uri,
        experiment=report.experiment,
    )
    report.parent_run_id, report.tracking_uri = handle.run_id, uri
    return Parent(uri, handle.run_id, report.experiment)


def start_child(
    parent: Parent | None, loaded: LoadedSpec, plan_description: dict[str, Any], result: ConfigResult, name: str
) -> str | None:
    """The configuration's child run, recorded as ``runner exec`` records a run (``None`` without tracking)."""
    from runner.tracking.runs import start_run

    if parent is None:
        return None
    tags = {
        "mlflow.parentRunId": parent.run_id,
        "runner.bench.config": result.config,
        "runner.bench.mode": result.mode,
        "runner.bench.nproc": str(result.n),
    }
    handle = start_run(
        loaded,
        plan_description,
        run_name=f"{result.config} bench {name}",  # the configuration first: the runs table cuts names
        extra_tags=tags,
        uri=parent.uri,
        experiment=parent.experiment,
    )
    return handle.run_id


def log_history(uri: str, run_id: str, history: Sequence[tuple[int, dict[str, float]]]) -> None:
    """Log a repeat's metrics, step by step, as the training rank would have."""
    from runner.tracking.mlflow_tracker import MlflowTracker

    with MlflowTracker(uri, run_id) as tracker:
        for step, metrics in history:
            tracker.log_metrics(metrics, step=step)


def record_child(uri: str, result: ConfigResult, warmup: int, steps: int) -> None:
    """Log the bench params and figures on a finished child run."""
    from runner.tracking.parents import record_summary

    params = {
        "bench.mode": result.mode,
        "bench.nproc": str(result.n),
        "bench.steps": str(steps),
        "bench.warmup": str(warmup),
        "bench.repeats": str(result.repeats),
    }
    if result.run_id is not None:
        record_summary(uri, result.run_id, metrics=_figures(result, ""), params=params)


def record_parent(report: BenchReport, parent: Parent) -> None:
    """Log per-configuration figures and params, ``bench/bench.json`` and ``bench/bench.png`` on the parent run."""
    from runner.tracking.parents import record_summary

    metrics = {k: v for c in report.configs if c.status == "ok" for k, v in _figures(c, f"{c.config}/").items()}
    params = {
        "bench.steps": str(report.steps),
        "bench.warmup": str(report.warmup),
        "bench.configurations": ",".join(c.config for c in report.configs),
    }
    files = [f for f in (report.json_path, report.png_path) if f]
    tags = {"runner.bench.recommendation": report.recommendation} if report.recommendation else {}
    record_summary(parent.uri, parent.run_id, metrics=metrics, params=params, tags=tags, files=files, files_dir="bench")


def _figures(result: ConfigResult, prefix: str) -> dict[str, float]:
    """The metrics of one configuration: ``bench/<prefix><figure>``, figures that exist only."""
    values = {
        "samples_per_s": result.samples_per_s,
        "step_time_median_s": result.step_time_median_s,
        "step_time_p90_s": result.step_time_p90_s,
        "data_wait_fraction": result.data_wait_fraction,
        "scaling_efficiency": result.scaling_efficiency,
        "final_loss": result.final_loss,
        "samples_per_s_spread": result.spread,
        "step_time_tail": result.tail,
        "peak_memory_max_bytes": float(max(result.peak_memory_bytes)) if result.peak_memory_bytes else None,
    }
    return {f"bench/{prefix}{k}": float(v) for k, v in values.items() if v is not None}

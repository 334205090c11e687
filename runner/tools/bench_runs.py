"""Measuring one configuration of ``runner bench``: its repeats on the warm pool, until steady, and what bench records
in MLflow of it: a child run under the comparison's parent (:mod:`runner.tools.compare`), its figures and files.

Measuring is apart from the report so that what bench records in MLflow (a child run per configuration, the
figures on the parent) and how long it measures (repeats until steady) can change without the report.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from runner.errors import Interrupted
from runner.spec.schema_parallel import MODES
from runner.tools.bench_pool import Job, Reply, WarmPool, free_port
from runner.tools.bench_report import BenchReport, ConfigResult
from runner.tools.compare import (
    Parent,
    final_loss,
    log_history,
    median,
    noise,
    percentile,
    spread,
    start_parent,
    steady,
    tail,
    throughput,
)
from runner.tracking.runs import TrackedRun, start_run

if TYPE_CHECKING:
    from runner.plan import Plan
    from runner.spec.loading import LoadedSpec
    from runner.training import WorkerResult


def start_bench_parent(base: LoadedSpec, report: BenchReport, configs: list[str]) -> Parent | None:
    bench = {"steps": report.steps, "warmup": report.warmup}
    return start_parent(base, report, "bench", configs, bench=bench, global_batch_size=report.global_batch_size)


def start_child(
    parent: Parent | None, loaded: LoadedSpec, plan_description: dict[str, Any], result: ConfigResult, name: str
) -> TrackedRun | None:
    """The configuration's child run, recorded as ``runner exec`` records a run (``None`` without tracking)."""
    if parent is None:
        return None
    tags = {
        "mlflow.parentRunId": parent.run_id,
        "runner.bench.config": result.config,
        "runner.bench.mode": result.mode,
        "runner.bench.nproc": str(result.n),
    }
    record = start_run(
        loaded,
        plan_description,
        run_name=f"{result.config} bench {name}",  # the configuration first: the runs table cuts names
        extra_tags=tags,
        uri=parent.uri,
        experiment=parent.experiment,
    )
    return TrackedRun(parent.uri, record.run_id)


def record_child(uri: str, result: ConfigResult, warmup: int, steps: int) -> None:
    """Log the bench params and figures on a finished child run."""
    params = {
        "bench.mode": result.mode,
        "bench.nproc": str(result.n),
        "bench.steps": str(steps),
        "bench.warmup": str(warmup),
        "bench.repeats": str(result.repeats),
    }
    if result.run_id is not None:
        TrackedRun(uri, result.run_id).log(metrics=_figures(result, ""), params=params)


def record_parent(report: BenchReport, parent: Parent) -> None:
    """Log per-configuration figures and params, ``bench/bench.json`` and ``bench/bench.png`` on the parent run."""
    metrics = {k: v for c in report.configs if c.status == "ok" for k, v in _figures(c, f"{c.config}/").items()}
    params = {
        "bench.steps": str(report.steps),
        "bench.warmup": str(report.warmup),
        "bench.configurations": ",".join(c.config for c in report.configs),
    }
    files = [f for f in (report.json_path, report.png_path) if f]
    tags = {"runner.bench.recommendation": report.recommendation} if report.recommendation else {}
    parent.log(metrics=metrics, params=params, tags=tags, files=files, files_dir="bench")


def _figures(result: ConfigResult, prefix: str) -> dict[str, float]:
    """The metrics of one configuration: ``bench/<prefix><figure>``, figures that exist only."""
    names = ("samples_per_s", "step_time_median_s", "step_time_p90_s", "data_wait_fraction", "scaling_efficiency")
    values = {name: getattr(result, name) for name in (*names, "final_loss")}
    peak = float(max(result.peak_memory_bytes)) if result.peak_memory_bytes else None
    values.update(samples_per_s_spread=result.spread, step_time_tail=result.tail, peak_memory_max_bytes=peak)
    return {f"bench/{prefix}{k}": float(v) for k, v in values.items() if v is not None}


@dataclass
class Config:
    """A configuration to measure: its result row and, when it can run, its spec, plan and child MLflow run."""

    result: ConfigResult
    loaded: LoadedSpec | None = None
    accelerator: str = "cpu"
    world_size: int = 1
    batch_sizes: list[int] = field(default_factory=list)
    plan: Plan | None = None
    child: TrackedRun | None = None


def open_child(config: Config, parent: Parent | None, name: str) -> None:
    """Create the configuration's child run (before measuring starts, while the workers warm up)."""
    if config.loaded is not None and config.plan is not None:
        config.child = start_child(parent, config.loaded, config.plan.describe(), config.result, name)


def measure_config(config: Config, report: BenchReport, parent: Parent | None, pool: WarmPool, which: str) -> None:
    """Repeat one configuration until its figures are steady (or the repeats run out); finish its child run."""
    result = config.result
    child = config.child
    try:
        rows, history, bad = repeats(config, report, pool, which)
    except (Interrupted, KeyboardInterrupt):
        if child is not None:
            child.end("KILLED")
        raise
    if bad is not None:
        result.status = bad.status
        result.reason = bad.reason
        if child is not None and bad.status == "skipped":
            child.delete()  # a name or kwarg that only fails when built: no stray run
        elif child is not None:
            child.end("FAILED", bad.reason)
        return
    combine(result, rows)
    if child is not None:
        result.run_id = child.run_id
        log_history(child, history)
        child.end("FINISHED")


def repeats(
    config: Config, report: BenchReport, pool: WarmPool, which: str
) -> tuple[list[ConfigResult], list[tuple[int, dict[str, float]]], Reply | None]:
    """Train ``config`` on the pool until steady: ``(one summarized row per repeat, first history, bad reply)``. Raises
    Interrupted: SIGINT arrived, here or in a worker."""
    result = config.result
    rows: list[ConfigResult] = []
    history: list[tuple[int, dict[str, float]]] = []
    while len(rows) < report.max_repeats:
        print(
            f"runner bench: {result.config} ({which}): repeat {len(rows) + 1}, {report.warmup} + {report.steps} steps",
            file=sys.stderr,
            flush=True,
        )
        replies = pool.run(_jobs(config))
        bad = next((r for r in replies if r.status != "ok"), None)
        if bad is not None and bad.status == "interrupted":
            raise Interrupted()
        if bad is not None:
            return rows, history, bad
        workers = [r.result for r in replies if r.result is not None]
        history = history or workers[0].history
        row = ConfigResult(result.config, result.mode, result.n)
        # the pool sees the widest configuration's GPUs; this one uses the first of them
        peaks = replies[0].cuda_peaks[: len(config.plan.devices.selected)] if config.plan else []
        summarize(row, workers, workers[0].history, config.batch_sizes, report.warmup, report.steps, peaks)
        rows.append(row)
        rates, times = [r.samples_per_s or 0.0 for r in rows], [t for r in rows for t in r.step_times_s]
        if len(rows) >= report.min_repeats and steady(spread(rates), tail(times)):
            break
    return rows, history, None


def summarize(
    result: ConfigResult,
    ranks: Sequence[WorkerResult],
    history: Sequence[tuple[int, Mapping[str, float]]],
    batch_sizes: Sequence[int],
    warmup: int,
    steps: int,
    cuda_peaks: Sequence[int] = (),
) -> None:
    """Fill ``result`` from one training of ``warmup + steps`` steps: every rank's result, the logging rank's
    ``history`` and ``cuda_peaks`` (bytes) of an in-process run."""
    workers = sorted(ranks, key=lambda w: w.rank)
    timed = [list(w.step_times_s[warmup : warmup + steps]) for w in workers]
    slowest = max(range(len(workers)), key=lambda i: sum(timed[i]))
    times = timed[slowest]
    waits = list(workers[slowest].data_wait_s[warmup : warmup + len(times)])
    cycle = list(batch_sizes) or [0]
    samples = sum(cycle[k % len(cycle)] for k in range(warmup, warmup + len(times)))
    result.timed_steps = len(times)
    result.step_times_s = list(times)
    result.data_wait_s = waits
    result.timed_samples = samples
    result.samples_per_s = throughput(samples, times)
    _step_figures(result, times, waits)
    on_cuda = any(str(w.device).startswith("cuda") for w in workers)
    if on_cuda and not MODES[result.mode].elastic and cuda_peaks:
        result.peak_memory_bytes = [int(b) for b in cuda_peaks]
        result.devices = [f"cuda:{i}" for i in range(len(cuda_peaks))]
    else:
        result.peak_memory_bytes = [int(w.peak_memory_bytes) for w in workers]
        result.devices = [str(w.device) for w in workers]
    result.peak_memory_kind = "cuda_allocated" if on_cuda else "cpu_rss"
    result.final_loss = final_loss(history)
    result.train_losses = {int(step): float(m["train/loss"]) for step, m in history if "train/loss" in m}


def combine(result: ConfigResult, repeats: Sequence[ConfigResult]) -> None:
    """Fill ``result`` from its repeats: median samples/s, step percentiles and data wait over all timed steps,
    largest peak; run id, devices and losses from the first (every repeat trains the same steps)."""
    first = repeats[0]
    times = [t for r in repeats for t in r.step_times_s]
    waits = [w for r in repeats for w in r.data_wait_s]
    rates = [r.samples_per_s or 0.0 for r in repeats]
    for name in ("run_id", "devices", "timed_steps", "timed_samples", "peak_memory_kind", "final_loss"):
        setattr(result, name, getattr(first, name))
    result.train_losses = dict(first.train_losses)
    result.step_times_s = times
    result.data_wait_s = waits
    result.repeats = len(repeats)
    result.repeat_samples_per_s = rates
    result.samples_per_s = median(rates)
    _step_figures(result, times, waits)
    width = max(len(r.peak_memory_bytes) for r in repeats)
    result.peak_memory_bytes = [
        max(r.peak_memory_bytes[i] for r in repeats if i < len(r.peak_memory_bytes)) for i in range(width)
    ]
    result.spread, result.tail = spread(rates), tail(times)
    result.steady = steady(result.spread, result.tail)
    result.noise = noise(result.spread, result.tail)


def _step_figures(result: ConfigResult, times: Sequence[float], waits: Sequence[float]) -> None:
    """Median and p90 step time (seconds) and the fraction of step time spent waiting for data."""
    result.step_time_median_s = median(times)
    result.step_time_p90_s = percentile(times, 90)
    total = sum(times)
    result.data_wait_fraction = sum(waits) / total if total > 0 else None


def _jobs(config: Config) -> list[Job]:
    """One repeat's job per rank; the ranks of a mode of one process per device meet on a fresh local port."""
    assert config.loaded is not None and config.plan is not None  # runnable
    elastic = MODES[config.result.mode].elastic
    port = free_port() if elastic else 0
    devices = config.plan.devices
    return [Job(config.loaded, devices, rank, config.world_size, port, elastic) for rank in range(config.world_size)]

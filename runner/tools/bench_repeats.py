"""Measuring one ``runner bench`` configuration: its repeats on the warm pool, until steady, and its child run."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from runner.errors import Interrupted
from runner.spec.schema_parallel import MODES
from runner.tools.bench_figures import spread, steady, tail
from runner.tools.bench_measure import combine, summarize
from runner.tools.bench_pool import Job, Reply, WarmPool, free_port
from runner.tools.bench_report import BenchReport, ConfigResult
from runner.tools.bench_runs import Parent, log_history, start_child

if TYPE_CHECKING:
    from runner.plan import Plan
    from runner.spec.loading import LoadedSpec
    from runner.training import WorkerResult


@dataclass
class Config:
    """A configuration to measure: its result row and, when it can run, its spec, plan and child MLflow run."""

    result: ConfigResult
    loaded: LoadedSpec | None = None
    accelerator: str = "cpu"
    world_size: int = 1
    batch_sizes: list[int] = field(default_factory=list)
    plan: Plan | None = None
    child_run_id: str | None = None


class _Trained(NamedTuple):
    """One repeat's results in the shape :func:`runner.tools.bench_measure.summarize` reads."""

    run_id: str | None
    workers: list[WorkerResult]
    history: list[tuple[int, dict[str, float]]]


def open_child(config: Config, parent: Parent | None, name: str) -> None:
    """Create the configuration's child run (before measuring starts, while the workers warm up)."""
    if config.loaded is not None and config.plan is not None:
        config.child_run_id = start_child(parent, config.loaded, config.plan.describe(), config.result, name)


def measure_config(config: Config, report: BenchReport, parent: Parent | None, pool: WarmPool, which: str) -> None:
    """Repeat one configuration until its figures are steady (or the repeats run out); finish its child run."""
    from runner.tracking.runs import delete_run, end_run

    result, child = config.result, config.child_run_id
    uri = parent.uri if parent is not None else ""
    try:
        rows, history, bad = repeats(config, report, pool, which)
    except (Interrupted, KeyboardInterrupt):
        if child is not None:
            end_run(uri, child, "KILLED")
        raise
    if bad is not None:
        result.status, result.reason = bad.status, bad.reason
        if child is not None and bad.status == "skipped":
            delete_run(uri, child)  # a name or kwarg that only fails when built: no stray run
        elif child is not None:
            end_run(uri, child, "FAILED", bad.reason)
        return
    combine(result, rows)
    result.run_id = child
    if child is not None:
        log_history(uri, child, history)
        end_run(uri, child, "FINISHED")


def repeats(
    config: Config, report: BenchReport, pool: WarmPool, which: str
) -> tuple[list[ConfigResult], list[tuple[int, dict[str, float]]], Reply | None]:
    """Train ``config`` on the pool until steady: ``(one summarized row per repeat, first history, bad reply)``.

    Raises:
        Interrupted: SIGINT arrived, here or in a worker.
    """
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
        trained = _Trained(None, workers, workers[0].history)
        # the pool sees the widest configuration's GPUs; this one uses the first of them
        peaks = replies[0].cuda_peaks[: len(config.plan.devices.selected)] if config.plan else []
        summarize(row, trained, config.batch_sizes, warmup=report.warmup, steps=report.steps, cuda_peaks=peaks)
        rows.append(row)
        rates, times = [r.samples_per_s or 0.0 for r in rows], [t for r in rows for t in r.step_times_s]
        if len(rows) >= report.min_repeats and steady(spread(rates), tail(times)):
            break
    return rows, history, None


def _jobs(config: Config) -> list[Job]:
    """One repeat's job per rank; the ranks of a mode of one process per device meet on a fresh local port."""
    assert config.loaded is not None and config.plan is not None  # runnable
    elastic = MODES[config.result.mode].elastic
    port = free_port() if elastic else 0
    devices = config.plan.devices
    return [Job(config.loaded, devices, rank, config.world_size, port, elastic) for rank in range(config.world_size)]

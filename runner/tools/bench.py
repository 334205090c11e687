"""``runner bench``: train one spec in each parallel mode side by side and measure each configuration.

Every configuration trains the SAME spec (model, data, optimizer, seed, global batch) for
``warmup + steps`` optimizer steps as a child MLflow run of one parent run, both in the experiment
``<experiment>/bench`` (so its per-configuration figures stay off the training experiment's
charts); only the parallel mode and the device/process count change:

* ``none``: one device (``devices.ids = [0]``), measured once whatever ``nprocs`` says;
* ``dp-n``: ``torch.nn.DataParallel`` over ``devices.ids = [0 .. n-1]``, for every ``n >= 2`` in
  ``nprocs`` (dp on one device is ``none``);
* ``ddp-n``: ``parallel.nproc_per_node = n`` processes on this machine; on CUDA one per GPU
  (``devices.ids = [0 .. n-1]``), on CPU with the gloo backend (``devices.accelerator`` stays as
  the spec says).

The bench overrides ``train.max_steps = warmup + steps`` (``train.epochs`` large enough to reach
it, evaluation only once at the end), ``checkpoint.enabled = false``, ``train.progress = "off"``
and ``train.log_every_n_steps = 1``. Multi-node settings are dropped: the bench runs on one machine.

Every repeat of every configuration runs in warm worker processes started once, at the
beginning (``runner.tools.bench_pool``), while this process plans, probes the model and opens
the MLflow runs. A configuration is repeated until its figures are steady or ``max_repeats`` is
spent (``runner.tools.compare``); its child run records the first repeat's metrics, as
``runner exec`` would, and the figures over all repeats. A configuration that cannot run here (dp
without two GPUs, more ddp processes than GPUs, a batch that does not divide) is listed as
skipped with the reason; a configuration that fails while training is listed as failed and the
parent run ends FAILED.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from runner.devices.inventory import HostLoad
from runner.errors import DeviceError, Interrupted, SpecError, TrackingError, TrainingError, UsageError
from runner.spec.schema_parallel import MODES
from runner.tools.bench_pool import Probe, Reply, WarmPool
from runner.tools.bench_report import (
    BenchReport,
    ConfigResult,
    finish_comparisons,
    recommend,
    write_chart,
    write_json,
)
from runner.tools.bench_runs import (
    Config,
    measure_config,
    open_child,
    record_child,
    record_parent,
    start_bench_parent,
)
from runner.tools.compare import (
    LOSS_TOLERANCE,
    Parent,
    check_modes,
    comparability,
    config_id,
    derive,
    ending,
    probe_model_and_data,
    reason,
)

if TYPE_CHECKING:
    from runner.spec.loading import LoadedSpec

DEFAULT_OUT_DIR = "bench-results"


def configurations(modes: Sequence[str], nprocs: Sequence[int]) -> list[tuple[str, int]]:
    """The ``(mode, n)`` pairs to measure in run order (none, dp, ddp, fsdp); UsageError for an unknown mode or bad
    count."""
    check_modes(modes)
    if not nprocs or any(n < 1 for n in nprocs):
        raise UsageError(f"--nproc: expected positive device / process counts, e.g. 1,2; got {list(nprocs)}")
    counts = sorted(set(nprocs))
    out: list[tuple[str, int]] = []
    for mode in (m for m in MODES if m in modes):
        traits = MODES[mode]
        if traits.elastic:
            out += [(mode, n) for n in counts]
        elif traits.replicas:
            out += [(mode, n) for n in counts if n >= 2]
        else:
            out.append((mode, 1))
    return out


def run_bench(
    path: str | Path,
    overrides: Sequence[str] = (),
    unset: Sequence[str] = (),
    *,
    modes: Sequence[str] = tuple(MODES),
    nprocs: Sequence[int] = (1, 2),
    steps: int = 20,
    warmup: int = 3,
    repeats: tuple[int, int] = (2, 4),
    out_dir: str | Path | None = None,
) -> BenchReport:
    """Measure the spec under every configuration and record one parent MLflow run.

    Each repeat runs ``warmup`` untimed and ``steps`` timed steps; ``repeats = (min, max)``; files go to ``out_dir``.
    Raises UsageError: Bad arguments, or started under torchrun. SpecError: The spec is invalid, or its model or data
    cannot be built. TrackingError: The tracking store cannot be reached. Interrupted: SIGINT; the parent run and the
    running child end KILLED."""
    from runner.plan import launched_externally
    from runner.spec.loading import load_spec

    if steps < 1 or warmup < 0:
        raise UsageError(f"--steps must be >= 1 and --warmup >= 0, got steps={steps}, warmup={warmup}")
    if not 1 <= repeats[0] <= repeats[1]:
        raise UsageError(f"--repeats MIN:MAX needs 1 <= MIN <= MAX, got {repeats[0]}:{repeats[1]}")
    pairs = configurations(modes, nprocs)
    if launched_externally(os.environ):
        raise UsageError("runner bench starts its own workers: run it directly, not under torchrun or a scheduler")
    base = load_spec(path, overrides, unset)
    configs = [_prepare(base, mode, n, steps, warmup) for mode, n in pairs]
    runnable = [c for c in configs if c.loaded is not None]
    pool = _pool_for(runnable)
    try:
        pool.start()  # the workers import torch while this process opens the parent run
        if runnable:
            for rank in range(pool.size):  # every worker builds the data and model once: warm for the repeats
                pool.submit(rank, Probe(base))
        report = _report(base, configs, runnable, steps, warmup, repeats)
        out = Path(out_dir if out_dir is not None else DEFAULT_OUT_DIR).resolve()
        out.mkdir(parents=True, exist_ok=True)
        parent = start_bench_parent(base, report, [c.result.config for c in configs])
        try:
            for config in runnable:
                open_child(config, parent, report.name)
            answers = [pool.collect(rank) for rank in range(pool.size)] if runnable else [probe_model_and_data(base)]
            _probed(base, report, runnable, next((a for a in answers if not isinstance(a, tuple)), answers[0]))
        except BaseException:  # a model or dataset that does not build: a bad spec, no stray run
            if parent is not None:
                for run in [*(c.child for c in runnable if c.child is not None), parent]:
                    run.delete()
            raise
        _run_under_parent(runnable, report, parent, out, pool)
    finally:
        pool.close()
    return report


def _host_load(load: HostLoad, parent: Parent | None) -> str:
    """How busy the host was while the configurations ran, for the report and the parent's tags."""
    text = load.describe(load.cores)  # the largest configuration uses every core
    if parent is not None:
        with contextlib.suppress(TrackingError):
            parent.log(tags=load.tags(load.cores), remarks={"host load": text})
    return text


def _pool_for(runnable: Sequence[Config]) -> WarmPool:
    """Warm processes for the widest runnable configuration, seeing its devices."""
    widest = max(runnable, key=lambda c: (c.world_size, len(c.plan.devices.selected) if c.plan else 0), default=None)
    if widest is None or widest.plan is None:
        return WarmPool(0)
    return WarmPool(widest.world_size, widest.plan.devices.env)


def _report(
    base: LoadedSpec,
    configs: list[Config],
    runnable: list[Config],
    steps: int,
    warmup: int,
    repeats: tuple[int, int],
) -> BenchReport:
    """The report before anything is measured (what the model holds is filled in by :func:`_probed`)."""
    spec = base.spec
    return BenchReport(
        spec=str(base.path),
        name=spec.name,
        accelerator=runnable[0].accelerator if runnable else "cpu",
        global_batch_size=spec.data.batch_size,
        steps=steps,
        warmup=warmup,
        batch_statistics=False,
        min_repeats=repeats[0],
        max_repeats=repeats[1],
        configs=[c.result for c in configs],
        loss_tolerance=LOSS_TOLERANCE,
        experiment=f"{spec.experiment_name}/bench",
    )


def _probed(
    base: LoadedSpec,
    report: BenchReport,
    runnable: Sequence[Config],
    probe: tuple[int, bool, bool] | Reply | BaseException,
) -> None:
    """Take the probe's answer: the model's layers into the report, batch sizes into each configuration, or raise."""
    from runner.spec.loading import relocate_issues

    if isinstance(probe, SpecError):
        raise relocate_issues(probe, base)
    if isinstance(probe, BaseException):
        raise probe
    if isinstance(probe, Reply):
        raise TrainingError(probe.reason)
    num_train, report.batch_statistics, report.dropout = probe
    fill_batch_sizes(runnable, num_train)


def fill_batch_sizes(configs: Sequence[Config], num_train: int) -> None:
    """Fill in each runnable configuration's global batch sizes of one epoch of ``num_train`` training samples."""
    from runner.training.sampling import global_batch_sizes

    for c in configs:
        assert c.loaded is not None
        data = c.loaded.spec.data
        c.batch_sizes = global_batch_sizes(num_train, data.batch_size, data.drop_last, c.world_size)


def _run_under_parent(
    runnable: Sequence[Config], report: BenchReport, parent: Parent | None, out: Path, pool: WarmPool
) -> None:
    """Measure everything inside the parent run, and end the parent with how that went."""
    try:
        with ending(parent) as outcome:
            _measure_all(runnable, report, parent, out, pool)
            failures = [c for c in report.configs if c.status == "failed"]
            if failures:
                outcome.update(status="FAILED", error="\n".join(f"{c.config}: {c.reason}" for c in failures))
    except KeyboardInterrupt:
        raise Interrupted() from None


def _measure_all(
    runnable: Sequence[Config], report: BenchReport, parent: Parent | None, out: Path, pool: WarmPool
) -> None:
    """Measure every runnable configuration, compare them with ``none``, write and record the results."""
    started = HostLoad.read()
    for i, config in enumerate(runnable, 1):
        try:
            measure_config(config, report, parent, pool, f"{i}/{len(runnable)}")
        except (Interrupted, KeyboardInterrupt):
            if parent is not None:  # the child runs not measured yet end with the bench
                for later in runnable[i:]:
                    if later.child is not None:
                        later.child.end("KILLED")
            raise
    report.host_load = _host_load(HostLoad.since(started), parent)
    not_comparable = comparability(report.batch_statistics, report.dropout)
    finish_comparisons(report.configs, not_comparable=not_comparable, tolerance=LOSS_TOLERANCE)
    report.recommendation = recommend(report.configs)
    report.json_path = str(out / "bench.json")
    report.png_path = str(out / "bench.png")
    if parent is not None:
        for row in report.configs:
            if row.status == "ok" and row.run_id:
                record_child(parent.uri, row, report.warmup, report.steps)
    write_json(report, Path(report.json_path))
    write_chart(report, Path(report.png_path))
    if parent is not None:
        record_parent(report, parent)


# ----------------------------------------------------------------------------- preparing


def _prepare(base: LoadedSpec, mode: str, n: int, steps: int, warmup: int) -> Config:
    """Validate and plan one configuration; a spec or device problem makes it a skipped row."""
    result = ConfigResult(config=config_id(mode, n), mode=mode, n=n)
    try:
        loaded, plan = derive(base, mode, n, steps, warmup)
    except (SpecError, DeviceError, UsageError) as exc:
        result.status, result.reason = "skipped", reason(exc)
        return Config(result)
    result.threads_per_process = plan.devices.threads_per_process
    result.thread_budget = plan.devices.threads_per_process * (
        plan.devices.nproc_per_node if MODES[mode].elastic else 1
    )
    return Config(result, loaded, plan.devices.accelerator, plan.devices.world_size, plan=plan)

"""``runner bench``: train one spec as none, dp and ddp side by side and measure each configuration.

Every configuration trains the SAME spec (model, data, optimizer, seed, global batch) for
``warmup + steps`` optimizer steps as a child MLflow run of one parent run; only the parallel
mode and the device/process count change:

* ``none``: one device (``devices.ids = [0]``), measured once whatever ``nprocs`` says;
* ``dp-n``: ``torch.nn.DataParallel`` over ``devices.ids = [0 .. n-1]``, for every ``n >= 2`` in
  ``nprocs`` (dp on one device is ``none``);
* ``ddp-n``: ``parallel.nproc_per_node = n`` processes on this machine; on CUDA one per GPU
  (``devices.ids = [0 .. n-1]``), on CPU with the gloo backend (``devices.accelerator`` stays as
  the spec says).

The bench overrides ``train.max_steps = warmup + steps`` (``train.epochs`` large enough to reach
it, evaluation only once at the end), ``checkpoint.enabled = false``, ``train.progress = "off"``
and ``train.log_every_n_steps = 1``. Multi-node settings are dropped: the bench runs on one machine.

Each configuration runs in a fresh process (:mod:`runner.tools.bench_measure`). A configuration
that cannot run here (dp without two GPUs, more ddp processes than GPUs, a batch that does not
divide) is listed as skipped with the reason; a configuration that fails while training is listed
as failed and the parent run ends FAILED.
Figures are defined in :mod:`runner.tools.bench_figures`.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from runner.errors import DeviceError, Interrupted, SpecError, UsageError
from runner.tools.bench_chart import write_chart
from runner.tools.bench_figures import LOSS_TOLERANCE, comparability
from runner.tools.bench_measure import measure, reason
from runner.tools.bench_report import BenchReport, ConfigResult, config_id, finish_comparisons, write_json

if TYPE_CHECKING:
    from runner.spec.loading import LoadedSpec

MODES = ("none", "dp", "ddp")
DEFAULT_OUT_DIR = "bench-results"
# Options that only make sense for one mode, or for several nodes (the bench runs on one machine).
_DP_KEYS = ("output_device", "dim")
_DDP_KEYS = (
    "backend",
    "timeout_s",
    "find_unused_parameters",
    "static_graph",
    "gradient_as_bucket_view",
    "sync_batchnorm",
)
_MULTI_NODE_KEYS = ("nproc_per_node", "nnodes", "node_rank", "rdzv_endpoint", "rdzv_id", "max_restarts")


@dataclasses.dataclass
class _Config:
    """A configuration to measure: its result row and, when it can run, its spec."""

    result: ConfigResult
    loaded: LoadedSpec | None = None
    accelerator: str = "cpu"
    world_size: int = 1
    batch_sizes: list[int] = dataclasses.field(default_factory=list)


class _Parent(NamedTuple):
    """The bench's parent run."""

    uri: str
    run_id: str


def configurations(modes: Sequence[str], nprocs: Sequence[int]) -> list[tuple[str, int]]:
    """The ``(mode, n)`` pairs to measure, in run order: none, then dp, then ddp.

    Args:
        modes: Subset of ``none``, ``dp``, ``ddp``.
        nprocs: Device counts (dp) / process counts (ddp); duplicates are ignored.

    Returns:
        ``[("none", 1), ("dp", n) for n >= 2, ("ddp", n) ...]``.

    Raises:
        UsageError: An unknown mode, an empty list or a count below 1.
    """
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        raise UsageError(
            f"--modes: expected a comma-separated subset of {','.join(MODES)}, got {','.join(modes) or 'nothing'}"
        )
    if not nprocs or any(n < 1 for n in nprocs):
        raise UsageError(f"--nproc: expected positive device / process counts, e.g. 1,2; got {list(nprocs)}")
    counts = sorted(set(nprocs))
    out: list[tuple[str, int]] = []
    if "none" in modes:
        out.append(("none", 1))
    if "dp" in modes:
        out += [("dp", n) for n in counts if n >= 2]
    if "ddp" in modes:
        out += [("ddp", n) for n in counts]
    return out


def bench_spec_data(data: dict[str, Any], mode: str, n: int, steps: int, warmup: int) -> dict[str, Any]:
    """Derive the raw spec dict of one configuration from the user's merged spec dict.

    Args:
        data: ``LoadedSpec.data`` (after ``extends`` and ``--set``; not modified).
        mode: ``none``, ``dp`` or ``ddp``.
        n: Devices (dp) or processes (ddp); 1 for none.
        steps: Timed optimizer steps.
        warmup: Untimed optimizer steps before them.

    Returns:
        A new dict, to validate with :func:`runner.spec.loading.spec_from_dict`.
    """
    d = copy.deepcopy(data)
    par = {k: v for k, v in (d.get("parallel") or {}).items() if k not in _MULTI_NODE_KEYS}
    if mode != "dp":
        par = {k: v for k, v in par.items() if k not in _DP_KEYS}
    if mode != "ddp":
        par = {k: v for k, v in par.items() if k not in _DDP_KEYS}
    par["mode"] = mode
    if mode == "ddp":
        par["nproc_per_node"] = n
    d["parallel"] = par
    d.setdefault("devices", {})["ids"] = list(range(n))
    total = warmup + steps
    train = d.setdefault("train", {})
    train.update(max_steps=total, epochs=total, eval_every_n_epochs=total, progress="off", log_every_n_steps=1)
    d.setdefault("checkpoint", {})["enabled"] = False
    return d


def run_bench(
    path: str | Path,
    overrides: Sequence[str] = (),
    *,
    modes: Sequence[str] = MODES,
    nprocs: Sequence[int] = (1, 2),
    steps: int = 20,
    warmup: int = 3,
    out_dir: str | Path | None = None,
) -> BenchReport:
    """Measure the spec at ``path`` under every configuration and record one parent MLflow run.

    Args:
        path: The spec file.
        overrides: ``--set`` overrides, applied to every configuration.
        modes: Parallel modes to compare (``none``, ``dp``, ``ddp``).
        nprocs: dp device counts and ddp process counts (see :func:`configurations`).
        steps: Timed optimizer steps per configuration (>= 1).
        warmup: Untimed optimizer steps first (>= 0).
        out_dir: Folder for ``bench.json`` and ``bench.png`` (default ``./bench-results``).

    Returns:
        The :class:`~runner.tools.bench_report.BenchReport`; ``report.failed`` counts configurations
        that failed while training.

    Raises:
        UsageError: Bad arguments, or started under torchrun (the bench launches its own workers).
        SpecError: The spec is invalid, or its model or data cannot be built.
        TrackingError: The tracking store cannot be reached.
        Interrupted: SIGINT arrived; the parent run (and the running child) end KILLED.
    """
    from runner.plan import launched_externally
    from runner.spec.loading import load_spec

    if steps < 1 or warmup < 0:
        raise UsageError(f"--steps must be >= 1 and --warmup >= 0, got steps={steps}, warmup={warmup}")
    pairs = configurations(modes, nprocs)
    if launched_externally(os.environ):
        raise UsageError(
            "runner bench starts its own workers: run it directly, not under torchrun or a scheduler's launcher"
        )
    base = load_spec(path, overrides)
    num_train, batch_statistics, dropout = probe_model_and_data(base)
    configs = [_prepare(base, mode, n, steps, warmup, num_train=num_train) for mode, n in pairs]
    runnable = [c for c in configs if c.loaded is not None]
    spec = base.spec
    report = BenchReport(
        spec=str(base.path),
        name=spec.name,
        accelerator=runnable[0].accelerator if runnable else "cpu",
        global_batch_size=spec.data.batch_size,
        steps=steps,
        warmup=warmup,
        batch_statistics=batch_statistics,
        dropout=dropout,
        configs=[c.result for c in configs],
        loss_tolerance=LOSS_TOLERANCE,
        experiment=spec.tracking.experiment or spec.name,
    )
    out = Path(out_dir if out_dir is not None else DEFAULT_OUT_DIR).resolve()
    out.mkdir(parents=True, exist_ok=True)
    parent = _start_parent(base, report, [c.result.config for c in configs])
    status, error = "FAILED", None
    try:
        _measure_all(runnable, report, parent, out)
        failures = [c for c in report.configs if c.status == "failed"]
        status = "FAILED" if failures else "FINISHED"
        error = "\n".join(f"{c.config}: {c.reason}" for c in failures) or None
    except (Interrupted, KeyboardInterrupt):
        status = "KILLED"
        raise Interrupted() from None
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
        raise
    finally:
        if parent is not None:
            from runner.tracking.runs import end_run

            end_run(parent.uri, parent.run_id, status, error)
    return report


def _measure_all(runnable: Sequence[_Config], report: BenchReport, parent: _Parent | None, out: Path) -> None:
    """Measure every runnable configuration, compare them with ``none``, write and record the results."""
    from runner.launch.driver import ExecOptions

    warmup, steps = report.warmup, report.steps
    for i, config in enumerate(runnable, 1):
        result = config.result
        print(
            f"runner bench: {result.config} ({i}/{len(runnable)}): {warmup} + {steps} steps",
            file=sys.stderr,
            flush=True,
        )
        options = ExecOptions(
            parent_run_id=parent.run_id if parent else None,
            tags=(
                ("runner.bench.config", result.config),
                ("runner.bench.mode", result.mode),
                ("runner.bench.nproc", str(result.n)),
            ),
            run_name=f"{result.config} bench {report.name}",  # the configuration first: the runs table cuts names
            sync_timing=True,
        )
        assert config.loaded is not None  # runnable
        measure(config.loaded, result, batch_sizes=config.batch_sizes, options=options, warmup=warmup, steps=steps)
    not_comparable = comparability(report.batch_statistics, report.dropout)
    finish_comparisons(report.configs, not_comparable=not_comparable, tolerance=LOSS_TOLERANCE)
    if parent is not None:
        for row in report.configs:
            if row.status == "ok" and row.run_id:
                _record_child(parent.uri, row, warmup, steps)
    report.json_path = str(out / "bench.json")
    report.png_path = str(out / "bench.png")
    write_chart(report, Path(report.png_path))
    write_json(report, Path(report.json_path))
    if parent is not None:
        _record_parent(report, parent)


# ----------------------------------------------------------------------------- preparing


def _prepare(base: LoadedSpec, mode: str, n: int, steps: int, warmup: int, *, num_train: int) -> _Config:
    """Build and plan one configuration; a spec or device problem makes it a skipped row."""
    from runner.plan import make_plan
    from runner.spec.dump import spec_sha256
    from runner.spec.loading import spec_from_dict
    from runner.training.sampling import global_batch_sizes

    result = ConfigResult(config=config_id(mode, n), mode=mode, n=n)
    data = bench_spec_data(base.data, mode, n, steps, warmup)
    try:
        spec = spec_from_dict(data, origin=str(base.path))
        loaded = dataclasses.replace(base, spec=spec, data=data, sha256=spec_sha256(spec))
        plan = make_plan(loaded)
    except (SpecError, DeviceError, UsageError) as exc:
        result.status, result.reason = "skipped", reason(exc)
        return _Config(result)
    config = _Config(result, loaded, plan.devices.accelerator, plan.devices.world_size)
    config.batch_sizes = global_batch_sizes(
        num_train, spec.data.batch_size, spec.data.drop_last, plan.devices.world_size
    )
    return config


def probe_model_and_data(base: LoadedSpec) -> tuple[int, bool, bool]:
    """Build the datasets and the model of the user's spec once, on CPU (CUDA is never touched).

    Returns:
        ``(training samples, batch_statistics, dropout)``: whether the model holds a
        ``torch.nn.modules.batchnorm._BatchNorm`` (BatchNorm1d/2d/3d, SyncBatchNorm, ...), and
        whether it holds a dropout layer with ``p > 0`` (``torch.nn.modules.dropout._DropoutNd``).

    Raises:
        SpecError: The dataset or the model cannot be built from the spec.
    """
    import torch

    from runner.training.data import build_datasets
    from runner.training.models import build_model

    bundle = build_datasets(base.spec, base.path.parent)
    with torch.random.fork_rng(devices=[]):
        model = build_model(
            base.spec.model, base.path.parent, input_shape=bundle.info.input_shape, num_classes=bundle.info.num_classes
        )
    modules = list(model.modules())
    batch_statistics = any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in modules)
    dropout = any(isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0 for m in modules)
    return bundle.info.num_train, batch_statistics, dropout


# ----------------------------------------------------------------------------- tracking


def _start_parent(base: LoadedSpec, report: BenchReport, config_ids: list[str]) -> _Parent | None:
    """Create the parent run (``None`` when tracking is off)."""
    from runner.tracking.runs import start_run
    from runner.tracking.uri import check_reachable, resolve_tracking_uri

    if not base.spec.tracking.enabled:
        return None
    uri = resolve_tracking_uri(base.spec)
    check_reachable(uri)
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
    )
    report.parent_run_id, report.tracking_uri = handle.run_id, uri
    return _Parent(uri, handle.run_id)


def _record_child(uri: str, result: ConfigResult, warmup: int, steps: int) -> None:
    """Log the bench params and figures on a finished child run."""
    from runner.tracking.parents import record_summary

    params = {
        "bench.mode": result.mode,
        "bench.nproc": str(result.n),
        "bench.steps": str(steps),
        "bench.warmup": str(warmup),
    }
    if result.run_id is not None:
        record_summary(uri, result.run_id, metrics=_figures(result, ""), params=params)


def _record_parent(report: BenchReport, parent: _Parent) -> None:
    """Log per-configuration figures and params, ``bench/bench.json`` and ``bench/bench.png`` on the parent run."""
    from runner.tracking.parents import record_summary

    metrics = {k: v for c in report.configs if c.status == "ok" for k, v in _figures(c, f"{c.config}/").items()}
    params = {
        "bench.steps": str(report.steps),
        "bench.warmup": str(report.warmup),
        "bench.configurations": ",".join(c.config for c in report.configs),
    }
    files = [f for f in (report.json_path, report.png_path) if f]
    record_summary(parent.uri, parent.run_id, metrics=metrics, params=params, files=files, files_dir="bench")


def _figures(result: ConfigResult, prefix: str) -> dict[str, float]:
    """The metrics of one configuration: ``bench/<prefix><figure>``, figures that exist only."""
    values = {
        "samples_per_s": result.samples_per_s,
        "step_time_median_s": result.step_time_median_s,
        "step_time_p90_s": result.step_time_p90_s,
        "data_wait_fraction": result.data_wait_fraction,
        "scaling_efficiency": result.scaling_efficiency,
        "final_loss": result.final_loss,
        "peak_memory_max_bytes": float(max(result.peak_memory_bytes)) if result.peak_memory_bytes else None,
    }
    return {f"bench/{prefix}{k}": float(v) for k, v in values.items() if v is not None}


__all__ = ["BenchReport", "ConfigResult", "bench_spec_data", "configurations", "run_bench"]

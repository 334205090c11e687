"""Turning a configuration's step times into figures: one repeat (:func:`summarize`), then all (:func:`combine`).

The repeats themselves run in warm processes (:mod:`runner.tools.bench_pool`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

from runner.spec.schema_parallel import MODES
from runner.tools.bench_figures import median, noise, percentile, spread, steady, tail, throughput
from runner.tools.bench_report import ConfigResult

if TYPE_CHECKING:
    from runner.spec.loading import LoadedSpec
    from runner.training import WorkerResult


class Ran(Protocol):
    """What one training of a configuration left: every rank's result and the logging rank's history."""

    @property
    def run_id(self) -> str | None: ...

    @property
    def workers(self) -> Sequence[WorkerResult]: ...

    @property
    def history(self) -> list[tuple[int, dict[str, float]]]: ...


def summarize(
    result: ConfigResult,
    exec_result: Ran,
    batch_sizes: Sequence[int],
    *,
    warmup: int,
    steps: int,
    cuda_peaks: Sequence[int] = (),
) -> None:
    """Fill ``result`` from an :class:`runner.launch.driver.ExecResult` of ``warmup + steps`` steps.

    Args:
        exec_result: One training: ``workers`` holds every rank (an ``ExecResult`` has this shape).
        batch_sizes: Global samples of each optimizer step of an epoch (cycled over epochs).
        warmup: Steps to leave out of the timing.
        cuda_peaks: Allocator peak of every CUDA device of an in-process (none/dp) run, bytes.
    """
    workers = sorted(exec_result.workers, key=lambda w: w.rank)
    timed = [list(w.step_times_s[warmup : warmup + steps]) for w in workers]
    slowest = max(range(len(workers)), key=lambda i: sum(timed[i]))
    times = timed[slowest]
    waits = list(workers[slowest].data_wait_s[warmup : warmup + len(times)])
    cycle = list(batch_sizes) or [0]
    samples = sum(cycle[k % len(cycle)] for k in range(warmup, warmup + len(times)))
    result.run_id = exec_result.run_id
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
    result.final_loss = final_loss(exec_result.history)
    result.train_losses = {int(step): float(m["train/loss"]) for step, m in exec_result.history if "train/loss" in m}


def final_loss(history: Sequence[tuple[int, Mapping[str, float]]]) -> float | None:
    """``train/loss`` of the last step that logged it, from ``(step, metrics)`` pairs."""
    for _, metrics in reversed(list(history)):
        if "train/loss" in metrics:
            return float(metrics["train/loss"])
    return None


def reason(exc: BaseException) -> str:
    """The error's message on one line (its class name when it has none)."""
    text = str(exc).strip()
    return " ".join(text.split()) if text else type(exc).__name__


def combine(result: ConfigResult, repeats: Sequence[ConfigResult]) -> None:
    """Fill ``result`` from its repeats (each filled by :func:`summarize`): figures over all of them.

    samples/s is the median of the repeats' samples/s; step p50 / p90 and data wait are over the
    timed steps of all repeats; peak memory is the largest per rank; run id, devices, steps and
    losses are the first repeat's (every repeat trains the same steps from the same seed).

    Args:
        repeats: At least one summarized repeat, in order.
    """
    first = repeats[0]
    times = [t for r in repeats for t in r.step_times_s]
    waits = [w for r in repeats for w in r.data_wait_s]
    rates = [r.samples_per_s or 0.0 for r in repeats]
    for name in ("run_id", "devices", "timed_steps", "timed_samples", "peak_memory_kind", "final_loss"):
        setattr(result, name, getattr(first, name))
    result.train_losses = dict(first.train_losses)
    result.step_times_s, result.data_wait_s = times, waits
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


def probe_model_and_data(base: LoadedSpec) -> tuple[int, bool, bool]:
    """Build the datasets and the model of the user's spec once, on CPU (CUDA is never touched).

    Returns:
        ``(training samples, batch_statistics, dropout)``: whether the model holds batch-statistics
        layers and random layers (:func:`runner.launch.prebuild.layer_kinds`).

    Raises:
        SpecError: The dataset or the model cannot be built from the spec.
    """
    import torch

    from runner.launch.prebuild import layer_kinds
    from runner.training.data import build_datasets
    from runner.training.models import build_model

    bundle = build_datasets(base.spec, base.path.parent)
    with torch.random.fork_rng(devices=[]):
        model = build_model(
            base.spec.model, base.path.parent, input_shape=bundle.info.input_shape, num_classes=bundle.info.num_classes
        )
    batch_statistics, random = layer_kinds(model)
    return bundle.info.num_train, bool(batch_statistics), bool(random)

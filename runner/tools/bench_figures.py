"""The figures of a ``runner bench`` comparison and how they are computed from each repeat's step times (no torch).
Details: docs/design.md, "Module notes"."""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from runner.spec.schema_parallel import MODES

if TYPE_CHECKING:
    from runner.spec.loading import LoadedSpec
    from runner.tools.bench_report import ConfigResult
    from runner.training import WorkerResult

LOSS_TOLERANCE = 1e-4
SPREAD_LIMIT = 0.10  # repeats' samples/s may differ by 10 % of their median
TAIL_LIMIT = 1.5  # step p90 may be 1.5x the step p50
DDP1_FLOOR = 0.8  # ddp-1 below 80 % of none: DDP's fixed cost per step dominates, or load


def comparability(batch_statistics: bool, dropout: bool = False) -> str:
    """``""`` when losses of different modes must agree, else ``"not comparable: <why>"``."""
    kinds = [k for k, on in (("batch-statistics layers", batch_statistics), ("dropout layers", dropout)) if on]
    return "not comparable: " + " and ".join(kinds) if kinds else ""


def median(values: Sequence[float]) -> float:
    """Median of ``values`` (``nan`` when empty)."""
    return float(statistics.median(values)) if values else math.nan


def percentile(values: Sequence[float], q: float) -> float:
    """``numpy.percentile`` (``q`` in 0..100, linear interpolation; ``ValueError`` outside); ``nan`` when empty."""
    import numpy as np

    return float(np.percentile(values, q)) if len(values) else math.nan


def throughput(samples: int, step_times_s: Sequence[float]) -> float:
    """Samples per second over the given steps: ``samples / sum(step_times_s)`` (0 when no time)."""
    total = float(sum(step_times_s))
    return samples / total if total > 0 else 0.0


def scaling_efficiency(samples_per_s: float, baseline_samples_per_s: float | None, n: int) -> float | None:
    """``samples_per_s / (n * baseline_samples_per_s)``; ``None`` without a positive baseline."""
    if not baseline_samples_per_s or baseline_samples_per_s <= 0 or n < 1:
        return None
    return samples_per_s / (n * baseline_samples_per_s)


def loss_scale(curve: Mapping[int, float]) -> float:
    """The size of a ``{step: train/loss}`` curve's values: its largest finite |value|, at least 1."""
    return max([1.0, *(abs(v) for v in curve.values() if math.isfinite(v))])


def loss_deltas(curve: Mapping[int, float], baseline: Mapping[int, float]) -> dict[int, float]:
    """|curve - baseline| at every step either logged; infinite where one misses the step or a value is not finite."""
    out = {}
    for step in sorted(set(curve) | set(baseline)):
        a, b = curve.get(step), baseline.get(step)
        finite = a is not None and b is not None and math.isfinite(a) and math.isfinite(b)
        out[step] = abs(a - b) if finite else math.inf  # type: ignore[operator]
    return out


def first_beyond(deltas: Mapping[int, float], tolerance: float) -> int | None:
    """The one definition of disagreement, of bench and parity alike: the first step whose |Δ train/loss| against
    ``none`` exceeds ``tolerance`` (``None``: the curves agree at every step)."""
    return next((step for step in sorted(deltas) if deltas[step] > tolerance), None)


def loss_check(
    curve: Mapping[int, float],
    baseline: Mapping[int, float],
    *,
    not_comparable: str = "",
    tolerance: float = LOSS_TOLERANCE,
) -> tuple[str, int | None]:
    """A bench row's train/loss curve against none's, at ``tolerance`` relative to :func:`loss_scale` of none's:
    ``("ok" | "differs: ..." | "not comparable: ..." | "no baseline", last step through which the curves agree)``."""
    if not_comparable:
        return not_comparable, None
    if not curve or not baseline or not math.isfinite(baseline[max(baseline)]):
        return "no baseline", None
    deltas, allowed = loss_deltas(curve, baseline), tolerance * loss_scale(baseline)
    beyond, steps = first_beyond(deltas, allowed), sorted(deltas)
    if beyond is None:
        return "ok", steps[-1]
    through, last = (steps[steps.index(beyond) - 1] if beyond != steps[0] else None), steps[-1]
    text = (
        f"differs from step {beyond} by {deltas[beyond]:.2g} ({tolerance:g} of none's losses is {allowed:.2g}); "
        f"final {curve.get(last, math.nan):.6g} vs {baseline.get(last, math.nan):.6g} for none; "
        f"curves agree through step {through or 0} of {last}"
    )
    return text, through


def spread(values: Sequence[float]) -> float | None:
    """``(max - min) / median`` of ``values``; ``None`` for fewer than two values or a zero median."""
    if len(values) < 2:
        return None
    mid = median(values)
    return (max(values) - min(values)) / mid if mid > 0 else None


def tail(step_times_s: Sequence[float]) -> float | None:
    """Step p90 / step p50; ``None`` without steps or with a zero median."""
    p50 = median(step_times_s)
    return percentile(step_times_s, 90) / p50 if step_times_s and p50 > 0 else None


def noise(spread_value: float | None, tail_value: float | None) -> list[str]:
    """Why a configuration's figures are not steady (``["repeats differ by 23% (limit 10%)", ...]``), empty when
    steady."""
    out = []
    if spread_value is not None and spread_value > SPREAD_LIMIT:
        out.append(f"repeats differ by {_above(spread_value, SPREAD_LIMIT, 0, '%')} (limit {SPREAD_LIMIT:.0%})")
    if tail_value is not None and tail_value > TAIL_LIMIT:
        out.append(f"p90 is {_above(tail_value, TAIL_LIMIT, 1, 'f')}x p50 (limit {TAIL_LIMIT:g}x)")
    return out


def _above(value: float, limit: float, digits: int, kind: str) -> str:
    """``value`` with the decimals that keep it from printing as ``limit`` (1.504, not "1.5x (limit 1.5x)")."""
    for n in range(digits, digits + 7):
        text = f"{value:.{n}{kind}}"
        if text != f"{limit:.{n}{kind}}":
            return text
    return f"{value * 100!r}%" if kind == "%" else repr(value)


def steady(spread_value: float | None, tail_value: float | None) -> bool:
    """Whether another repeat is unneeded: the spread is known and both figures are within their limits."""
    return spread_value is not None and not noise(spread_value, tail_value)


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
    """Fill ``result`` from its repeats: median samples/s, step percentiles and data wait over all timed steps,
    largest peak; run id, devices and losses from the first (every repeat trains the same steps)."""
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
    """``(training samples, batch_statistics, dropout)`` from building the spec's data and model once on CPU."""
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

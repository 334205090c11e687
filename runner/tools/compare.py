"""Comparing the modes on one spec, what ``runner bench`` and ``runner parity`` share: each configuration's spec
(:func:`derive`: the user's spec with one mode, size and step budget), the parent run the configurations' runs hang
under and its end (:func:`start_parent`, :func:`ending`), and the figures a comparison reports (no torch).

It exists so that the two tools ask the same question the same way: a configuration is derived alike for both, and
"agrees with none" has one definition (:func:`loss_check`, §17). Each tool keeps only its own part: bench measures
speed on warm processes (:mod:`runner.tools.bench_runs`), parity follows the losses step by step.

Definitions used everywhere (table, JSON, chart, README):

* **samples/s** = samples in the timed steps / sum of the timed step times. Warm-up steps are
  not timed. In ddp every rank times its own steps and the slowest rank (largest total) is used,
  since a step ends for the job when the last rank finishes it.
* **step p50 / p90**: median and 90th percentile (linear interpolation) of the timed step times.
* **data wait**: sum of the time spent waiting for the DataLoader / sum of the step times, on the
  same rank.
* **scaling efficiency** of a configuration on ``n`` devices (dp) or processes (ddp) =
  samples/s / (n x samples/s of ``none``). 100 % is perfect linear scaling; ``none`` is 100 % by
  definition; with no ``none`` measurement it is not available.
* **final loss**: ``train/loss`` after the last step. For models without batch-statistics or
  dropout layers every mode computes the same optimizer steps (docs/design.md §3), so a
  configuration whose ``train/loss`` differs from ``none``'s at any step by more than ``loss_tolerance``
  of the size of ``none``'s losses (§17, one definition of agreement) is flagged, with the last
  step up to which the two loss curves still agreed: a
  curve that parts at the first steps computes something else; one that parts late has
  amplified float rounding (n processes sum gradients in another order than one).
  BatchNorm normalises over each device's share of the batch and dropout draws per-rank
  masks, so for such models the losses are reported but not compared.

Noise (docs: README "Measure before you choose"). A configuration is repeated, each repeat a
whole training of ``warmup + steps`` steps in the same warm process(es), until its figures are
steady or the repeat budget is spent:

* **spread** = (largest - smallest) / median of the repeats' samples/s; steady when at most
  ``SPREAD_LIMIT`` (over at least two repeats);
* **tail** = step p90 / step p50 over the timed steps of all repeats; steady when at most
  ``TAIL_LIMIT`` (a longer tail means stalls: other load, a noisy collective);
* across configurations, ``ddp-1`` or ``fsdp-1`` (one process, nothing to all-reduce with) far below ``none``
  (efficiency under ``ONE_RANK_FLOOR``) is flagged, and an efficiency above 100 % by more than the
  two configurations' spreads is withdrawn as a measurement problem naming its likely cause.

Reported samples/s is the median over the repeats (its error bar spans the smallest and the
largest), step p50 / p90 and data wait are over the timed steps of all repeats.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import statistics
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import KW_ONLY, dataclass
from typing import TYPE_CHECKING, Any

from runner.errors import Interrupted, SpecError, UsageError
from runner.spec.schema_parallel import MODES, REFERENCE_MODE
from runner.tracking.runs import TrackedRun, start_run
from runner.tracking.trackers import MlflowTracker
from runner.tracking.uri import resolve_tracking_uri

if TYPE_CHECKING:
    from runner.plan import Plan
    from runner.spec.loading import LoadedSpec

LOSS_TOLERANCE = 1e-4
SPREAD_LIMIT = 0.10  # repeats' samples/s may differ by 10 % of their median
TAIL_LIMIT = 1.5  # step p90 may be 1.5x the step p50
ONE_RANK_FLOOR = 0.8  # ddp-1 or fsdp-1 below 80 % of none: its process group's fixed cost dominates, or load


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


def config_id(mode: str, n: int) -> str:
    """``none`` for mode none, else ``<mode>-<n>`` (``dp-2``, ``ddp-4``)."""
    return mode if mode == REFERENCE_MODE else f"{mode}-{n}"


# Options for several nodes (the bench runs on one machine); those of another mode are dropped too.
_MULTI_NODE_KEYS = ("nproc_per_node", "nnodes", "node_rank", "rdzv_endpoint", "rdzv_id", "max_restarts")


def check_modes(modes: Sequence[str]) -> None:
    """``--modes`` of bench and parity: a non-empty subset of the modes; UsageError otherwise."""
    if not modes or any(m not in MODES for m in modes):
        raise UsageError(
            f"--modes: expected a comma-separated subset of {','.join(MODES)}, got {','.join(modes) or 'nothing'}"
        )


def bench_spec_data(data: dict[str, Any], mode: str, n: int, steps: int, warmup: int) -> dict[str, Any]:
    """A new raw spec dict of one configuration (``n`` devices or processes) from the user's merged ``data``."""
    d = copy.deepcopy(data)
    traits = MODES[mode]
    par = {
        k: v
        for k, v in (d.get("parallel") or {}).items()
        if k not in _MULTI_NODE_KEYS and (k == "mode" or k in traits.keys)
    }
    par["mode"] = mode
    if traits.elastic:
        par["nproc_per_node"] = n
    d["parallel"] = par
    d.setdefault("devices", {})["ids"] = list(range(n))
    total = warmup + steps
    train = d.setdefault("train", {})
    train.update(max_steps=total, epochs=total, eval_every_n_epochs=total, progress="off", log_every_n_steps=1)
    d.setdefault("checkpoint", {})["enabled"] = False
    return d


def derive(
    base: LoadedSpec, mode: str, n: int, steps: int, warmup: int, adjust: Callable[[dict[str, Any]], None] | None = None
) -> tuple[LoadedSpec, Plan]:
    """The spec and plan of one configuration of ``base`` (:func:`bench_spec_data`, then ``adjust`` on the raw dict),
    the core that bench and parity share. Raises SpecError, DeviceError or UsageError when it does not validate or
    this machine cannot run it."""
    from runner.plan import make_plan
    from runner.spec.dump import spec_sha256
    from runner.spec.loading import spec_from_dict

    data = bench_spec_data(base.data, mode, n, steps, warmup)
    if adjust is not None:
        adjust(data)
    spec = spec_from_dict(data, origin=str(base.path))
    loaded = dataclasses.replace(base, spec=spec, data=data, sha256=spec_sha256(spec))
    return loaded, make_plan(loaded)


@dataclass
class ComparedRuns:
    """What a comparison's report (bench's, parity's) holds of its MLflow side: the spec compared, the parent run of
    its configurations and where it is; :func:`start_parent` fills the run's fields."""

    spec: str
    name: str
    _: KW_ONLY
    parent_run_id: str | None = None
    tracking_uri: str | None = None
    experiment: str = ""
    experiment_id: str = ""


@dataclass(frozen=True)
class Parent(TrackedRun):
    """The parent run of a bench or parity, in ``experiment`` (``<training experiment>/bench`` for a bench)."""

    experiment: str


def start_parent(
    base: LoadedSpec, report: ComparedRuns, kind: str, configs: list[str], **description: Any
) -> Parent | None:
    """The parent run of a bench or a parity check (``kind``), tagged ``runner.<kind>`` = ``parent`` with its
    configurations; ``None`` when tracking is off. Fills the report's run id, store URI and experiment id."""
    if not base.spec.tracking.enabled:
        return None
    uri = resolve_tracking_uri(base.spec)  # start_run checks it is reachable (runner.tracking.uri.open_store)
    experiment = report.experiment or base.spec.experiment_name
    handle = start_run(
        base,
        {"mode": kind, kind: {"configurations": configs, **description.pop(kind, {})}, **description},
        run_name=f"{kind}-{report.name}",
        extra_tags={f"runner.{kind}": "parent", f"runner.{kind}.configs": ",".join(configs)},
        uri=uri,
        experiment=experiment,
    )
    report.parent_run_id = handle.run_id
    report.tracking_uri = uri
    report.experiment_id = handle.experiment_id
    report.experiment = experiment
    return Parent(uri, handle.run_id, experiment)


@contextlib.contextmanager
def ending(parent: Parent | None) -> Iterator[dict[str, str | None]]:
    """The parent-run lifecycle of bench and parity: end ``parent`` FINISHED, or with the ``status`` and ``error`` the
    body sets in the yielded dict; KILLED on an interrupt, FAILED naming an exception; a SpecError deletes it (a bad
    spec leaves no run)."""
    outcome: dict[str, str | None] = {"status": "FINISHED", "error": None}
    try:
        yield outcome
    except BaseException as exc:
        if parent is not None and isinstance(exc, SpecError):
            parent.delete()
        elif parent is not None:
            killed = isinstance(exc, (Interrupted, KeyboardInterrupt))
            error = None if killed else f"{type(exc).__name__}: {exc}"
            parent.end("KILLED" if killed else "FAILED", error)
        raise
    if parent is not None:
        parent.end(outcome["status"] or "FINISHED", outcome["error"])


def log_history(run: TrackedRun, history: Sequence[tuple[int, dict[str, float]]]) -> None:
    """Log a repeat's metrics, step by step, as the training rank would have."""
    with MlflowTracker(run) as tracker:
        for step, metrics in history:
            tracker.log_metrics(metrics, step=step)

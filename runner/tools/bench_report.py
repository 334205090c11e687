"""Figures, terminal table, JSON and chart of a ``runner bench`` comparison (pure; no torch, no mlflow).

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
  dropout layers every mode computes the same optimizer steps (DESIGN section 3), so a
  configuration whose final loss differs from ``none`` by more than ``loss_tolerance``
  (relative) is flagged, with the last step up to which the two loss curves still agreed: a
  curve that parts at the first steps computes something else; one that parts late has
  amplified float rounding (n processes sum gradients in another order than one).
  BatchNorm normalises over each device's share of the batch and dropout draws per-rank
  masks, so for such models the losses are reported but not compared.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

LOSS_TOLERANCE = 1e-4
NOT_COMPARABLE = "not comparable: batch-statistics layers"


def comparability(batch_statistics: bool, dropout: bool = False) -> str:
    """``""`` when losses of different modes must agree, else ``"not comparable: <why>"``."""
    kinds = [k for k, on in (("batch-statistics layers", batch_statistics), ("dropout layers", dropout)) if on]
    return "not comparable: " + " and ".join(kinds) if kinds else ""


MIB = 1024 * 1024


def median(values: Sequence[float]) -> float:
    """Median of ``values`` (``nan`` when empty)."""
    return float(statistics.median(values)) if values else math.nan


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) with linear interpolation between order statistics.

    Matches ``numpy.percentile(values, q)`` (its default "linear" method).

    Raises:
        ValueError: ``q`` is outside 0..100.
    """
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be within 0..100, got {q}")
    if not values:
        return math.nan
    ordered = sorted(float(v) for v in values)
    pos = (len(ordered) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def throughput(samples: int, step_times_s: Sequence[float]) -> float:
    """Samples per second over the given steps: ``samples / sum(step_times_s)`` (0 when no time)."""
    total = float(sum(step_times_s))
    return samples / total if total > 0 else 0.0


def scaling_efficiency(samples_per_s: float, baseline_samples_per_s: float | None, n: int) -> float | None:
    """``samples_per_s / (n * baseline_samples_per_s)``; ``None`` without a positive baseline.

    Args:
        samples_per_s: Throughput of the configuration.
        baseline_samples_per_s: Throughput of ``none`` (one device), or ``None``.
        n: Devices (dp) or processes (ddp) of the configuration.
    """
    if not baseline_samples_per_s or baseline_samples_per_s <= 0 or n < 1:
        return None
    return samples_per_s / (n * baseline_samples_per_s)


def losses_agree(a: float, b: float, tolerance: float = LOSS_TOLERANCE) -> bool:
    """``|a - b| <= tolerance * max(|a|, |b|)``."""
    return math.isclose(a, b, rel_tol=tolerance, abs_tol=0.0)


def agrees_through(
    curve: dict[int, float], baseline: dict[int, float], tolerance: float = LOSS_TOLERANCE
) -> int | None:
    """Last step up to which two ``{step: loss}`` curves agree at every common step (``None``: not even the first)."""
    last = None
    for step in sorted(set(curve) & set(baseline)):
        if not losses_agree(curve[step], baseline[step], tolerance):
            break
        last = step
    return last


def loss_check(
    loss: float | None,
    baseline: float | None,
    *,
    not_comparable: str = "",
    tolerance: float = LOSS_TOLERANCE,
    agreed_through: int | None = None,
    last_step: int | None = None,
) -> str:
    """Compare a final loss to ``none``'s.

    Args:
        loss: Final ``train/loss`` of the configuration.
        baseline: Final ``train/loss`` of ``none``.
        not_comparable: From :func:`comparability`; when set it is returned as is.
        tolerance: Relative tolerance.
        agreed_through: Last step up to which the loss curves agreed (see :func:`agrees_through`).
        last_step: The final step, shown with ``agreed_through``.

    Returns:
        ``"ok"``, ``"differs: ..."``, ``"not comparable: ..."`` or ``"no baseline"``.
    """
    if not_comparable:
        return not_comparable
    if loss is None or baseline is None or not math.isfinite(loss) or not math.isfinite(baseline):
        return "no baseline"
    if losses_agree(loss, baseline, tolerance):
        return "ok"
    rel = abs(loss - baseline) / max(abs(loss), abs(baseline))
    text = f"differs: {loss:.6g} vs {baseline:.6g} for none (relative {rel:.2g} > {tolerance:g})"
    if last_step is not None:
        text += f"; curves agree through step {agreed_through or 0} of {last_step}"
    return text


@dataclass
class ConfigResult:
    """One measured (or skipped) configuration.

    Attributes:
        config: Short id: ``none``, ``dp-2``, ``ddp-1``, ``ddp-2``.
        mode: ``none``, ``dp`` or ``ddp``.
        n: Devices (none, dp) or processes (ddp).
        status: ``ok``, ``skipped`` (cannot run on this machine) or ``failed`` (unexpected error).
        reason: Why it was skipped or how it failed.
        run_id: The child MLflow run.
        devices: Device of every rank (ddp) or the devices used (none, dp), e.g. ``["cuda:0", "cuda:1"]``.
        timed_steps: Optimizer steps timed (after warm-up).
        timed_samples: Samples in those steps (all ranks together).
        samples_per_s: See the module docstring.
        step_time_median_s: Median timed step time, seconds.
        step_time_p90_s: 90th percentile timed step time, seconds.
        data_wait_fraction: 0..1.
        peak_memory_bytes: Per CUDA device (allocator peak) or per process on CPU (peak RSS).
        peak_memory_kind: ``cuda_allocated`` or ``cpu_rss``.
        scaling_efficiency: See the module docstring.
        final_loss: ``train/loss`` after the last step.
        loss_check: ``ok``, ``baseline`` (none itself), ``differs: ...``, ``not comparable: ...`` or ``no baseline``.
        loss_agrees_through_step: Last step up to which the loss curve agrees with none's.
        train_losses: ``{step: train/loss}`` (not in the JSON).
    """

    config: str
    mode: str
    n: int
    status: str = "ok"
    reason: str = ""
    run_id: str | None = None
    devices: list[str] = field(default_factory=list)
    timed_steps: int = 0
    timed_samples: int = 0
    samples_per_s: float | None = None
    step_time_median_s: float | None = None
    step_time_p90_s: float | None = None
    data_wait_fraction: float | None = None
    peak_memory_bytes: list[int] = field(default_factory=list)
    peak_memory_kind: str = ""
    scaling_efficiency: float | None = None
    final_loss: float | None = None
    loss_check: str = ""
    loss_agrees_through_step: int | None = None
    train_losses: dict[int, float] = field(default_factory=dict, repr=False)


def config_id(mode: str, n: int) -> str:
    """``none`` for mode none, else ``<mode>-<n>`` (``dp-2``, ``ddp-4``)."""
    return "none" if mode == "none" else f"{mode}-{n}"


def finish_comparisons(
    configs: Sequence[ConfigResult], *, not_comparable: str = "", tolerance: float = LOSS_TOLERANCE
) -> None:
    """Fill ``scaling_efficiency`` and the loss comparison of measured configurations against ``none``.

    Args:
        configs: The rows; ``none`` (if measured) is the baseline.
        not_comparable: From :func:`comparability` (losses are then reported, not compared).
        tolerance: Relative tolerance of the loss comparison.
    """
    base = next((c for c in configs if c.mode == "none" and c.status == "ok"), None)
    for c in configs:
        if c.status != "ok":
            continue
        c.scaling_efficiency = scaling_efficiency(c.samples_per_s or 0.0, base.samples_per_s if base else None, c.n)
        if c is base:
            c.loss_check = not_comparable or "baseline"
            continue
        agreed = last = None
        if base is not None and c.train_losses and base.train_losses:
            agreed = agrees_through(c.train_losses, base.train_losses, tolerance)
            last = max(set(c.train_losses) & set(base.train_losses), default=None)
            c.loss_agrees_through_step = None if not_comparable else agreed
        c.loss_check = loss_check(
            c.final_loss,
            base.final_loss if base else None,
            not_comparable=not_comparable,
            tolerance=tolerance,
            agreed_through=agreed,
            last_step=last,
        )


@dataclass
class BenchReport:
    """Result of ``runner bench``: every configuration side by side.

    Attributes:
        spec: Absolute path of the spec file.
        name: The spec's ``name``.
        accelerator: ``cuda`` or ``cpu`` (of the configurations that ran; ``cpu`` when none did).
        global_batch_size: ``data.batch_size`` (samples per optimizer step).
        steps: Timed optimizer steps per configuration.
        warmup: Untimed optimizer steps run first.
        batch_statistics: The model has batch-statistics layers (``_BatchNorm``): losses are not compared.
        dropout: The model has active dropout layers: losses are not compared.
        loss_tolerance: Relative tolerance of the loss comparison.
        configs: One :class:`ConfigResult` per configuration, in run order.
        parent_run_id: The MLflow run holding the configurations as child runs (``None`` with tracking off).
        tracking_uri: Where it is stored.
        experiment: MLflow experiment name.
        json_path: The written ``bench.json``.
        png_path: The written ``bench.png``.
    """

    spec: str
    name: str
    accelerator: str
    global_batch_size: int
    steps: int
    warmup: int
    batch_statistics: bool
    configs: list[ConfigResult]
    dropout: bool = False
    loss_tolerance: float = LOSS_TOLERANCE
    parent_run_id: str | None = None
    tracking_uri: str | None = None
    experiment: str = ""
    json_path: str | None = None
    png_path: str | None = None

    @property
    def failed(self) -> int:
        """Number of configurations that failed unexpectedly."""
        return sum(c.status == "failed" for c in self.configs)

    def to_json(self) -> dict[str, Any]:
        """JSON-able dict (what ``--json`` prints and ``bench.json`` holds); ``nan`` becomes ``null``."""
        out = {k: v for k, v in asdict(self).items() if k != "configs"}
        out["definitions"] = {
            "samples_per_s": "samples in timed steps / sum of timed step times (ddp: slowest rank)",
            "scaling_efficiency": "samples_per_s / (n * samples_per_s of none); n = devices (dp) or processes (ddp)",
            "data_wait_fraction": "sum of DataLoader wait / sum of step time over timed steps",
            "peak_memory_bytes": "cuda_allocated: torch.cuda.max_memory_allocated per device; cpu_rss: peak RSS per process",
            "loss_check": f"train/loss after the last step vs none, relative tolerance {self.loss_tolerance:g}",
        }
        out["configurations"] = [
            _clean({k: v for k, v in asdict(c).items() if k != "train_losses"}) for c in self.configs
        ]
        return _clean(out)

    def table(self) -> str:
        """Terminal table, one row per configuration; skipped and failed rows carry their reason."""
        head = (
            f"runner bench: {self.name} ({_shown(self.spec)})\n"
            f"{self.accelerator}, global batch {self.global_batch_size}, {self.steps} timed steps after {self.warmup} warm-up"
        )
        cols = [
            "config",
            "devices",
            "samples/s",
            "step p50 ms",
            "step p90 ms",
            "data wait",
            "peak mem MiB",
            "efficiency",
            "final loss",
            "note",
        ]
        rows = [cols] + [_row(c) for c in self.configs]
        widths = [max(len(r[i]) for r in rows) for i in range(len(cols) - 1)]
        right = {2, 3, 4, 5, 6, 7, 8}
        lines = []
        for r in rows:
            cells = [r[i].rjust(widths[i]) if i in right else r[i].ljust(widths[i]) for i in range(len(cols) - 1)]
            lines.append(("  ".join(cells) + "  " + r[-1]).rstrip())
        foot = [
            "efficiency = samples/s / (n x samples/s of none); ddp figures are the slowest rank's; "
            + (
                "peak mem = CUDA allocator peak per device"
                if self.accelerator == "cuda"
                else "peak mem = peak RSS per process"
            ),
        ]
        why = comparability(self.batch_statistics, self.dropout)
        if why:
            foot.append(f"final losses {why} (BatchNorm normalises per device, dropout draws per-rank masks)")
        else:
            foot.append(f"final losses compared with none at relative tolerance {self.loss_tolerance:g}")
        if self.parent_run_id:
            foot.append(
                f"MLflow: parent run {self.parent_run_id} (experiment {self.experiment!r}) at {self.tracking_uri}"
            )
        if self.json_path or self.png_path:
            foot.append(f"files: {self.json_path}  {self.png_path}")
        return "\n".join([head, "", *lines, "", *foot])


def _shown(path: str) -> str:
    """``path`` relative to the working directory when it lies inside it, else unchanged."""
    import os

    try:
        rel = os.path.relpath(path)
    except ValueError:  # another drive (Windows)
        return path
    return path if rel.startswith("..") else rel


SUPERLINEAR = 1.1  # efficiency above this is almost always measurement noise, not real speed-up


def _row(c: ConfigResult) -> list[str]:
    if c.status != "ok":
        return [c.config, "-", "-", "-", "-", "-", "-", "-", "-", f"{c.status}: {_one_line(c.reason)}"]
    note = "" if c.loss_check in ("ok", "baseline") else c.loss_check
    if c.scaling_efficiency is not None and c.scaling_efficiency > SUPERLINEAR and c.mode != "none":
        warning = "efficiency above 100%: the baseline was likely slowed by other load; rerun on a quiet machine"
        note = f"{note}; {warning}" if note else warning
    mem = "/".join(f"{b / MIB:.0f}" for b in c.peak_memory_bytes) or "-"
    return [
        c.config,
        _devices(c.devices),
        _num(c.samples_per_s, "{:.1f}"),
        _num(c.step_time_median_s, "{:.2f}", 1e3),
        _num(c.step_time_p90_s, "{:.2f}", 1e3),
        _num(c.data_wait_fraction, "{:.1f}%", 100),
        mem,
        _num(c.scaling_efficiency, "{:.0f}%", 100),
        _num(c.final_loss, "{:.6f}"),
        note,
    ]


def _devices(devices: Sequence[str]) -> str:
    if not devices:
        return "-"
    if len(set(devices)) == 1 and len(devices) > 1:
        return f"{len(devices)}x {devices[0]}"
    return ",".join(devices)


def _num(value: float | None, fmt: str, scale: float = 1.0) -> str:
    if value is None or not math.isfinite(value):
        return "-"
    return fmt.format(value * scale)


def _one_line(text: str, limit: int = 160) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def _clean(value: Any) -> Any:
    """Replace non-finite floats by ``None`` so the JSON is standard."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_clean(v) for v in value]
    return value


def write_json(report: BenchReport, path: Path) -> Path:
    """Write ``report.to_json()`` to ``path`` (indented, trailing newline); return ``path``."""
    path.write_text(json.dumps(report.to_json(), indent=2) + "\n", encoding="utf-8")
    return path


def write_chart(report: BenchReport, path: Path) -> Path:
    """Draw samples/s and scaling efficiency per configuration into a PNG (matplotlib, Agg backend).

    Skipped and failed configurations appear as empty slots labelled with their status.

    Returns:
        ``path``.
    """
    import matplotlib

    matplotlib.use("Agg", force=True)
    from matplotlib.figure import Figure

    names = [c.config for c in report.configs] or ["(none)"]
    ok = [c.status == "ok" for c in report.configs] or [False]
    speed = [c.samples_per_s or 0.0 if c.status == "ok" else 0.0 for c in report.configs] or [0.0]
    eff = [100 * (c.scaling_efficiency or 0.0) if c.status == "ok" else 0.0 for c in report.configs] or [0.0]
    fig = Figure(figsize=(max(6.0, 1.6 * len(names) * 2), 4.2), layout="constrained")
    ax1, ax2 = fig.subplots(1, 2)
    x = list(range(len(names)))
    colors = ["tab:blue" if good else "lightgrey" for good in ok]
    ax1.bar(x, speed, color=colors)
    ax1.set_title("throughput (samples/s, higher is better)")
    ax2.bar(x, eff, color=["tab:green" if good else "lightgrey" for good in ok])
    ax2.axhline(100, color="black", linewidth=0.8, linestyle="--")
    ax2.set_title("scaling efficiency vs none (%)")
    for ax, values, fmt in ((ax1, speed, "{:.0f}"), (ax2, eff, "{:.0f}%")):
        ax.set_xticks(x, names)
        top = max([*values, 1.0])
        for i, (v, good) in enumerate(zip(values, ok, strict=False)):
            ax.text(
                i, v + top * 0.01, fmt.format(v) if good else _status(report, i), ha="center", va="bottom", fontsize=8
            )
        ax.set_ylim(0, top * 1.15)
    fig.suptitle(
        f"runner bench: {report.name} - {report.accelerator}, global batch {report.global_batch_size}, "
        f"{report.steps} timed steps",
        fontsize=10,
    )
    fig.savefig(path, dpi=100)
    return path


def _status(report: BenchReport, i: int) -> str:
    return report.configs[i].status if i < len(report.configs) else ""

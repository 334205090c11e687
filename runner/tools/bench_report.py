"""The result of ``runner bench``: one row per configuration, the comparison against ``none``, table and JSON.

The figures and their definitions are in :mod:`runner.tools.bench_figures`; the chart in
:mod:`runner.tools.bench_chart`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from runner.tools.bench_figures import (
    LOSS_TOLERANCE,
    agrees_through,
    comparability,
    loss_check,
    scaling_efficiency,
)

MIB = 1024 * 1024


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
            "peak_memory_bytes": (
                "cuda_allocated: torch.cuda.max_memory_allocated per device; cpu_rss: peak RSS per process"
            ),
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
            f"{self.accelerator}, global batch {self.global_batch_size}, "
            f"{self.steps} timed steps after {self.warmup} warm-up"
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

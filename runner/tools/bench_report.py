"""The result of ``runner bench``: a row per configuration, the comparison against ``none``, and how it is shown:
table, JSON and chart. Figures: :mod:`runner.tools.compare`.

It is apart from the measuring so that a report can be built, checked and shown from figures alone (the tests
build rows by hand), and so that what it says is worded in one place: the table, the JSON, the chart and the
recommendation.
"""

from __future__ import annotations

import json
import math
import os
import textwrap
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from runner.errors import mask_secrets
from runner.spec.schema_parallel import MODES, REFERENCE_MODE
from runner.tools.compare import (
    LOSS_TOLERANCE,
    ONE_RANK_FLOOR,
    SPREAD_LIMIT,
    TAIL_LIMIT,
    ComparedRuns,
    comparability,
    loss_check,
    scaling_efficiency,
)
from runner.tracking.uri import ui_line

if TYPE_CHECKING:
    pass

MIB = 1024 * 1024


@dataclass
class ConfigResult:
    """One measured (or skipped) configuration: ``config`` is ``none``, ``dp-2``, ``ddp-2``, ...; ``status`` ``ok``,
    ``skipped`` or ``failed`` with ``reason``.

    Throughput is the median over the repeats, step times in seconds over all repeats; ``spread`` is (max - min) /
    median of ``repeat_samples_per_s``; ``steady`` is false when the repeats ran out first, and ``noise`` says why
    figures are not to be trusted. ``peak_memory_bytes`` is per CUDA device or per CPU process (``peak_memory_kind``).
    ``scaling_efficiency`` is ``None`` when it exceeded 100 % beyond the spread. ``loss_check``: ``ok``, ``baseline``,
    ``differs: ...``, ``not comparable: ...`` or ``no baseline``. The last three fields stay out of the JSON.
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
    threads_per_process: int | None = None
    thread_budget: int | None = None
    final_loss: float | None = None
    loss_check: str = ""
    loss_agrees_through_step: int | None = None
    repeats: int = 0
    repeat_samples_per_s: list[float] = field(default_factory=list)
    spread: float | None = None
    tail: float | None = None
    steady: bool | None = None
    noise: list[str] = field(default_factory=list)
    train_losses: dict[int, float] = field(default_factory=dict, repr=False)
    step_times_s: list[float] = field(default_factory=list, repr=False)
    data_wait_s: list[float] = field(default_factory=list, repr=False)


_NOT_IN_JSON = ("train_losses", "step_times_s", "data_wait_s")


def finish_comparisons(
    configs: Sequence[ConfigResult], *, not_comparable: str = "", tolerance: float = LOSS_TOLERANCE
) -> None:
    """Fill ``scaling_efficiency`` and the loss comparison (within ``tolerance``) of ``configs`` against ``none``."""
    base = next((c for c in configs if c.mode == REFERENCE_MODE and c.status == "ok"), None)
    for c in configs:
        if c.status != "ok":
            continue
        c.scaling_efficiency = scaling_efficiency(c.samples_per_s or 0.0, base.samples_per_s if base else None, c.n)
        c.noise += _cross_config_noise(c, base)
        if c is base:
            c.loss_check = not_comparable or "baseline"
            continue
        c.loss_check, agreed = loss_check(
            c.train_losses, base.train_losses if base else {}, not_comparable=not_comparable, tolerance=tolerance
        )
        c.loss_agrees_through_step = agreed


def _cross_config_noise(c: ConfigResult, base: ConfigResult | None) -> list[str]:
    """Flags that need ``none``: ddp-1 far below it; an efficiency over 100 % beyond the spread, then withdrawn."""
    eff = c.scaling_efficiency
    if base is None or eff is None or c is base:
        return []
    margin = (c.spread or 0.0) + (base.spread or 0.0)  # the two figures' measured relative spreads
    if eff > 1.0 + margin:
        c.scaling_efficiency = None
        return [
            f"efficiency {eff:.0%} is above 100% by more than the measured spread ({margin:.0%}): a measurement "
            f"problem, not a result; likely cause: {_likely_cause(c, base)}"
        ]
    if MODES[c.mode].elastic and c.n == 1 and eff < ONE_RANK_FLOOR:
        extra = (c.step_time_median_s or 0.0) - (base.step_time_median_s or 0.0)
        return [
            f"{c.config} at {eff:.0%} of {base.config}: the fixed cost per step of {c.mode}'s process group and "
            f"collectives (about {extra * 1e3:.2g} ms here) outweighs a step this small, or other load slowed it"
        ]
    return []


def recommend(configs: Sequence[ConfigResult]) -> str:
    """The fastest configuration whose ``train/loss`` agrees with none's (``loss_check``), or why unclear.

    ``recommend: ddp-2 — 1.9× none (1.8–2.0×), results agree, 1.2 GiB per device``; "inconclusive" when the repeats of
    the fastest and the runner-up overlap.
    """
    base = next((c for c in configs if c.mode == REFERENCE_MODE and c.status == "ok" and c.samples_per_s), None)
    if base is None:
        return "recommend: inconclusive — none was not measured, so there is no baseline to compare with"
    agree = [c for c in configs if c.status == "ok" and c.samples_per_s and c.loss_check in ("ok", "baseline")]
    ranked = sorted(agree, key=lambda c: c.samples_per_s or 0.0, reverse=True)
    best = ranked[0] if ranked else base
    left_out = [c.config for c in configs if c.status == "ok" and c not in agree]
    why_out = f"; left out, results not shown to agree: {', '.join(left_out)}" if left_out else ""
    if len(ranked) > 1 and _range(ranked[1])[1] >= _range(best)[0]:
        runner_up = ranked[1]
        return (
            f"recommend: inconclusive — {best.config} and {runner_up.config} overlap "
            f"({_fmt_range(best)} vs {_fmt_range(runner_up)} samples/s over the repeats): rerun with more "
            f"--repeats or --steps, on a quiet machine{why_out}"
        )
    low, high = _range(best)
    base_low, base_high = _range(base)
    speedup = (best.samples_per_s or 0.0) / (base.samples_per_s or 1.0)
    spread_text = f"{low / base_high:.1f}–{high / base_low:.1f}×"
    agreed = "the baseline" if best is base else "results agree"
    memory = _memory(max(best.peak_memory_bytes)) if best.peak_memory_bytes else "memory not measured"
    per = "per device" if best.peak_memory_kind == "cuda_allocated" else "per process"
    return f"recommend: {best.config} — {speedup:.1f}× none ({spread_text}), {agreed}, {memory} {per}{why_out}"


def _range(c: ConfigResult) -> tuple[float, float]:
    """Slowest and fastest repeat's samples/s (the median twice with one repeat)."""
    rates = c.repeat_samples_per_s or [c.samples_per_s or 0.0]
    return min(rates), max(rates)


def _fmt_range(c: ConfigResult) -> str:
    low, high = _range(c)
    return f"{low:.0f}–{high:.0f}"


def _memory(num_bytes: int) -> str:
    return f"{num_bytes / 1024**3:.1f} GiB" if num_bytes >= 1024**3 else f"{num_bytes / MIB:.0f} MiB"


def _likely_cause(c: ConfigResult, base: ConfigResult) -> str:
    """Why a configuration measured faster than n x none: unequal thread budgets, a noisy baseline, or load."""
    if c.thread_budget and base.thread_budget and c.thread_budget != base.thread_budget:
        return (
            f"unequal CPU thread budgets ({base.thread_budget} for none, {c.thread_budget} here): unset "
            "OMP_NUM_THREADS and devices.threads_per_process so that every mode shares the same cores"
        )
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    cores = os.cpu_count() or 1
    busy = f" (load average {load:.1f} on {cores} cores now)" if load is not None else ""
    if base.noise or (load is not None and load > cores):
        return f"other work on the machine slowed none{busy}; rerun on a quiet machine or with more --repeats"
    return f"none was slowed while it was measured (a cold cache, a frequency change, other work{busy}); rerun it"


@dataclass
class BenchReport(ComparedRuns):
    """Result of ``runner bench``: every configuration side by side, the parent run, the recommendation."""

    accelerator: str
    global_batch_size: int
    steps: int
    warmup: int
    batch_statistics: bool
    configs: list[ConfigResult]
    dropout: bool = False
    min_repeats: int = 1
    max_repeats: int = 1
    loss_tolerance: float = LOSS_TOLERANCE
    json_path: str | None = None
    png_path: str | None = None
    recommendation: str = ""
    host_load: str = ""  # how busy the host was while the configurations ran (HostLoad.describe)

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
            "loss_check": f"train/loss at every step vs none, within {self.loss_tolerance:g} of none's largest |loss|",
            "samples_per_s_of_repeats": "samples_per_s is their median",
            "spread": f"(max - min) / median of the repeats' samples_per_s; steady at most {SPREAD_LIMIT:g}",
            "tail": f"step p90 / step p50 over all repeats; steady at most {TAIL_LIMIT:g}",
            "noise": (
                f"why not steady, plus ddp-1 or fsdp-1 below {ONE_RANK_FLOOR:g} x none, an efficiency above 1 + "
                "the two spreads (then scaling_efficiency is null: a measurement problem, not a result)"
            ),
            "thread_budget": "CPU threads on the node: training processes x threads_per_process",
        }
        out["configurations"] = [
            _clean({k: v for k, v in asdict(c).items() if k not in _NOT_IN_JSON}) for c in self.configs
        ]
        return _clean(out)

    def _budget_text(self) -> str:
        """``, 2 CPU threads per configuration`` (or each configuration's, when they differ) for the head line."""
        budgets = sorted({c.thread_budget for c in self.configs if c.status == "ok" and c.thread_budget})
        if not budgets:
            return ""
        if len(budgets) == 1:
            return f", {budgets[0]} CPU threads per configuration (processes x threads)"
        return f", UNEQUAL CPU thread budgets {budgets}: the modes are not measured on equal terms"

    def table(self) -> str:
        """Terminal table, one row per configuration; skipped and failed rows carry their reason."""
        head = (
            f"runner bench: {self.name} ({_shown(self.spec)})\n"
            f"{self.accelerator}, global batch {self.global_batch_size}, "
            f"{self.steps} timed steps after {self.warmup} warm-up, {self.min_repeats}-{self.max_repeats} repeats"
            f"{self._budget_text()}"
        )
        cols = [
            "config",
            "devices",
            "samples/s",
            "repeats",
            "spread",
            "step p50 ms",
            "step p90 ms",
            "data wait",
            "peak mem MiB",
            "threads",
            "efficiency",
            "final loss",
            "note",
        ]
        rows = [cols] + [_row(c) for c in self.configs]
        widths = [max(len(r[i]) for r in rows) for i in range(len(cols) - 1)]
        right = {2, 3, 4, 5, 6, 7, 8, 9, 10, 11}
        lines = []
        for r in rows:
            cells = [r[i].rjust(widths[i]) if i in right else r[i].ljust(widths[i]) for i in range(len(cols) - 1)]
            lines.append(("  ".join(cells) + "  " + r[-1]).rstrip())
        foot = [
            "efficiency = samples/s / (n x samples/s of none); threads = processes x CPU threads each; "
            "ddp figures are the slowest rank's; "
            + (
                "peak mem = CUDA allocator peak per device"
                if self.accelerator == "cuda"
                else "peak mem = peak RSS per process"
            ),
        ]
        foot.append(
            f"samples/s = median of the repeats; spread = (max - min) / median of them (steady <= {SPREAD_LIMIT:.0%}); "
            f"a p90 above {TAIL_LIMIT:g}x the p50 means stalls; noisy rows say why"
        )
        why = comparability(self.batch_statistics, self.dropout)
        if why:
            foot.append(f"losses {why} (BatchNorm normalises per device, dropout draws per-rank masks)")
        else:
            foot.append(f"losses compared with none at every step, within {self.loss_tolerance:g} of none's")
        if self.parent_run_id:
            foot.append(f"MLflow: parent run {self.parent_run_id} (experiment {self.experiment!r})")
            foot.append(ui_line(self.tracking_uri or "", self.experiment_id, self.parent_run_id))
        if self.json_path or self.png_path:
            foot.append(f"files: {self.json_path}  {self.png_path}")
        if self.host_load.startswith("busy"):
            foot.append(f"host: {self.host_load}")
        if self.recommendation:
            foot.append(self.recommendation)
        return "\n".join([head, "", *lines, "", *foot])


def _shown(path: str) -> str:
    """``path`` relative to the working directory when it lies inside it, else unchanged."""
    try:
        rel = os.path.relpath(path)
    except ValueError:  # another drive (Windows)
        return path
    return path if rel.startswith("..") else rel


def note_of(c: ConfigResult) -> str:
    """The note of a measured row (table and chart): loss check, noise, cross-configuration flags."""
    parts = [] if c.loss_check in ("ok", "baseline", "") else [c.loss_check]
    repeat_noise = [n for n in c.noise if n.startswith(_REPEAT_NOISE)]
    if repeat_noise:
        head = f"noisy after {c.repeats} repeats" if c.steady is False else "noisy"
        parts.append(f"{head}: {'; '.join(repeat_noise)}")
    parts += [n for n in c.noise if not n.startswith(_REPEAT_NOISE)]
    return "; ".join(parts)


_REPEAT_NOISE = ("repeats differ", "p90 is")  # the wording of runner.tools.compare.noise


def _row(c: ConfigResult) -> list[str]:
    if c.status != "ok":
        return [c.config, *["-"] * 11, f"{c.status}: {' '.join(c.reason.split())}"]  # on one line, whole
    mem = "/".join(f"{b / MIB:.0f}" for b in c.peak_memory_bytes) or "-"
    return [
        c.config,
        _devices(c.devices),
        _num(c.samples_per_s, "{:.1f}"),
        str(c.repeats or "-"),
        _num(c.spread, "{:.0f}%", 100),
        _num(c.step_time_median_s, "{:.2f}", 1e3),
        _num(c.step_time_p90_s, "{:.2f}", 1e3),
        _num(c.data_wait_fraction, "{:.1f}%", 100),
        mem,
        f"{c.n if MODES[c.mode].elastic else 1}x{c.threads_per_process}" if c.threads_per_process else "-",
        _num(c.scaling_efficiency, "{:.0f}%", 100),
        _num(c.final_loss, "{:.6f}"),
        note_of(c),
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
    """Write ``report.to_json()`` to ``path`` (indented, trailing newline, credentials masked: a sink); return
    ``path``."""
    path.write_text(mask_secrets(json.dumps(report.to_json(), indent=2)) + "\n", encoding="utf-8")
    return path


def error_bars(c: ConfigResult, scale: float = 1.0) -> tuple[float, float]:
    """``(below, above)`` the bar: from the median samples/s to the slowest and the fastest repeat, times ``scale``."""
    rates = c.repeat_samples_per_s
    if c.status != "ok" or not rates or c.samples_per_s is None:
        return 0.0, 0.0
    return (c.samples_per_s - min(rates)) * scale, (max(rates) - c.samples_per_s) * scale


def write_chart(report: BenchReport, path: Path) -> Path:
    """Draw samples/s and scaling efficiency per configuration into the PNG ``path`` (skipped ones as empty slots)."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    from matplotlib.figure import Figure

    configs = report.configs
    names = [c.config for c in configs] or ["(none)"]
    ok = [c.status == "ok" for c in configs] or [False]
    speed = [(c.samples_per_s or 0.0) if c.status == "ok" else 0.0 for c in configs] or [0.0]
    base = next((c.samples_per_s for c in configs if c.mode == REFERENCE_MODE and c.status == "ok"), None)
    eff = [100 * (c.scaling_efficiency or 0.0) if c.status == "ok" else 0.0 for c in configs] or [0.0]
    measured = [good and c.scaling_efficiency is not None for good, c in zip(ok, configs, strict=False)] or [False]
    speed_err = [error_bars(c) for c in configs] or [(0.0, 0.0)]
    eff_err = [error_bars(c, 100 / (c.n * base)) if base else (0.0, 0.0) for c in configs] or [(0.0, 0.0)]
    notes = [(i, note_of(c)) for i, c in enumerate(configs) if c.status == "ok" and note_of(c)]
    noisy = {i for i, c in enumerate(configs) if c.noise}
    wrapped = [textwrap.fill(f"[{k}] {configs[i].config}: {text}", 150) for k, (i, text) in enumerate(notes, 1)]
    lines = sum(w.count("\n") + 1 for w in wrapped)
    fig = Figure(figsize=(max(7.0, 3.2 * len(names)), 4.4 + 0.22 * lines), layout="constrained")
    ax1, ax2 = fig.subplots(1, 2)
    x = list(range(len(names)))
    marks = {i: f" [{k}]" for k, (i, _) in enumerate(notes, 1)}
    for ax, values, errors, shown, color, fmt in (
        (ax1, speed, speed_err, ok, "tab:blue", "{:.0f}"),
        (ax2, eff, eff_err, measured, "tab:green", "{:.0f}%"),  # a withdrawn efficiency is no 0 % bar
    ):
        bars = ax.bar(x, values, color=[color if good else "lightgrey" for good in shown])
        for i, bar in enumerate(bars):
            if i in noisy:
                bar.set_hatch("//")
        ax.errorbar(x, values, yerr=list(zip(*errors, strict=True)), fmt="none", ecolor="black", capsize=4)
        ax.set_xticks(x, [n + marks.get(i, "") for i, n in enumerate(names)])
        top = max([v + e[1] for v, e in zip(values, errors, strict=False)] + [1.0])
        for i, (v, good) in enumerate(zip(values, shown, strict=False)):
            status = report.configs[i].status if i < len(report.configs) else ""
            label = fmt.format(v) if good else ("withdrawn" if status == "ok" else status)
            ax.text(i, v + errors[i][1] + top * 0.01, label, ha="center", va="bottom", fontsize=8)
        ax.set_ylim(0, top * 1.15)
    ax1.set_title("throughput (samples/s, median of repeats; bars: slowest-fastest)", fontsize=9)
    ax2.axhline(100, color="black", linewidth=0.8, linestyle="--")
    ax2.set_title("scaling efficiency vs none (%)", fontsize=9)
    fig.suptitle(
        f"runner bench: {report.name} - {report.accelerator}, global batch {report.global_batch_size}, "
        f"{report.steps} timed steps, {report.min_repeats}-{report.max_repeats} repeats (hatched: noisy)",
        fontsize=10,
    )
    if wrapped:
        fig.supxlabel("\n".join(wrapped), fontsize=7, ha="left", x=0.01)
    fig.savefig(path, dpi=100)
    return path

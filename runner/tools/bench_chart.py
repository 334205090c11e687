"""The chart of a ``runner bench`` comparison: samples/s and scaling efficiency per configuration (matplotlib).

Each bar is the median over the configuration's repeats; its error bar spans the slowest and the
fastest repeat. Noisy configurations are hatched, and the notes the table prints (noise, a loss
that differs, ddp-1 far below none) are listed under the bars, numbered.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

from runner.tools.bench_report import BenchReport, ConfigResult, note_of


def error_bars(c: ConfigResult, scale: float = 1.0) -> tuple[float, float]:
    """``(below, above)`` the bar: from the median samples/s to the slowest and the fastest repeat, times ``scale``."""
    rates = c.repeat_samples_per_s
    if c.status != "ok" or not rates or c.samples_per_s is None:
        return 0.0, 0.0
    return (c.samples_per_s - min(rates)) * scale, (max(rates) - c.samples_per_s) * scale


def write_chart(report: BenchReport, path: Path) -> Path:
    """Draw samples/s and scaling efficiency per configuration, with spreads and notes, into a PNG (Agg backend).

    Skipped and failed configurations appear as empty slots labelled with their status.

    Returns:
        ``path``.
    """
    import matplotlib

    matplotlib.use("Agg", force=True)
    from matplotlib.figure import Figure

    configs = report.configs
    names = [c.config for c in configs] or ["(none)"]
    ok = [c.status == "ok" for c in configs] or [False]
    speed = [(c.samples_per_s or 0.0) if c.status == "ok" else 0.0 for c in configs] or [0.0]
    base = next((c.samples_per_s for c in configs if c.mode == "none" and c.status == "ok"), None)
    eff = [100 * (c.scaling_efficiency or 0.0) if c.status == "ok" else 0.0 for c in configs] or [0.0]
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
    for ax, values, errors, color, fmt in (
        (ax1, speed, speed_err, "tab:blue", "{:.0f}"),
        (ax2, eff, eff_err, "tab:green", "{:.0f}%"),
    ):
        bars = ax.bar(x, values, color=[color if good else "lightgrey" for good in ok])
        for i, bar in enumerate(bars):
            if i in noisy:
                bar.set_hatch("//")
        ax.errorbar(x, values, yerr=list(zip(*errors, strict=True)), fmt="none", ecolor="black", capsize=4)
        ax.set_xticks(x, [n + marks.get(i, "") for i, n in enumerate(names)])
        top = max([v + e[1] for v, e in zip(values, errors, strict=False)] + [1.0])
        for i, (v, good) in enumerate(zip(values, ok, strict=False)):
            label = fmt.format(v) if good else _status(report, i)
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


def _status(report: BenchReport, i: int) -> str:
    return report.configs[i].status if i < len(report.configs) else ""

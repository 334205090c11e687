"""The chart of a ``runner bench`` comparison: samples/s and scaling efficiency per configuration (matplotlib)."""

from __future__ import annotations

from pathlib import Path

from runner.tools.bench_report import BenchReport


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

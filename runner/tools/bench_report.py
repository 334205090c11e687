"""The result of ``runner bench``: a row per configuration, the comparison against ``none``, table and JSON. Figures:
:mod:`runner.tools.compare`.

It is apart from the measuring so that a report can be built, checked and shown from figures alone (the tests
build rows by hand), and so that what it says is worded in one place: the table, the JSON and the recommendation.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
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
    final_loss,
    loss_check,
    median,
    noise,
    percentile,
    scaling_efficiency,
    spread,
    steady,
    tail,
    throughput,
)
from runner.tracking.uri import ui_line

if TYPE_CHECKING:
    from runner.training import WorkerResult

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

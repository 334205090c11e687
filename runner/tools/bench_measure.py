"""Measuring one ``runner bench`` configuration: train it in a fresh process, then turn its step times into figures.

Each configuration runs in a fresh process (``spawn``), so ``CUDA_VISIBLE_DEVICES`` is narrowed
before CUDA starts, as ``runner exec`` does, and memory peaks are those of that configuration alone.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from runner.errors import DeviceError, Interrupted, SpecError, TrainingError, UsageError
from runner.tools.bench_figures import median, percentile, throughput
from runner.tools.bench_report import ConfigResult

if TYPE_CHECKING:
    from runner.launch.driver import ExecOptions, ExecResult
    from runner.spec.loading import LoadedSpec


@dataclass
class Outcome:
    """What the configuration process sends back.

    Attributes:
        status: ``ok``, ``skipped`` (cannot run here), ``failed`` or ``interrupted``.
        reason: Why it was skipped or how it failed.
        result: What ``exec_experiment`` returned (``ok`` only).
        cuda_peaks: ``torch.cuda.max_memory_allocated`` of every CUDA device of that process, bytes.
    """

    status: str
    reason: str = ""
    result: ExecResult | None = None
    cuda_peaks: list[int] = field(default_factory=list)


def measure(
    loaded: LoadedSpec,
    result: ConfigResult,
    *,
    batch_sizes: Sequence[int],
    options: ExecOptions,
    warmup: int,
    steps: int,
) -> None:
    """Run one configuration in a fresh process and fill its result row.

    Args:
        loaded: The configuration's spec.
        result: Its row; filled in place (figures, or status and reason).
        batch_sizes: Global samples of each optimizer step of an epoch.
        options: How ``exec_experiment`` runs it (child run, tags, synchronised timing).
        warmup: Steps left out of the timing.
        steps: Steps timed.

    Raises:
        Interrupted: SIGINT arrived while it ran.
    """
    outcome = _in_fresh_process(loaded, options)
    if outcome.status == "interrupted":
        raise Interrupted()
    if outcome.status != "ok" or outcome.result is None:
        result.status, result.reason = outcome.status, outcome.reason
        return
    summarize(result, outcome.result, batch_sizes, warmup=warmup, steps=steps, cuda_peaks=outcome.cuda_peaks)


def summarize(
    result: ConfigResult,
    exec_result: ExecResult,
    batch_sizes: Sequence[int],
    *,
    warmup: int,
    steps: int,
    cuda_peaks: Sequence[int] = (),
) -> None:
    """Fill ``result`` from an :class:`runner.launch.driver.ExecResult` of ``warmup + steps`` steps.

    Args:
        result: The row to fill.
        exec_result: What ``exec_experiment`` returned; ``workers`` holds every rank.
        batch_sizes: Global samples of each optimizer step of an epoch (cycled over epochs).
        warmup: Steps to leave out of the timing.
        steps: Steps to time.
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
    result.timed_samples = samples
    result.samples_per_s = throughput(samples, times)
    result.step_time_median_s = median(times)
    result.step_time_p90_s = percentile(times, 90)
    total = sum(times)
    result.data_wait_fraction = sum(waits) / total if total > 0 else None
    on_cuda = any(str(w.device).startswith("cuda") for w in workers)
    if on_cuda and result.mode != "ddp" and cuda_peaks:
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


def _in_fresh_process(loaded: LoadedSpec, options: ExecOptions) -> Outcome:
    """Run :func:`_child` in a new ``spawn`` process; a child that dies becomes a failed outcome."""
    import multiprocessing

    pool = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"))
    try:
        return pool.submit(_child, loaded, options).result()
    except BrokenProcessPool as exc:
        return Outcome("failed", f"the benchmark process died: {exc}")
    except KeyboardInterrupt:
        raise Interrupted() from None
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _child(loaded: LoadedSpec, options: ExecOptions) -> Outcome:
    """Body of the configuration process: ``exec_experiment`` and the CUDA peaks of this process.

    Standard output is pointed at standard error first, so that the report (or ``--json``) is
    all that ``runner bench`` writes to standard output.
    """
    sys.stdout.flush()
    os.dup2(2, 1)
    from runner.errors import RunnerError
    from runner.launch.driver import exec_experiment

    try:
        result = exec_experiment(loaded, options)
    except (SpecError, DeviceError, UsageError) as exc:
        return Outcome("skipped", reason(exc))
    except (Interrupted, KeyboardInterrupt):
        return Outcome("interrupted", "interrupted")
    except TrainingError as exc:
        return Outcome("failed", reason(exc))
    except RunnerError as exc:
        return Outcome("failed", f"{type(exc).__name__}: {reason(exc)}")
    except Exception as exc:
        return Outcome("failed", f"{type(exc).__name__}: {reason(exc)}")
    peaks: list[int] = []
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        peaks = [int(torch.cuda.max_memory_allocated(i)) for i in range(torch.cuda.device_count())]
    return Outcome("ok", result=result, cuda_peaks=peaks)

"""Running a sweep's trials as processes: ``jobs`` at a time, spread over GPUs, stopped together on SIGINT/SIGTERM."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

from runner.errors import Interrupted
from runner.spec.naming import trial_run_name
from runner.tools.sweep_report import first_line
from runner.tools.sweep_space import SweepDefinition, Trial, TrialResult
from runner.tools.sweep_trials import trial_metric, trial_tags

if TYPE_CHECKING:
    from runner.plan import Plan
    from runner.spec.schema import ExperimentSpec

TERMINATE_GRACE_S = 30.0  # how long stopped trial processes get to end their runs KILLED
_FAILED_TAIL_CHARS = 2000
_POLL_S = 0.1


def device_pool(spec: ExperimentSpec, plans: Sequence[Plan], definition: SweepDefinition) -> list[int] | None:
    """GPU ids to spread concurrent single-GPU trials over, or ``None`` to leave devices alone."""
    if not plans or any(k == "devices.ids" or k.startswith("devices.ids.") for k, _ in definition.params):
        return None
    if any(
        p.devices.accelerator != "cuda" or len(p.devices.requested_ids) != 1 or p.devices.world_size != 1 for p in plans
    ):
        return None
    ids = spec.devices.ids
    return list(ids) if isinstance(ids, list) else list(range(len(plans[0].devices.visible)))


def pick_device(load: dict[int, int], pool: Sequence[int]) -> int:
    """The device of ``pool`` running the fewest trials (first in ``pool`` on ties)."""
    return min(pool, key=lambda k: (load.get(k, 0), list(pool).index(k)))


@dataclass
class _Running:
    """A trial process and the GPU it was given (``None``: the spec's own devices)."""

    trial: Trial
    device: int | None


class Subprocesses:
    """Run trials as ``python -m runner.tools.sweep JOB.json`` processes, ``jobs`` at a time.

    Args:
        path: The spec file.
        overrides: Base ``--set`` strings; each trial's own values are applied after them.
        parent_id: The sweep's parent run.
        metric: The metric that ranks trials.
        jobs: Processes running at once; with more than one, each process's output goes to a log.
        pool: GPU ids to spread single-GPU trials over (see :func:`device_pool`), or ``None``.
        progress: Called with each result as it arrives; returns it.
    """

    def __init__(
        self,
        path: Path,
        overrides: Sequence[str],
        *,
        parent_id: str,
        metric: str,
        jobs: int,
        pool: list[int] | None,
        progress: Callable[[TrialResult], TrialResult],
    ):
        self.path, self.overrides, self.parent_id, self.metric = path, list(overrides), parent_id, metric
        self.jobs, self.pool, self.progress = jobs, pool, progress
        self._load: dict[int, int] = {}

    def run(self, todo: Sequence[tuple[Trial, Plan]]) -> Iterator[TrialResult]:
        """Yield each trial's result as its process ends; stop every process when interrupted."""
        queue = deque(todo)
        running: dict[subprocess.Popen[bytes], _Running] = {}
        with tempfile.TemporaryDirectory(prefix="runner-sweep-") as tmp:
            folder = Path(tmp)
            try:
                while queue or running:
                    while queue and len(running) < self.jobs:
                        trial, plan = queue.popleft()
                        device = self._take_device()
                        running[self._start(folder, trial, plan, device)] = _Running(trial, device)
                    finished = [p for p in running if p.poll() is not None]
                    if not finished:
                        time.sleep(_POLL_S)
                    for proc in finished:
                        done = running.pop(proc)
                        if done.device is not None:
                            self._load[done.device] -= 1
                        yield self.progress(self._collect(folder, done.trial, proc))
            except BaseException:  # also GeneratorExit: never leave trial processes behind
                _stop(list(running))
                raise

    def _take_device(self) -> int | None:
        """The least loaded GPU of the pool, counted as busy; ``None`` without a pool."""
        if not self.pool:
            return None
        device = pick_device(self._load, self.pool)
        self._load[device] = self._load.get(device, 0) + 1
        return device

    def _start(self, folder: Path, trial: Trial, plan: Plan, device: int | None) -> subprocess.Popen[bytes]:
        """Write the trial's job file and start its process."""
        sets = [*self.overrides, *trial.overrides()] + ([f"devices.ids=[{device}]"] if device is not None else [])
        job = folder / f"trial-{trial.index}.json"
        spec = {
            "path": str(self.path),
            "overrides": sets,
            "parent_run_id": self.parent_id,
            "run_name": trial_run_name(trial.values),
            "tags": trial_tags(trial),
            "result": str(folder / f"trial-{trial.index}.result.json"),
        }
        job.write_text(json.dumps(spec), encoding="utf-8")
        env = dict(os.environ)
        if plan.devices.accelerator == "cpu" and self.jobs > 1 and "OMP_NUM_THREADS" not in env:
            env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // self.jobs))
        quiet = self.jobs > 1  # concurrent trials would interleave their output: keep it in a log
        with contextlib.ExitStack() as stack:
            out = stack.enter_context(open(folder / f"trial-{trial.index}.log", "wb")) if quiet else None
            return subprocess.Popen(
                [sys.executable, "-m", "runner.tools.sweep", str(job)],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT if quiet else None,
            )

    def _collect(self, folder: Path, trial: Trial, proc: subprocess.Popen[bytes]) -> TrialResult:
        """The trial's result file, or a FAILED/KILLED result with the tail of its log when it wrote none."""
        result_file = folder / f"trial-{trial.index}.result.json"
        if result_file.is_file():
            data = json.loads(result_file.read_text(encoding="utf-8"))
            value = trial_metric(data.get("metrics") or {}, self.metric) if data["status"] == "FINISHED" else None
            return TrialResult(trial.index, trial.values, data.get("run_id"), data["status"], value, data.get("error"))
        code = proc.returncode
        status = "KILLED" if code in (130, -signal.SIGINT, -signal.SIGTERM) else "FAILED"
        log_file = folder / f"trial-{trial.index}.log"
        tail = (
            log_file.read_text(encoding="utf-8", errors="replace")[-_FAILED_TAIL_CHARS:] if log_file.is_file() else ""
        )
        return TrialResult(
            trial.index, trial.values, None, status, None, f"trial process exited with status {code}\n{tail}".strip()
        )


@contextlib.contextmanager
def sigterm_interrupts() -> Iterator[None]:
    """Turn SIGTERM into :class:`Interrupted` while trials run, so the sweep ends its runs KILLED.

    (SIGINT already raises KeyboardInterrupt; a training trial installs its own handlers
    for both and restores these afterwards.)
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handle(signum: int, frame: FrameType | None) -> None:
        raise Interrupted(signum)

    previous = signal.signal(signal.SIGTERM, handle)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _stop(procs: Sequence[subprocess.Popen[bytes]]) -> None:
    """Ask running trial processes to stop (their runs end KILLED), then kill what remains."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + TERMINATE_GRACE_S
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class Progress:
    """One line per finished trial: ``[sweep 2/4] trial 1 (optim.lr=0.01): FINISHED val/accuracy=0.93``.

    Args:
        say: Receives each line.
        total: Trials in the sweep.
        metric: The metric shown.
        done: Trials already finished (earlier runs of a resumed sweep).
    """

    def __init__(self, say: Callable[[str], None], total: int, metric: str, done: int = 0):
        self.say, self.total, self.metric, self.done = say, total, metric, done

    def __call__(self, result: TrialResult) -> TrialResult:
        self.done += 1
        value = "" if result.metric_value is None else f" {self.metric}={result.metric_value:.6g}"
        detail = f": {first_line(result.error)}" if result.error else ""
        index = result.index
        self.say(
            f"[sweep {self.done}/{self.total}] {Trial(index, result.values).label()}: {result.status}{value}{detail}"
        )
        return result

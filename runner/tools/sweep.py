"""``runner sweep``: validate every trial of a sweep, run them as child runs of one MLflow run, rank them.

One parent MLflow run per sweep (tag ``runner.sweep = "parent"``; params: the sweep
definition) and one child run per trial (``mlflow.parentRunId``, so the MLflow UI nests
them; tags ``runner.sweep.trial``, ``runner.sweep.values`` and ``sweep.<key>``). A trial
is the base spec plus ``--set key=value`` overrides, minus its ``[sweep]`` table: a plain
experiment, run by :func:`runner.launch.driver.exec_experiment`.

Trials run one after another in this process. They run as subprocesses
(``python -m runner.tools.sweep``) when ``jobs > 1``, and also when they use CUDA: CUDA keeps
the device view of the first trial in a process, and every trial must free its GPU memory.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from runner.errors import DeviceError, Interrupted, RunnerError, SpecError, SpecIssue, TrackingError, UsageError
from runner.tools.sweep_space import (
    SweepDefinition,
    SweepReport,
    Trial,
    TrialResult,
    build_definition,
    expand,
    first_line,
)
from runner.tools.sweep_store import SweepParent, SweepStore, mlflow_key

TERMINATE_GRACE_S = 30.0  # how long stopped trial processes get to end their runs KILLED
_FAILED_TAIL_CHARS = 2000


def run_sweep(
    path: str | Path,
    overrides: Sequence[str] = (),
    *,
    grid: Sequence[str] = (),
    random: Sequence[str] = (),
    num_trials: int | None = None,
    seed: int | None = None,
    jobs: int = 1,
    metric: str | None = None,
    goal: str | None = None,
    resume: str | None = None,
    log: Callable[[str], None] | None = None,
) -> SweepReport:
    """Run every trial of a sweep as a child run of one parent MLflow run.

    Every trial spec is loaded and validated (schema, devices, model name) before the
    parent run is created, so a bad value fails the sweep at once. A trial that fails while
    training is recorded as FAILED and the sweep goes on.

    Args:
        path: The spec file; its ``[sweep]`` table (if any) is the default definition.
        overrides: ``--set`` strings applied to every trial before the trial's own values.
        grid: ``--grid KEY=V1,V2`` entries. random: ``--random KEY=LOW:HIGH[:log|:int]`` entries.
        num_trials: Trial budget (random: required; grid: cap). Default: the spec's.
        seed: Seed of random sampling. Default: the spec's (0).
        jobs: Trials running at once (>= 1); more than one runs them as subprocesses and
            spreads single-GPU trials over the spec's devices.
        metric: Metric that ranks trials. Default: the spec's (``val/accuracy``).
        goal: ``"max"`` or ``"min"``. Default: the spec's (``max``).
        resume: Parent run id of an earlier sweep: trials with a FINISHED child run are not
            run again. Without definition flags (``grid``, ``random``, ``num_trials``, ``seed``)
            and ``overrides``, the recorded ones are used.
        log: Receives one progress line per trial. Default: standard error.

    Returns:
        The :class:`SweepReport`; the parent run is FINISHED when every trial finished, else FAILED.

    Raises:
        SpecError: The spec, the sweep definition or a trial is invalid (every problem,
            each naming its trial); no run is created.
        UsageError: Bad command-line entries, tracking disabled, or an unusable ``resume``.
        DeviceError: A trial asks for devices this machine does not have.
        TrackingError: The tracking store cannot be used.
        Interrupted: Stopped by SIGINT/SIGTERM; the parent run is KILLED.
    """
    from runner.spec.loading import load_spec

    say = log or _stderr
    if jobs < 1:
        raise UsageError(f"--jobs {jobs}: give at least 1")
    overrides = list(overrides)
    base = load_spec(path, overrides)
    if not base.spec.tracking.enabled:
        raise UsageError(f"{base.path}: a sweep records its trials in MLflow; set tracking.enabled = true")
    store = SweepStore.for_spec(base.spec)
    notes: list[str] = []
    previous = None
    if resume is not None:
        previous = store.sweep_parent(resume)
        if not overrides and previous.overrides:
            overrides = list(previous.overrides)
            base = load_spec(path, overrides)
        elif overrides != previous.overrides:
            raise UsageError(
                f"--resume {resume}: the sweep ran with --set {previous.overrides}, now {overrides}; "
                "repeat the original --set flags (or none, to reuse them)"
            )
        if previous.spec_sha256 and previous.spec_sha256 != base.sha256:
            notes.append("the spec changed since the sweep started: earlier trials ran with the old spec")
    definition = _definition(
        base, previous, grid=grid, random=random, num_trials=num_trials, seed=seed, metric=metric, goal=goal
    )
    trials = expand(definition)
    prepared = prepare_trials(base.path, overrides, trials)
    store.check()

    done: dict[int, TrialResult] = {}
    if previous is not None:
        done = store.finished_trials(previous.run_id, trials, definition.metric)
        parent_id = previous.run_id
        store.reopen(parent_id)
    else:
        parent_id = store.create_parent(base, overrides, definition, trials)
    earlier = f", {len(done)} finished earlier" if previous is not None else ""
    say(
        f"sweep {parent_id}: {len(trials)} trials{earlier}, {definition.method}, {definition.metric} ({definition.goal})"
    )
    report = SweepReport(definition, [], parent_id, store.uri, store.experiment, notes)
    results: dict[int, TrialResult] = dict(done)
    started_ms = int(time.time() * 1000)
    try:
        todo = [(t, loaded, plan) for t, (loaded, plan) in zip(trials, prepared, strict=False) if t.index not in done]
        progress = _Progress(say, len(trials), definition.metric, len(done))
        with _sigterm_interrupts():
            for result in _run_trials(todo, base, overrides, parent_id, definition, jobs, progress):
                results[result.index] = result
        report.trials = [results[t.index] for t in trials]
        store.fill_run_ids(parent_id, report.trials, started_ms)
    except (Interrupted, KeyboardInterrupt) as exc:
        report.trials = [results[t.index] for t in trials if t.index in results]
        store.end_quietly(parent_id, "KILLED", "the sweep was interrupted", report)
        raise Interrupted(getattr(exc, "signum", 2)) from None
    except BaseException:
        report.trials = [results[t.index] for t in trials if t.index in results]
        store.end_quietly(parent_id, "FAILED", traceback.format_exc(), report)
        raise
    if report.best is None and any(t.status == "FINISHED" for t in report.trials):
        notes.append(
            f"no finished trial logged the metric {definition.metric!r}: pass --metric NAME (e.g. val/loss --mode min)"
        )
    failures = [f"{t.index}: {first_line(t.error or t.status)}" for t in report.trials if t.status != "FINISHED"]
    error = f"{len(failures)} of {len(trials)} trials did not finish: " + "; ".join(failures) if failures else None
    store.end(parent_id, "FAILED" if failures else "FINISHED", error, report)
    return report


def _definition(base: Any, previous: SweepParent | None, **cli: Any) -> SweepDefinition:
    """The definition from the spec and the command line; on resume, the recorded one.

    Raises:
        UsageError, SpecError: See :func:`runner.tools.sweep_space.build_definition`; on resume,
            definition flags that would change the recorded trials.
    """
    from runner.spec.locate import locate_keys

    flags = bool(cli["grid"] or cli["random"] or cli["num_trials"] is not None or cli["seed"] is not None)
    if previous is not None and not flags:
        recorded = previous.definition
        return dataclasses.replace(recorded, metric=cli["metric"] or recorded.metric, goal=cli["goal"] or recorded.goal)
    definition = build_definition(base.spec.sweep, spec_file=base.path, key_lines=locate_keys(base.source_text), **cli)
    if previous is not None and not definition.same_trials(previous.definition):
        raise UsageError(
            f"--resume {previous.run_id}: the sweep definition differs from the recorded one "
            f"({json.dumps(previous.definition.to_json())}); repeat the original flags, or give none to reuse them"
        )
    return definition


def _run_trials(
    todo: Sequence[tuple[Trial, Any, Any]],
    base: Any,
    overrides: Sequence[str],
    parent_id: str,
    definition: SweepDefinition,
    jobs: int,
    progress: _Progress,
) -> Iterator[TrialResult]:
    """Yield each trial's result as it ends: in this process, or as subprocesses (jobs > 1, or CUDA)."""
    cuda = any(plan.devices.accelerator == "cuda" for _, _, plan in todo)
    if jobs == 1 and not cuda:
        for trial, loaded, _ in todo:
            yield progress(_run_here(loaded, trial, parent_id, definition.metric))
        return
    pool = _device_pool(base.spec, [p for _, _, p in todo], definition) if jobs > 1 else None
    children = _Subprocesses(base.path, overrides, parent_id, definition.metric, jobs, pool, progress)
    yield from children.run([(t, p) for t, _, p in todo])


# --------------------------------------------------------------------------- trials


def without_sweep(loaded: Any) -> Any:
    """Return ``loaded`` as a plain experiment: its ``[sweep]`` table removed, hash recomputed.

    Args:
        loaded: A :class:`runner.spec.loading.LoadedSpec`.

    Raises:
        SpecError: Cannot happen for a spec that validated with its ``[sweep]`` table.
    """
    from runner.spec.dump import spec_sha256
    from runner.spec.loading import spec_from_dict

    if loaded.spec.sweep is None and "sweep" not in loaded.data:
        return loaded
    data = {k: v for k, v in loaded.data.items() if k != "sweep"}
    spec = spec_from_dict(data, origin=str(loaded.path))
    return dataclasses.replace(loaded, spec=spec, data=data, sha256=spec_sha256(spec))


def prepare_trials(path: Path, overrides: Sequence[str], trials: Sequence[Trial]) -> list[tuple[Any, Any]]:
    """Load, validate and plan every trial before any runs; collect every problem.

    Args:
        path: The spec file.
        overrides: Base ``--set`` strings; each trial's own values are applied after them.
        trials: The trials.

    Returns:
        ``(LoadedSpec without [sweep], runner.plan.Plan)`` per trial.

    Raises:
        SpecError: Trial specs that do not validate or name unknown models; each issue
            keeps its key and names the trial.
        DeviceError: Trials that ask for devices this machine does not have, one line each.
    """
    from runner.devices.inventory import probe_inventory
    from runner.plan import make_plan
    from runner.spec.loading import load_spec
    from runner.training.models import check_model_name

    inventory = probe_inventory(os.environ)
    issues: list[SpecIssue] = []
    device_errors: list[str] = []
    checked: dict[tuple[str, Path], SpecError | None] = {}
    out = []
    for trial in trials:
        try:
            loaded = without_sweep(load_spec(path, [*overrides, *trial.overrides()]))
        except SpecError as exc:
            issues += [_in_trial(issue, trial) for issue in exc.issues]
            continue
        name_key = (loaded.spec.model.name, loaded.path.parent)
        if name_key not in checked:
            try:
                check_model_name(*name_key)
                checked[name_key] = None
            except SpecError as exc:
                checked[name_key] = exc
        if checked[name_key] is not None:
            issues += [_in_trial(issue, trial) for issue in checked[name_key].issues]  # type: ignore[union-attr]
            continue
        try:
            out.append((loaded, make_plan(loaded, inventory=inventory)))
        except (DeviceError, UsageError) as exc:
            device_errors.append(f"{trial.label()}: {exc}")
    if issues:
        raise SpecError(issues)
    if device_errors:
        raise DeviceError("\n".join(device_errors))
    return out


def trial_tags(trial: Trial) -> tuple[tuple[str, str], ...]:
    """MLflow tags of a trial's child run: index, values (JSON) and ``sweep.<key>`` per swept key."""
    from runner.tracking.trackers import param_value

    tags = [
        ("runner.sweep", "trial"),
        ("runner.sweep.trial", str(trial.index)),
        ("runner.sweep.values", json.dumps(trial.values, default=str)),
    ]
    tags += [(mlflow_key(f"sweep.{k}"), param_value(v)) for k, v in trial.values.items()]
    return tuple(tags)


def _in_trial(issue: SpecIssue, trial: Trial) -> SpecIssue:
    return dataclasses.replace(issue, message=f"{issue.message} [sweep {trial.label()}]")


def _run_here(loaded: Any, trial: Trial, parent_id: str, metric: str) -> TrialResult:
    """Run one trial in this process; a failure becomes a FAILED result."""
    from runner.launch.driver import ExecOptions, exec_experiment

    options = ExecOptions(run_name=f"trial-{trial.index}", parent_run_id=parent_id, tags=trial_tags(trial))
    try:
        out = exec_experiment(loaded, options)
    except (Interrupted, KeyboardInterrupt):
        raise
    except Exception as exc:
        return TrialResult(trial.index, trial.values, None, "FAILED", None, f"{type(exc).__name__}: {exc}")
    return TrialResult(trial.index, trial.values, out.run_id, "FINISHED", _metric(out.metrics, metric))


def _device_pool(spec: Any, plans: Sequence[Any], definition: SweepDefinition) -> list[int] | None:
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


class _Subprocesses:
    """Run trials as ``python -m runner.tools.sweep`` processes, ``jobs`` at a time."""

    def __init__(
        self,
        path: Path,
        overrides: Sequence[str],
        parent_id: str,
        metric: str,
        jobs: int,
        pool: list[int] | None,
        progress: Callable[[TrialResult], TrialResult],
    ):
        self.path, self.overrides, self.parent_id, self.metric = path, list(overrides), parent_id, metric
        self.jobs, self.pool, self.progress = jobs, pool, progress

    def run(self, todo: Sequence[tuple[Trial, Any]]) -> Iterator[TrialResult]:
        """Yield each trial's result as its process ends; stop every process when interrupted."""
        queue = deque(todo)
        running: dict[subprocess.Popen, tuple[Trial, int | None, Path]] = {}
        load: dict[int, int] = {}
        with tempfile.TemporaryDirectory(prefix="runner-sweep-") as tmp:
            try:
                while queue or running:
                    while queue and len(running) < self.jobs:
                        trial, plan = queue.popleft()
                        device = pick_device(load, self.pool) if self.pool else None
                        if device is not None:
                            load[device] = load.get(device, 0) + 1
                        running[self._start(Path(tmp), trial, plan, device)] = (trial, device, Path(tmp))
                    finished = [p for p in running if p.poll() is not None]
                    if not finished:
                        time.sleep(0.1)
                    for proc in finished:
                        trial, device, folder = running.pop(proc)
                        if device is not None:
                            load[device] -= 1
                        yield self.progress(self._collect(folder, trial, proc))
            except BaseException:  # also GeneratorExit: never leave trial processes behind
                _stop(list(running))
                raise

    def _start(self, folder: Path, trial: Trial, plan: Any, device: int | None) -> subprocess.Popen:
        sets = [*self.overrides, *trial.overrides()] + ([f"devices.ids=[{device}]"] if device is not None else [])
        job = folder / f"trial-{trial.index}.json"
        job.write_text(
            json.dumps(
                {
                    "path": str(self.path),
                    "overrides": sets,
                    "parent_run_id": self.parent_id,
                    "run_name": f"trial-{trial.index}",
                    "tags": trial_tags(trial),
                    "result": str(folder / f"trial-{trial.index}.result.json"),
                }
            ),
            encoding="utf-8",
        )
        env = dict(os.environ)
        if plan.devices.accelerator == "cpu" and self.jobs > 1 and "OMP_NUM_THREADS" not in env:
            env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // self.jobs))
        quiet = self.jobs > 1  # concurrent trials would interleave their output: keep it in a log
        out = open(folder / f"trial-{trial.index}.log", "wb") if quiet else None
        try:
            return subprocess.Popen(
                [sys.executable, "-m", "runner.tools.sweep", str(job)],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT if quiet else None,
            )
        finally:
            if out is not None:
                out.close()

    def _collect(self, folder: Path, trial: Trial, proc: subprocess.Popen) -> TrialResult:
        result_file = folder / f"trial-{trial.index}.result.json"
        if result_file.is_file():
            data = json.loads(result_file.read_text(encoding="utf-8"))
            value = _metric(data.get("metrics") or {}, self.metric) if data["status"] == "FINISHED" else None
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
def _sigterm_interrupts() -> Iterator[None]:
    """Turn SIGTERM into :class:`Interrupted` while trials run, so the sweep ends its runs KILLED.

    (SIGINT already raises KeyboardInterrupt; a training trial installs its own handlers
    for both and restores these afterwards.)
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handle(signum: int, frame: Any) -> None:
        raise Interrupted(signum)

    previous = signal.signal(signal.SIGTERM, handle)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _stop(procs: Sequence[subprocess.Popen]) -> None:
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


# --------------------------------------------------------------------------- helpers


def _metric(metrics: dict[str, float], name: str) -> float | None:
    value = metrics.get(name)
    return None if value is None else float(value)


class _Progress:
    """One line per finished trial: ``[sweep 2/4] trial 1 (optim.lr=0.01): FINISHED val/accuracy=0.93``."""

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


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- trial process


def _trial_main(argv: Sequence[str]) -> int:
    """Entry of a trial subprocess: ``python -m runner.tools.sweep JOB.json``.

    Loads the trial spec exactly as the in-process path does (base spec, ``--set``
    overrides, ``[sweep]`` removed), runs it as a child run with the trial's tags, and writes
    ``{"status", "run_id", "metrics", "error"}`` to the job's ``result`` file.

    Returns:
        0 finished, 1 training failed, 2 bad spec/devices/tracking, 130 interrupted.
    """
    from runner.launch.driver import ExecOptions, exec_experiment
    from runner.spec.loading import load_spec

    job = json.loads(Path(argv[0]).read_text(encoding="utf-8"))
    result: dict[str, Any] = {"status": "FAILED", "run_id": None, "metrics": {}, "error": None}
    code = 1
    try:
        loaded = without_sweep(load_spec(job["path"], job["overrides"]))
        options = ExecOptions(
            run_name=job["run_name"], parent_run_id=job["parent_run_id"], tags=tuple(tuple(t) for t in job["tags"])
        )
        out = exec_experiment(loaded, options)
        result.update(status="FINISHED", run_id=out.run_id, metrics=out.metrics)
        code = 0
    except (Interrupted, KeyboardInterrupt):
        result.update(status="KILLED", error="interrupted")
        code = 130
    except (SpecError, UsageError, DeviceError, TrackingError) as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
        code = 2
    except RunnerError as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
    if result["error"]:
        print(f"runner: trial failed: {result['error']}", file=sys.stderr)
    target = Path(job["result"])
    partial = target.with_suffix(".partial")
    partial.write_text(json.dumps(result, default=str), encoding="utf-8")
    partial.replace(target)
    return code


if __name__ == "__main__":
    sys.exit(_trial_main(sys.argv[1:]))

"""``runner sweep``: validate every trial of a sweep, run them as child runs of one MLflow run, rank them.

One parent MLflow run per sweep (tag ``runner.sweep = "parent"``; params: the sweep
definition) and one child run per trial (``mlflow.parentRunId``, so the MLflow UI nests
them), named by its values (``lr=0.1 seed=0``, :func:`runner.spec.naming.trial_run_name`); tags
``runner.sweep.trial``, ``runner.sweep.values`` and ``sweep.<key>``). A trial
is the base spec plus ``--set key=value`` overrides, minus its ``[sweep]`` table: a plain
experiment, run by :func:`runner.launch.driver.exec_experiment`.

Trials run one after another in this process. They run as subprocesses
(``python -m runner.tools.sweep``) when ``jobs > 1``, and also when they use CUDA: CUDA keeps
the device view of the first trial in a process, and every trial must free its GPU memory.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from runner.errors import DeviceError, Interrupted, RunnerError, SpecError, TrackingError, UsageError
from runner.spec.naming import trial_run_name
from runner.tools.sweep_jobs import Progress, Subprocesses, device_pool, sigterm_interrupts
from runner.tools.sweep_report import SweepReport, first_line
from runner.tools.sweep_space import SweepDefinition, Trial, TrialResult, build_definition, expand
from runner.tools.sweep_store import SweepParent, SweepStore
from runner.tools.sweep_trials import prepare_trials, swept_in_file, trial_metric, trial_tags, without_sweep

if TYPE_CHECKING:
    from runner.plan import Plan
    from runner.spec.loading import LoadedSpec

_Todo = Sequence[tuple[Trial, "LoadedSpec", "Plan"]]


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
    previous = store.sweep_parent(resume) if resume is not None else None
    if previous is not None:
        base, overrides = _resumed_base(base, path, overrides, previous, notes)
    definition = _definition(
        base, previous, grid=grid, random=random, num_trials=num_trials, seed=seed, metric=metric, goal=goal
    )
    trials = expand(definition)
    prepared = prepare_trials(base.path, overrides, trials, swept_in_file(base, grid, random))
    store.check()
    done, parent_id = _open_parent(store, base, overrides, trials, definition=definition, previous=previous)
    earlier = f", {len(done)} finished earlier" if previous is not None else ""
    d = definition
    say(f"sweep {parent_id}: {len(trials)} trials{earlier}, {d.method}, {d.metric} ({d.goal})")
    report = SweepReport(definition, [], parent_id, store.uri, store.experiment, notes)
    todo = [(t, loaded, plan) for t, (loaded, plan) in zip(trials, prepared, strict=False) if t.index not in done]
    progress = Progress(say, len(trials), definition.metric, len(done))
    _run_all(report, store, trials, todo, done, how=(base, overrides, jobs), progress=progress)
    _finish(report, store)
    return report


def _resumed_base(
    base: LoadedSpec, path: str | Path, overrides: list[str], previous: SweepParent, notes: list[str]
) -> tuple[LoadedSpec, list[str]]:
    """The base spec of a resumed sweep: with its recorded ``--set`` flags when none are given.

    Raises:
        UsageError: Other ``--set`` flags than the recorded ones.
    """
    from runner.spec.loading import load_spec

    if not overrides and previous.overrides:
        overrides = list(previous.overrides)
        base = load_spec(path, overrides)
    elif overrides != previous.overrides:
        raise UsageError(
            f"--resume {previous.run_id}: the sweep ran with --set {previous.overrides}, now {overrides}; "
            "repeat the original --set flags (or none, to reuse them)"
        )
    if previous.spec_sha256 and previous.spec_sha256 != base.sha256:
        notes.append("the spec changed since the sweep started: earlier trials ran with the old spec")
    return base, overrides


def _open_parent(
    store: SweepStore,
    base: LoadedSpec,
    overrides: Sequence[str],
    trials: Sequence[Trial],
    *,
    definition: SweepDefinition,
    previous: SweepParent | None,
) -> tuple[dict[int, TrialResult], str]:
    """``(trials finished earlier, parent run id)``: the reopened parent on resume, else a new one."""
    if previous is None:
        return {}, store.create_parent(base, overrides, definition, trials)
    done = store.finished_trials(previous.run_id, trials, definition.metric)
    store.reopen(previous.run_id)
    return done, previous.run_id


def _run_all(
    report: SweepReport,
    store: SweepStore,
    trials: Sequence[Trial],
    todo: _Todo,
    done: dict[int, TrialResult],
    *,
    how: tuple[LoadedSpec, Sequence[str], int],
    progress: Progress,
) -> None:
    """Run the trials not ``done`` and fill ``report.trials``; on interrupt or error, end the parent first.

    Args:
        how: ``(base spec, --set overrides, jobs)``.

    Raises:
        Interrupted: SIGINT/SIGTERM; the parent run is KILLED.
    """
    results: dict[int, TrialResult] = dict(done)
    parent_id = report.parent_run_id
    started_ms = int(time.time() * 1000)
    base, overrides, jobs = how
    try:
        with sigterm_interrupts():
            for result in _run_trials(
                todo, base, overrides, parent_id=parent_id, definition=report.definition, jobs=jobs, progress=progress
            ):
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


def _finish(report: SweepReport, store: SweepStore) -> None:
    """Note a metric nobody logged, then end the parent FINISHED, or FAILED when a trial did not finish."""
    metric = report.definition.metric
    if report.best is None and any(t.status == "FINISHED" for t in report.trials):
        report.notes.append(
            f"no finished trial logged the metric {metric!r}: pass --metric NAME (e.g. val/loss --mode min)"
        )
    failures = [f"{t.index}: {first_line(t.error or t.status)}" for t in report.trials if t.status != "FINISHED"]
    total = len(report.trials)
    error = f"{len(failures)} of {total} trials did not finish: " + "; ".join(failures) if failures else None
    store.end(report.parent_run_id, "FAILED" if failures else "FINISHED", error, report)


def _definition(base: LoadedSpec, previous: SweepParent | None, **cli: Any) -> SweepDefinition:
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
    todo: _Todo,
    base: LoadedSpec,
    overrides: Sequence[str],
    *,
    parent_id: str,
    definition: SweepDefinition,
    jobs: int,
    progress: Progress,
) -> Iterator[TrialResult]:
    """Yield each trial's result as it ends: in this process, or as subprocesses (jobs > 1, or CUDA)."""
    cuda = any(plan.devices.accelerator == "cuda" for _, _, plan in todo)
    if jobs == 1 and not cuda:
        for trial, loaded, _ in todo:
            yield progress(_run_here(loaded, trial, parent_id, definition.metric))
        return
    pool = device_pool(base.spec, [p for _, _, p in todo], definition) if jobs > 1 else None
    children = Subprocesses(
        base.path, overrides, parent_id=parent_id, metric=definition.metric, jobs=jobs, pool=pool, progress=progress
    )
    yield from children.run([(t, p) for t, _, p in todo])


def _run_here(loaded: LoadedSpec, trial: Trial, parent_id: str, metric: str) -> TrialResult:
    """Run one trial in this process; a failure becomes a FAILED result."""
    from runner.launch.driver import ExecOptions, exec_experiment

    options = ExecOptions(run_name=trial_run_name(trial.values), parent_run_id=parent_id, tags=trial_tags(trial))
    try:
        out = exec_experiment(loaded, options)
    except (Interrupted, KeyboardInterrupt):
        raise
    except Exception as exc:
        return TrialResult(trial.index, trial.values, None, "FAILED", None, f"{type(exc).__name__}: {exc}")
    return TrialResult(trial.index, trial.values, out.run_id, "FINISHED", trial_metric(out.metrics, metric))


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


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

"""One sweep worker's loop: pull the next trial from the study, run it as a child run in this process, tell Optuna.

The loop is the same for ``runner sweep`` running trials itself and for each of its warm
worker processes (:mod:`runner.tools.sweep_jobs`): a process imports torch and MLflow and
opens the stores once, then runs trial after trial, so a trial costs little more than its
own training (docs/design.md §16).
"""

from __future__ import annotations

import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from runner.errors import Interrupted, RunnerError
from runner.tools.sweep_space import Trial, TrialResult
from runner.tools.sweep_trials import trial_metric, trial_tags, without_sweep

if TYPE_CHECKING:
    import optuna

    from runner.tools.sweep_store import SweepStore
    from runner.tools.sweep_study import SweepStudy


@dataclass(frozen=True)
class TrialSetup:
    """What every trial of one worker shares.

    Attributes:
        overrides: Base ``--set`` strings; each trial's own values are applied after them.
        environ: The environment trials are planned against (:func:`runner.tools.sweep_trials.trial_environ`).
        extra: ``--set`` strings after the trial's values (a warm worker's GPU: ``devices.ids=[k]``).
        unset: ``--unset`` keys, removed before any ``--set``.
    """

    path: Path
    overrides: tuple[str, ...]
    environ: Mapping[str, str]
    extra: tuple[str, ...] = ()
    unset: tuple[str, ...] = ()


def work(
    study: SweepStudy,
    store: SweepStore,
    setup: TrialSetup,
    report: Callable[[TrialResult], object],
    max_trials: int | None = None,
    *,
    on_start: Callable[[int], object] | None = None,
) -> int:
    """Run WAITING trials of ``study`` until none is left (or ``max_trials`` ran).

    Args:
        setup: The trials' base spec and environment.
        report: Receives each result as its trial ends.
        max_trials: Stop after this many trials (``None``: until the queue is empty).
        on_start: Receives the Optuna number of each trial as it starts.

    Returns:
        How many trials this call ran.

    Raises:
        Interrupted: SIGINT/SIGTERM; the trial that was running is enqueued again.
    """
    warm_up()
    take_over(study, store)
    done = 0
    while max_trials is None or done < max_trials:
        trial = study.next_trial()
        if trial is None:
            take_over(study, store)  # a trial whose worker died is enqueued again: take it over
            trial = study.next_trial()
        if trial is None:
            break
        if on_start is not None:
            on_start(trial.number)
        report(run_trial(study, store, setup, trial))
        done += 1
    return done


def take_over(study: SweepStudy, store: SweepStore) -> None:
    """Enqueue again the trials whose worker died, and end their old MLflow runs KILLED."""
    taken = study.fail_stale()
    if taken:
        store.kill_taken_over(study.parent_run_id, taken)


def warm_up() -> None:
    """Import what every trial runs (torch, MLflow, the training code) once, before the first trial starts."""
    import runner.launch.driver
    import runner.launch.worker
    import runner.tracking.mlflow_tracker
    import runner.training.setup  # noqa: F401


def run_trial(study: SweepStudy, store: SweepStore, setup: TrialSetup, trial: optuna.Trial) -> TrialResult:
    """Run one Optuna trial as a child run of the sweep; a failure becomes a FAILED result.

    Raises:
        Interrupted: SIGINT/SIGTERM during the trial: its run ends KILLED and the trial is
            enqueued again (with the same values), then the signal goes on up.
    """
    point = study.values_of(trial)
    parent_id = study.parent_run_id
    try:
        with study.heartbeat(trial):
            result = _execute(study, store, setup, trial, point, parent_id)
    except (Interrupted, KeyboardInterrupt):
        run_id = _quiet(lambda: store.trial_run(parent_id, trial.number))
        study.tell(trial, TrialResult(point.index, point.values, run_id, "KILLED", None, "interrupted"))
        raise
    except BaseException as exc:
        run_id = _quiet(lambda: store.trial_run(parent_id, trial.number))
        error = _describe(exc)
        study.tell(trial, TrialResult(point.index, point.values, run_id, "FAILED", None, error))
        if not isinstance(exc, Exception):
            raise
        return TrialResult(point.index, point.values, run_id, "FAILED", None, error)
    study.tell(trial, result)
    return result


def _execute(
    study: SweepStudy, store: SweepStore, setup: TrialSetup, trial: optuna.Trial, point: Trial, parent_id: str
) -> TrialResult:
    """Load the trial's spec and run it with ``runner exec``'s driver; tag the run when the pruner stopped it."""
    from runner.launch.driver import ExecOptions, exec_experiment
    from runner.spec.loading import load_spec
    from runner.tools.sweep_trials import OptunaPruning

    definition = study.definition
    loaded = without_sweep(load_spec(setup.path, [*setup.overrides, *point.overrides(), *setup.extra], setup.unset))
    pruning = None
    if definition.pruner != "none":
        pruning = OptunaPruning(study.url, study.name, trial.number, definition.to_json(), trial)
    options = ExecOptions(
        run_name=point.run_name(),
        parent_run_id=parent_id,
        tags=trial_tags(point, study.name, trial.number),
        environ=setup.environ,
        epoch_end=pruning,
        in_process=True,  # a trial reuses the sweep worker's process (its imports, its pool)
    )
    out = exec_experiment(loaded, options)
    stopped = out.workers[0].stopped_after_epoch if out.workers else None
    if stopped is not None and out.run_id is not None:
        store.mark_pruned(out.run_id, stopped)
    value = trial_metric(out.metrics, definition.metric)
    return TrialResult(
        point.index, point.values, out.run_id, "FINISHED", value, pruned=stopped is not None, pruned_epoch=stopped
    )


def _describe(exc: BaseException) -> str:
    """The error of a failed trial: the message of runner's own errors, a traceback for anything else."""
    if isinstance(exc, RunnerError):
        return f"{type(exc).__name__}: {exc}"
    return f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"


def _quiet(find: Callable[[], str | None]) -> str | None:
    """``find()``, or ``None`` when the store cannot answer (the trial's own error matters more)."""
    try:
        return find()
    except Exception:
        return None

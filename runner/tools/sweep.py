"""``runner sweep``: trials of one spec searched by Optuna, as child runs of one MLflow run, over any number of workers.

One Optuna study per sweep, in an RDB storage (default: sqlite ``optuna.db`` next to the
MLflow store; ``[sweep] storage`` or ``--storage`` for a database shared by several machines),
and one parent MLflow run (tag ``runner.sweep = "parent"``) with one child run per trial
(``mlflow.parentRunId``; tags ``runner.sweep.trial``, ``runner.sweep.values``, ``sweep.<key>``).
Every ``runner sweep`` started with the same spec and flags, in another shell, on another machine
or as a task of a Slurm job array, joins the same study and parent run and pulls the next
trial; run again after a stop, it continues where the sweep stopped (docs/design.md §16).

A trial is the base spec plus ``--set key=value`` overrides, minus its ``[sweep]`` table: a
plain experiment, run by ``runner.launch.driver.exec_experiment`` in this process (CPU,
``jobs = 1``) or in warm worker processes that run trial after trial (``jobs > 1``, or CUDA,
whose device view a process keeps).

The worker that ends the last trial ends the parent run: FINISHED, or FAILED when a trial did not finish. It
reads the trials' results after the count of pending ones: read before it, a trial that another worker ended in
between still showed RUNNING, and the parent ended FAILED with every trial complete.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import shlex
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from runner.errors import Interrupted, RunnerError, SpecError, SpecIssue, TrackingError, UsageError, echo, first_line
from runner.plan import Plan, make_plan
from runner.spec.loading import LoadedSpec, load_spec
from runner.spec.messages import locate_keys
from runner.tools.sweep_jobs import (
    Progress,
    TrialSetup,
    WorkerConfig,
    WorkerPool,
    device_pool,
    sigterm_interrupts,
    swept_devices,
    work,
)
from runner.tools.sweep_space import SweepDefinition, SweepReport, SweepStore, study_name, write_plots
from runner.tools.sweep_study import GRACE_S, HEARTBEAT_S, StorageError, SweepStudy, default_storage_url, open_storage
from runner.tools.sweep_trials import (
    CommandLine,
    build_definition,
    prepare_trials,
    swept_in_file,
    swept_on_cli,
    trial_environ,
    trials_to_check,
    without_sweep,
)
from runner.tracking.runs import TrackedRun, experiment_id
from runner.tracking.uri import absolute_uri, check_reachable, resolve_tracking_uri

if TYPE_CHECKING:
    from optuna.storages import RDBStorage


def run_sweep(
    path: str | Path,
    overrides: Sequence[str] = (),
    unset: Sequence[str] = (),
    *,
    cli: CommandLine | None = None,
    jobs: int = 1,
    storage: str | None = None,
    study: str | None = None,
    processes: bool = False,
) -> SweepReport:
    """Run a sweep's trials that no worker has run as child runs of its parent MLflow run.

    Every trial is validated and planned before the study or parent exists. A trial that fails is recorded FAILED and
    the sweep goes on; the last worker ends the parent with the best trial and plots. ``jobs > 1`` (or ``processes``)
    runs trials in warm worker processes; ``storage`` and ``study`` default to ``[sweep]``'s, else sqlite beside the
    store and a name derived from the spec. Raises SpecError: The spec, definition, a trial or the storage is invalid;
    no run is created. UsageError: Bad entries, tracking off, an unusable ``--storage``, or a study searching another
    sweep. Interrupted: SIGINT/SIGTERM; running trials are enqueued again, the parent KILLED when none runs elsewhere.
    """
    say = functools.partial(echo, err=True)
    if jobs < 1:
        raise UsageError(f"--jobs {jobs}: give at least 1")
    base = load_spec(path, list(overrides), unset)
    if not base.spec.tracking.enabled:
        raise UsageError(f"{base.path}: a sweep records its trials in MLflow; set tracking.enabled = true")
    lines = locate_keys(base.source_text)
    definition = build_definition(base.spec.sweep, cli or CommandLine(), spec_file=base.path, key_lines=lines)
    environ = trial_environ()
    plans = _checked_trials(base, definition, cli or CommandLine(), environ)
    store = SweepStore(resolve_tracking_uri(base.spec), base.spec.experiment_name)
    check_reachable(store.uri)
    opened, report = _open_study(base, definition, store, storage, study, lines)
    started = time.time()
    done = sum(r.status not in ("WAITING", "RUNNING") for r in opened.results())
    say(
        f"sweep {report.parent_run_id}: study {report.study!r} in {report.storage}, {definition.trials} trials "
        f"({done} done), {definition.method}, pruner {definition.pruner}, {definition.metric} ({definition.goal})"
    )
    progress = Progress(say, definition.trials, definition.metric, done)
    setup = TrialSetup(base.path, base.overrides, environ, unset=base.unset)
    run = lambda: _run_trials(opened, store, setup, base, plans, jobs, progress, processes)  # noqa: E731
    _run_to_the_end(report, opened, store, run)
    _finish(report, opened, store, since=started)
    return report


def _checked_trials(
    base: LoadedSpec, definition: SweepDefinition, flags: CommandLine, environ: dict[str, str]
) -> list[Plan]:
    """The plans of the trials to check (every grid point, every value and range end), each validated."""
    in_file, on_cli = swept_in_file(base, flags.grid, flags.random), swept_on_cli(flags.grid, flags.random)
    checks = trials_to_check(definition)
    prepared = prepare_trials(base.path, base.overrides, checks, environ, in_file, on_cli, unset=base.unset)
    return [plan for _, plan in prepared]


def _open_study(
    base: LoadedSpec,
    definition: SweepDefinition,
    store: SweepStore,
    storage: str | None,
    study: str | None,
    lines: dict[tuple, int],
) -> tuple[SweepStudy, SweepReport]:
    """Found or join the sweep's study and parent run, with an empty report; errors as :func:`run_sweep`."""
    url, rdb = _open_storage(base, storage, store.uri, lines)
    trial_base = without_sweep(base)
    named = study or (base.spec.sweep.study if base.spec.sweep is not None else None)
    name = named or study_name(base.spec.name, trial_base.sha256, definition)
    opened, founded = SweepStudy.open(
        rdb,
        url,
        name,
        definition,
        found=lambda s: store.create_parent(base, definition, name, url),
        spec_sha256=trial_base.sha256,
        unfound=lambda run_id: TrackedRun(store.uri, run_id).delete(),  # no trial ever pointed at it
    )
    notes = []
    if not founded:  # a study another worker created: reopen its parent run; note a trial spec that changed
        store.reopen(opened.parent_run_id)
        notes.append(f"continued study {name!r}: trials that ran before, here or in other workers, are not run again")
        if opened.spec_sha256 not in (None, trial_base.sha256):  # pragma: no cover - the default name has the hash
            notes.append("the trial spec differs from the study's first worker's")
    parent = opened.parent_run_id
    report = SweepReport(definition, [], parent, store.uri, store.experiment, notes, name, url)
    report.experiment_id = experiment_id(store.uri, store.experiment)  # created when missing
    return opened, report


def _open_storage(
    base: LoadedSpec, given: str | None, tracking_uri: str, lines: dict[tuple, int]
) -> tuple[str, RDBStorage]:
    """Open the study's storage; else UsageError (``--storage``), SpecError (``[sweep] storage``) or TrackingError."""
    from_spec = base.spec.sweep.storage if base.spec.sweep is not None else None
    # a relative sqlite path resolved here, so every worker process opens the same file
    url = absolute_uri(given or from_spec or default_storage_url(tracking_uri, base.path.parent))
    try:
        return url, open_storage(url)
    except StorageError as exc:
        if given:
            raise UsageError(f"--storage {given}: {exc}") from None
        if from_spec:
            issue = SpecIssue(base.path, lines.get(("sweep", "storage")), "sweep.storage", f"{exc} (fix the URL)")
            raise SpecError(issue) from None
        raise TrackingError(str(exc)) from None


def _run_trials(
    study: SweepStudy,
    store: SweepStore,
    setup: TrialSetup,
    base: LoadedSpec,
    plans: Sequence[Plan],
    jobs: int,
    progress: Progress,
    processes: bool = False,
) -> None:
    """Run trials until none waits: in this process (CPU, one at a time), else in warm worker processes, each with
    its GPU (when single-GPU trials are spread), its device view and log."""
    cuda = any(plan.devices.accelerator == "cuda" for plan in plans)
    if jobs == 1 and not cuda and not processes:
        work(study, store, setup, progress)
        return
    definition = study.definition
    pool = device_pool(base.spec, plans, definition) if jobs > 1 else None
    one_each = swept_devices(definition)
    with tempfile.TemporaryDirectory(prefix="runner-sweep-") as tmp:
        configs = []
        for k in range(jobs):
            extra: tuple[str, ...] = () if pool is None else (f"devices.ids=[{pool[k % len(pool)]}]",)
            env = {} if one_each else _device_env(setup, extra, plans)
            if plans and plans[0].devices.accelerator == "cpu" and jobs > 1 and "OMP_NUM_THREADS" not in os.environ:
                env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // jobs))
            configs.append(
                WorkerConfig(
                    index=k,
                    url=study.url,
                    study=study.name,
                    definition=definition.to_json(),
                    tracking_uri=store.uri,
                    experiment=store.experiment,
                    setup=dataclasses.replace(setup, extra=extra),
                    env=env,
                    log=str(Path(tmp) / f"worker-{k}.log") if jobs > 1 else None,
                    max_trials=1 if one_each else None,
                )
            )

        def dead(number: int, error: str) -> None:
            if not study.fail_dead(number, error):
                return  # the trial finished before its process died: its run and result stand
            run_id = store.trial_run(study.parent_run_id, number)
            if run_id is not None:
                TrackedRun(store.uri, run_id).end("FAILED", error)

        for error in WorkerPool(study, progress, dead).run(configs):
            echo(f"runner: {first_line(error)}", err=True)


def _device_env(setup: TrialSetup, extra: tuple[str, ...], plans: Sequence[Plan]) -> dict[str, str]:
    """The device view a warm worker keeps for all its trials (``CUDA_VISIBLE_DEVICES`` of its GPU or the spec's)."""
    if not extra:
        return dict(plans[0].devices.env) if plans else {}
    loaded = without_sweep(load_spec(setup.path, [*setup.overrides, *extra], setup.unset))
    return dict(make_plan(loaded, env=setup.environ).devices.env)


def _run_to_the_end(report: SweepReport, study: SweepStudy, store: SweepStore, run: Callable[[], None]) -> None:
    """Run the trials; on a signal or error, end the parent first when no other worker runs trials."""

    def settle(status: str, error: str) -> None:
        report.trials = study.results()
        if not study.counts().get("RUNNING", 0):
            try:
                store.end(report.parent_run_id, status, error, report)
            except Exception as exc:  # a tracking failure must not hide the error on its way up
                echo(f"runner: could not end sweep run {report.parent_run_id} with status {status}: {exc}", err=True)

    try:
        with sigterm_interrupts():
            run()
    except (Interrupted, KeyboardInterrupt) as exc:
        settle("KILLED", "the sweep was interrupted")
        raise Interrupted(
            getattr(exc, "signum", 2),
            command=continue_command(),
            checkpoint="the sweep stopped: its finished trials are kept and its running ones run again",
        ) from None
    except BaseException:
        settle("FAILED", traceback.format_exc())
        raise


def _finish(report: SweepReport, study: SweepStudy, store: SweepStore, since: float) -> None:
    """End the parent once no trial waits or runs anywhere: FINISHED, or FAILED if one did not (module note)."""
    counts = study.counts()
    pending = counts.get("WAITING", 0) + counts.get("RUNNING", 0)
    report.trials = study.results(since=since)
    metric = report.definition.metric
    if report.best is None and any(t.status == "FINISHED" for t in report.trials):
        report.notes.append(
            f"no finished trial logged the metric {metric!r}: pass --metric NAME (e.g. val/loss --mode min)"
        )
    silent = study.silent_for() if pending and not counts.get("WAITING") else []
    if silent and min(silent) > 3 * HEARTBEAT_S:  # no live worker beats for them: theirs are likely gone
        wait = max(0.0, GRACE_S - min(silent))
        at = time.strftime("%H:%M:%S", time.localtime(time.time() + wait))
        raise RunnerError(
            f"the sweep is unfinished: {len(silent)} trial(s) are RUNNING with no heartbeat for "
            f"{min(silent):.0f} s or more, so their workers are likely gone; they can be taken over {GRACE_S} s "
            f"after their last heartbeat, at {at}: run `{continue_command()}` again then"
        )
    if pending:
        report.notes.append(
            f"{pending} trial(s) still waiting or running in other workers: the worker that ends the last one "
            "ends the parent run (run `runner sweep` again to help, or after a worker died)"
        )
        return
    failures = [f"{t.index}: {first_line(t.error or t.status)}" for t in report.trials if t.status != "FINISHED"]
    total = len(report.trials)
    error = f"{len(failures)} of {total} trials did not finish: " + "; ".join(failures) if failures else None
    with tempfile.TemporaryDirectory(prefix="runner-sweep-plots-") as tmp:
        plots, notes = write_plots(study.frozen_trials(), report.definition.goal, Path(tmp))
        report.notes += notes
        store.end(report.parent_run_id, "FAILED" if failures else "FINISHED", error, report, plots)


def continue_command(argv: Sequence[str] | None = None) -> str:
    """The command that continues the sweep: the same ``runner sweep ...`` (the study resumes where it stopped)."""
    args = list(sys.argv[1:] if argv is None else argv)
    return "runner " + shlex.join(args)

"""The sweep's Optuna study: who founds it, and the queue of trials every worker pulls from.

One study per sweep, in an Optuna RDB storage (docs/design.md §16). The first worker to
create it (Optuna's study names are unique in a storage, so exactly one succeeds) records the
definition, creates the MLflow parent run (with ``start_run``, as bench, parity and ``runner exec``
create theirs: the spec, its provenance and the plan, then the sweep's params and ``sweep.json``)
and enqueues the sweep's trials as WAITING trials:
the grid's points with their values, or empty slots the sampler fills when a trial starts.
Every worker then pulls the next WAITING trial; one conditional update moves a trial from
WAITING to RUNNING for one caller only (§16), so no trial runs twice and the sweep has exactly
``trials`` trials whatever the number of workers. A trial interrupted by a signal, or whose worker died
(its heartbeat stopped), is put back as a new WAITING copy that keeps the number it had.
The storage, the sampler and the pruner are built here too (``open_storage``, ``make_sampler``,
``make_pruner``).
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import json
import math
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import optuna
from optuna.trial import TrialState

from runner.errors import UsageError, mask_secrets
from runner.tools.sweep_space import SweepDefinition, Trial, TrialResult, decode_choice
from runner.tracking.uri import local_store_path

if TYPE_CHECKING:
    from optuna.pruners import BasePruner
    from optuna.samplers import BaseSampler
    from optuna.storages import RDBStorage
    from optuna.trial import FrozenTrial

READY_TIMEOUT_S = 120.0  # how long a joining worker waits for the founder to enqueue the trials

ATTR_DEFINITION = "runner.definition"
ATTR_SPEC_SHA = "runner.spec_sha256"
ATTR_PARENT = "runner.parent_run_id"
ATTR_READY = "runner.ready"
ATTR_RESULT = "runner.result"  # on a trial: its run, status, error, metric


class SweepStudy:
    """The sweep's study in its storage, and the trials in it."""

    def __init__(self, study: optuna.Study, storage: RDBStorage, url: str, definition: SweepDefinition):
        self.study = study
        self.storage = storage
        self.url = url
        self.definition = definition
        self.study_id = storage.get_study_id_from_name(study.study_name)

    @property
    def name(self) -> str:
        return str(self.study.study_name)

    @classmethod
    def join(cls, storage: RDBStorage, url: str, name: str, definition: SweepDefinition) -> SweepStudy:
        """The existing study ``name`` (a warm worker's view of the study its ``runner sweep`` opened)."""

        study = optuna.load_study(
            study_name=name, storage=storage, sampler=make_sampler(definition), pruner=make_pruner(definition)
        )
        return cls(study, storage, url, definition)

    @classmethod
    def open(
        cls,
        storage: RDBStorage,
        url: str,
        name: str,
        definition: SweepDefinition,
        *,
        found: Callable[[SweepStudy], str],
        spec_sha256: str,
        unfound: Callable[[str], None] | None = None,
    ) -> tuple[SweepStudy, bool]:
        """``(study, founded)``: create the study and its trials, or join the one another worker made (same definition).

        The founder calls ``found`` once (it makes the parent run and returns its id) and records ``spec_sha256``;
        ``unfound`` removes that run when the set-up fails after it. Raises UsageError: The study exists with another
        definition, or its founder never finished setting it up. StorageError: The storage refuses a request."""

        sampler, pruner = make_sampler(definition), make_pruner(definition)
        direction: Literal["maximize", "minimize"] = "maximize" if definition.goal == "max" else "minimize"
        try:
            study = optuna.create_study(
                storage=storage, study_name=name, sampler=sampler, pruner=pruner, direction=direction
            )
        except optuna.exceptions.DuplicatedStudyError:
            loaded = optuna.load_study(study_name=name, storage=storage, sampler=sampler, pruner=pruner)
            joined = cls(loaded, storage, url, definition)
            joined._wait_until_ready()
            return joined, False
        except Exception as exc:
            raise StorageError(f"cannot create study {name!r} in {url}: {type(exc).__name__}: {exc}") from exc
        made = cls(study, storage, url, definition)
        try:
            made._found(found, spec_sha256, unfound)
        except BaseException:
            with contextlib.suppress(Exception):
                optuna.delete_study(study_name=name, storage=storage)  # nothing half-written is left
            raise
        return made, True

    def _found(
        self, found: Callable[[SweepStudy], str], spec_sha256: str, unfound: Callable[[str], None] | None
    ) -> None:
        """Record the definition, create the parent run, enqueue the trials, then mark the study ready."""
        study = self.study
        study.set_user_attr(ATTR_DEFINITION, self.definition.to_json())
        study.set_user_attr(ATTR_SPEC_SHA, spec_sha256)
        parent = found(self)
        try:
            study.set_user_attr(ATTR_PARENT, parent)
            self._enqueue()
            study.set_user_attr(ATTR_READY, True)
        except BaseException:
            if unfound is not None:
                with contextlib.suppress(Exception):
                    unfound(parent)
            raise

    def _enqueue(self) -> None:
        """The sweep's trials, WAITING: the grid's points in order, or empty slots the sampler fills."""
        study = self.study
        if self.definition.method == "grid":
            space = self.definition.search_space()
            keys = list(space)
            params = self.definition.params
            for point in self.definition.grid_points():
                study.enqueue_trial({k: space[k][(params[k].values or []).index(point[k])] for k in keys})
        else:
            for _ in range(self.definition.trials):
                study.enqueue_trial({})

    def _wait_until_ready(self, timeout_s: float = READY_TIMEOUT_S) -> None:
        """Wait for the founder, then check the study searches what this worker would (UsageError otherwise)."""
        deadline, pause = time.monotonic() + timeout_s, 0.05
        while not self.storage.get_study_user_attrs(self.study_id).get(ATTR_READY):
            if time.monotonic() > deadline:
                raise UsageError(
                    f"study {self.name!r} in {self.url} was created but never set up (its first worker "
                    f"died?): delete it with `optuna delete-study --study-name {self.name} --storage URL`"
                )
            time.sleep(pause)
            pause = min(1.0, pause * 2)
        recorded = self.storage.get_study_user_attrs(self.study_id).get(ATTR_DEFINITION)
        if recorded is not None and SweepDefinition.model_validate(recorded).digest() != self.definition.digest():
            raise UsageError(
                f"study {self.name!r} in {self.url} searches another sweep ({json.dumps(recorded)}); "
                "give the same [sweep] and flags as its first worker, or another --study name"
            )

    @property
    def parent_run_id(self) -> str:
        """The MLflow parent run of the sweep."""
        return str(self.storage.get_study_user_attrs(self.study_id)[ATTR_PARENT])

    @property
    def spec_sha256(self) -> str | None:
        """Hash of the trial spec the study was created with."""
        value = self.storage.get_study_user_attrs(self.study_id).get(ATTR_SPEC_SHA)
        return None if value is None else str(value)

    def next_trial(self) -> optuna.Trial | None:
        """The next WAITING trial or ``None``, taken in one conditional UPDATE (docs/design.md §16)."""
        from optuna.storages._rdb.models import TrialModel as T

        # Listed through the study (not the raw storage): Optuna's cache of the study then knows the trials.
        for frozen in self.study.get_trials(deepcopy=False, states=(TrialState.WAITING,)):
            trial_id = self.trial_id(frozen.number)
            with self.storage.scoped_session() as session, session.begin():
                waiting = session.query(T).filter(T.trial_id == trial_id, T.state == TrialState.WAITING)
                if waiting.update({T.state: TrialState.RUNNING}, synchronize_session=False) != 1:
                    continue
                session.get(T, trial_id).datetime_start = datetime.now()  # type: ignore[union-attr]
            self.storage.record_heartbeat(trial_id)
            return optuna.Trial(self.study, trial_id)
        return None

    def trial_id(self, number: int) -> int:
        """The storage's id of trial ``number`` of this study."""
        return int(self.storage.get_trial_id_from_study_id_trial_number(self.study_id, number))

    @contextlib.contextmanager
    def heartbeat(self, trial: optuna.Trial) -> Iterator[None]:
        """Record the trial's heartbeat every :data:`HEARTBEAT_S` seconds while the block runs."""
        stop, trial_id = threading.Event(), self.trial_id(trial.number)

        def beat() -> None:
            while not stop.wait(HEARTBEAT_S):
                with contextlib.suppress(Exception):
                    self.storage.record_heartbeat(trial_id)

        thread = threading.Thread(target=beat, name="runner-sweep-heartbeat", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join(timeout=5)

    def values_of(self, trial: optuna.Trial) -> Trial:
        """The trial's values, asked of Optuna (fixed for a grid point or a trial run again), recorded on it."""
        self.study.sampler = make_sampler(self.definition, trial.number)  # the sampler Optuna's suggest_* ask
        values = self.definition.suggest(trial)
        frozen = self.storage.get_trial(self.trial_id(trial.number))
        trial.set_user_attr("runner.values", json.dumps(values, default=str))
        return Trial(index_of(frozen), values)

    def tell(self, trial: optuna.Trial, result: TrialResult) -> bool:
        """Record a finished trial: COMPLETE with its metric, PRUNED, or FAIL (a KILLED one is enqueued again).
        False when another worker had taken it over (its heartbeat stopped): the result is not recorded."""
        from optuna.exceptions import UpdateFinishedTrialError
        from optuna.storages import RetryHeartbeatStaleTrialCallback

        value = result.metric_value
        try:
            trial.set_user_attr(ATTR_RESULT, _recorded(result))  # one write: each is a database transaction
            if result.status == "FINISHED" and result.pruned:
                self.study.tell(trial, state=TrialState.PRUNED)
            elif result.status == "FINISHED" and value is not None and math.isfinite(value):
                self.study.tell(trial, value)
            elif result.status == "KILLED":
                RetryHeartbeatStaleTrialCallback()(self.study, self.study.tell(trial, state=TrialState.FAIL))
            else:
                self.study.tell(trial, state=TrialState.FAIL)
        except UpdateFinishedTrialError:
            return False
        return True

    def fail_dead(self, number: int, error: str) -> bool:
        """Fail trial ``number`` whose worker died; False when it had already finished and its result stands."""

        trial_id = self.trial_id(number)
        if self.storage.get_trial(trial_id).state.is_finished():
            return False
        dead = TrialResult(number, {}, None, "FAILED", None, error)
        self.storage.set_trial_user_attr(trial_id, ATTR_RESULT, _recorded(dead))
        self.study.tell(number, state=TrialState.FAIL, skip_if_finished=True)
        return True

    def fail_stale(self) -> list[int]:
        """Fail and enqueue again the RUNNING trials without heartbeats; return their numbers (their runs end
        KILLED)."""
        from optuna.storages import fail_stale_trials

        running = {t.number for t in self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))}
        if not running:
            return []
        fail_stale_trials(self.study)
        failed = self.study.get_trials(deepcopy=False, states=(TrialState.FAIL,))
        return sorted(t.number for t in failed if t.number in running)

    def silent_for(self) -> list[float]:
        """Seconds since each RUNNING trial's last heartbeat, by the database's clock as Optuna reads it (0: none
        yet)."""
        import sqlalchemy
        from optuna.storages._rdb import models

        session = self.storage.scoped_session()
        try:
            clock = session.execute(sqlalchemy.func.now()).scalar()
            assert clock is not None  # the database's clock
            now = clock.replace(tzinfo=None)
            running = (
                session.query(models.TrialModel)
                .filter(models.TrialModel.state == TrialState.RUNNING, models.TrialModel.study_id == self.study_id)
                .all()
            )
            return [(now - t.heartbeats[0].heartbeat).total_seconds() if t.heartbeats else 0.0 for t in running]
        finally:
            session.close()

    def counts(self) -> dict[str, int]:
        """Trials by Optuna state name (``WAITING``, ``RUNNING``, ``COMPLETE``, ``PRUNED``, ``FAIL``)."""
        trials = self.storage.get_all_trials(self.study_id, deepcopy=False)
        return dict(collections.Counter(t.state.name for t in trials))

    def results(self, since: float | None = None) -> list[TrialResult]:
        """One result per trial number, from its latest attempt; trials that ended before ``since`` are ``reused``."""
        latest: dict[int, FrozenTrial] = {}
        for frozen in self.storage.get_all_trials(self.study_id, deepcopy=False):
            index = index_of(frozen)
            if index not in latest or frozen.number > latest[index].number:
                latest[index] = frozen
        return [_result(self.definition, latest[i], since) for i in sorted(latest)]

    def frozen_trials(self) -> list[FrozenTrial]:
        """Every trial of the study (for Optuna's plots)."""
        return list(self.storage.get_all_trials(self.study_id, deepcopy=False))


def index_of(frozen: FrozenTrial) -> int:
    """The trial's number; a trial run again keeps the number of the first attempt (``failed_trial``)."""
    return int(frozen.system_attrs.get("failed_trial", frozen.number))


def _recorded(result: TrialResult) -> dict[str, Any]:
    """What a worker records on a finished trial (user attr ``runner.result``) besides Optuna's state and value."""
    return {
        "status": result.status,
        "run_id": result.run_id,
        "error": mask_secrets(result.error or "")[:2000] or None,  # the Optuna storage is a sink
        "metric": result.metric_value,
        "pruned_epoch": result.pruned_epoch,
    }


def _result(definition: SweepDefinition, frozen: FrozenTrial, since: float | None) -> TrialResult:
    """A :class:`TrialResult` from a trial's state and what the worker recorded on it."""
    attrs = frozen.user_attrs.get(ATTR_RESULT) or {}
    values = _recorded_values(definition, frozen)
    state = frozen.state.name
    done = frozen.datetime_complete
    reused = since is not None and done is not None and done.timestamp() < since
    if state in ("WAITING", "RUNNING"):
        return TrialResult(index_of(frozen), values, None, state)
    metric = attrs.get("metric")
    if state == "COMPLETE" and frozen.value is not None:
        metric = float(frozen.value)
    status, value = str(attrs.get("status") or "FAILED"), None if metric is None else float(metric)
    return TrialResult(index=index_of(frozen), values=values, run_id=attrs.get("run_id"), status=status,
                       metric_value=value, error=attrs.get("error"), reused=reused, pruned=state == "PRUNED",
                       pruned_epoch=attrs.get("pruned_epoch"))  # fmt: skip


def _recorded_values(definition: SweepDefinition, frozen: FrozenTrial) -> dict[str, Any]:
    """The values a worker recorded on the trial, else those Optuna holds (a grid point not run yet)."""
    text = frozen.user_attrs.get("runner.values")
    if text:
        return dict(json.loads(text))
    given = {**frozen.system_attrs.get("fixed_params", {}), **frozen.params}
    params = definition.params
    return {k: decode_choice(params[k].values or [], v) if k in params else v for k, v in given.items()}


HEARTBEAT_S = 10  # a running trial's worker writes a heartbeat this often (seconds)
GRACE_S = 60  # a running trial without a heartbeat for this long is failed and enqueued again
STORAGE_FILE = "optuna.db"


class StorageError(Exception):
    """The Optuna storage cannot be opened or used (the caller says where its URL came from)."""


def default_storage_url(tracking_uri: str, cwd: Path | None = None) -> str:
    """sqlite ``optuna.db`` beside a local MLflow store (an absolute URI), else in ``cwd``."""
    local = local_store_path(tracking_uri)
    folder = local[1].parent if local is not None else (cwd or Path.cwd()).resolve()
    return f"sqlite:///{folder / STORAGE_FILE}"


def open_storage(url: str, *, heartbeat: bool = True, attempts: int = 5) -> RDBStorage:
    """Open (creating on first use) the Optuna RDB storage at ``url``; sqlite waits 60 s for a lock.

    Workers creating a new storage's tables at once race, and the loser tries again (``attempts``). ``heartbeat`` fails
    trials whose worker went silent. Raises StorageError: malformed URL, driver missing, or refused.
    """
    from optuna.storages import RDBStorage, RetryHeartbeatStaleTrialCallback

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)  # heartbeats, retries
    engine_kwargs: dict[str, Any] = {"connect_args": {"timeout": 60}} if url.startswith("sqlite") else {}
    beat: dict[str, Any] = {}
    if heartbeat:
        beat = {
            "heartbeat_interval": HEARTBEAT_S,
            "grace_period": GRACE_S,
            "heartbeat_stale_trial_callback": RetryHeartbeatStaleTrialCallback(),
        }
    for attempt in range(attempts):
        try:
            return RDBStorage(url, engine_kwargs=engine_kwargs, **beat)
        except Exception as exc:
            racing = any(word in str(exc).lower() for word in ("already exists", "unique", "duplicate"))
            if racing and attempt + 1 < attempts:
                time.sleep(0.2 * (attempt + 1))
                continue
            raise StorageError(f"cannot open Optuna storage {url}: {type(exc).__name__}: {exc}") from None
    raise StorageError(f"cannot open Optuna storage {url}")  # pragma: no cover


def make_sampler(definition: SweepDefinition, trial_number: int | None = None) -> BaseSampler:
    """Optuna's grid, random or TPE sampler, seeded from ``definition.seed`` and ``trial_number`` so a trial draws
    the same values in any worker."""
    from optuna.samplers import GridSampler, RandomSampler, TPESampler

    seed = definition.seed
    if trial_number is not None:
        seed = int(hashlib.sha256(f"{seed}:{trial_number}".encode()).hexdigest()[:8], 16)
    if definition.method == "grid":

        class EnqueuedGrid(GridSampler):
            """GridSampler whose end-of-trial bookkeeping skips enqueued points, as every grid trial is: they carry no
            ``grid_id``, which Optuna's ``after_trial`` read at the end of a one-point grid (``KeyError``)."""

            def after_trial(self, study: Any, trial: Any, state: Any, values: Any) -> None:
                if "grid_id" in trial.system_attrs:
                    super().after_trial(study, trial, state, values)

        return EnqueuedGrid(definition.search_space(), seed=definition.seed)
    if definition.method == "random":
        return RandomSampler(seed=seed)
    return TPESampler(seed=seed)


def make_pruner(definition: SweepDefinition) -> BasePruner:
    """Optuna's NopPruner, MedianPruner or HyperbandPruner for ``definition.pruner``; steps are epochs."""
    from optuna.pruners import HyperbandPruner, MedianPruner, NopPruner

    if definition.pruner == "median":
        return MedianPruner(
            n_startup_trials=definition.pruner_startup_trials, n_warmup_steps=definition.pruner_warmup_epochs
        )
    if definition.pruner == "hyperband":
        return HyperbandPruner(min_resource=max(1, definition.pruner_warmup_epochs))
    return NopPruner()

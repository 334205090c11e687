"""The sweep's Optuna storage, sampler and pruner: where the study lives and how it searches and prunes.

The storage is an Optuna RDB storage (SQLAlchemy URL): sqlite for one machine, a database
server such as PostgreSQL for workers on several machines (Optuna's docs, "Easy
Parallelization"; docs/design.md §16). Heartbeats let a worker fail, and enqueue again, a
trial whose own worker died.
"""

from __future__ import annotations

import hashlib
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from runner.errors import mask_secrets
from runner.tools.sweep_space import SweepDefinition

if TYPE_CHECKING:
    from optuna.pruners import BasePruner
    from optuna.samplers import BaseSampler
    from optuna.storages import RDBStorage

HEARTBEAT_S = 10  # a running trial's worker writes a heartbeat this often (seconds)
GRACE_S = 60  # a running trial without a heartbeat for this long is failed and enqueued again
STORAGE_FILE = "optuna.db"


class StorageError(Exception):
    """The Optuna storage cannot be opened or used (the caller says where its URL came from)."""


def default_storage_url(tracking_uri: str, cwd: Path | None = None) -> str:
    """sqlite ``optuna.db`` next to a local MLflow store, else in ``cwd`` (default: the current folder).

    Args:
        tracking_uri: The absolute MLflow tracking URI of the sweep.
        cwd: Folder for stores that are not local files (a tracking server).
    """
    if tracking_uri.startswith("sqlite:///"):
        path = Path(tracking_uri[len("sqlite:///") :].partition("?")[0])
        if path.is_absolute():
            return f"sqlite:///{path.parent / STORAGE_FILE}"
    parts = urlsplit(tracking_uri)
    if parts.scheme == "file" and not parts.netloc:
        return f"sqlite:///{Path(parts.path).parent / STORAGE_FILE}"
    if len(parts.scheme) <= 1 and tracking_uri.startswith("/"):
        return f"sqlite:///{Path(tracking_uri).parent / STORAGE_FILE}"
    return f"sqlite:///{(cwd or Path.cwd()).resolve() / STORAGE_FILE}"


def open_storage(url: str, *, heartbeat: bool = True, attempts: int = 5) -> RDBStorage:
    """Open (and on first use create) the Optuna RDB storage at ``url``.

    sqlite waits up to 60 s for a lock held by another worker. Workers that create the tables
    of a new storage at the same moment race; the loser tries again.

    Args:
        url: An SQLAlchemy URL, e.g. ``sqlite:////abs/optuna.db`` or ``postgresql+psycopg://u@h/db``.
        heartbeat: Record heartbeats and fail trials whose worker stopped sending them (workers);
            ``False`` for processes that only report intermediate values.
        attempts: Tries before giving up on a table-creation race.

    Raises:
        StorageError: The URL is malformed, its driver is not installed, or the database refuses.
    """
    import optuna
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
            raise StorageError(f"cannot open Optuna storage {mask_secrets(url)}: {type(exc).__name__}: {exc}") from None
    raise StorageError(f"cannot open Optuna storage {mask_secrets(url)}")  # pragma: no cover


def make_sampler(definition: SweepDefinition, trial_number: int | None = None) -> BaseSampler:
    """Optuna's GridSampler, RandomSampler or TPESampler for ``definition.method``.

    Args:
        definition: The sweep (method, search space, seed).
        trial_number: Seed the sampler for this trial: from ``definition.seed`` and the trial's
            number, so a trial draws the same values in whichever worker runs it, and two
            workers never draw the same sequence. ``None``: seeded with ``definition.seed``.
    """
    from optuna.samplers import GridSampler, RandomSampler, TPESampler

    seed = definition.seed if trial_number is None else _trial_seed(definition.seed, trial_number)
    if definition.method == "grid":

        class EnqueuedGrid(GridSampler):
            """GridSampler whose end-of-trial bookkeeping skips the enqueued points (every grid trial is one).

            A trial made by ``enqueue_trial`` gets its values as fixed params and no ``grid_id``; Optuna's
            ``GridSampler.after_trial`` reads that attribute once a single grid point is left unvisited,
            which raised ``KeyError: 'grid_id'`` at the end of a one-point grid.
            """

            def after_trial(self, study: Any, trial: Any, state: Any, values: Any) -> None:
                if "grid_id" in trial.system_attrs:
                    super().after_trial(study, trial, state, values)

        return EnqueuedGrid(definition.search_space(), seed=definition.seed)
    if definition.method == "random":
        return RandomSampler(seed=seed)
    return TPESampler(seed=seed)


def _trial_seed(seed: int, number: int) -> int:
    return int(hashlib.sha256(f"{seed}:{number}".encode()).hexdigest()[:8], 16)


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

"""Opening the tracking store: the first open of a sqlite store, which creates or migrates its schema, is locked.

MLflow's ``SqlAlchemyStore`` creates the tables of a new database and runs its alembic migrations
when it is first opened. Two processes doing that at once on one sqlite file interleave their
migrations and leave the store half-migrated for good (even ``MlflowClient`` cannot open it
afterwards). :func:`open_store` serialises that first open across processes with a
:class:`filelock.FileLock` beside the database (``<database>.lock``), and refuses, with the fix, a
store that an earlier crash or race left half-migrated, without touching it. Another MLflow client
(``mlflow ui``, a notebook) does not take that lock: when it creates the tables at the same moment,
MLflow's ``CREATE TABLE`` fails with "already exists"; the open is tried again with backoff, and
the schema it finds is then checked (:func:`refuse_half_migrated`), never reported as an SQL dump.
mlflow is imported inside functions.
"""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

from runner.errors import TrackingError
from runner.tracking.uri import check_reachable, sqlite_path

LOCK_TIMEOUT_S = 300.0  # a first migration takes seconds; a lock held longer is a stuck process
OPEN_ATTEMPTS = 6  # a concurrent creator's migration takes seconds: 0.5 + 1 + 2 + 4 + 8 s of waiting
_opened: set[str] = set()  # URIs opened by this process (MLflow keeps the engine; tables exist from then on)


def open_store(uri: str) -> None:
    """Check the store at ``uri`` and open it once in this process, creating or migrating a sqlite schema safely.

    Every process that uses a store calls this before its first MLflow request: the driver
    before it creates the run, the sweep and bench before their parent runs, ``runner status``.

    Args:
        uri: An absolute tracking URI (from :func:`runner.tracking.uri.resolve_tracking_uri`).

    Raises:
        TrackingError: The store is unreachable or not writable (:func:`~runner.tracking.uri.check_reachable`),
            another process holds the lock for more than :data:`LOCK_TIMEOUT_S` seconds, the sqlite store
            is half-migrated (the message says how to recover), or MLflow refuses to open it.
    """
    check_reachable(uri)
    if uri in _opened:
        return
    path = sqlite_path(uri)
    if path is not None:
        from filelock import FileLock, Timeout

        lock = FileLock(f"{path}.lock", timeout=LOCK_TIMEOUT_S)
        try:
            with lock:
                refuse_half_migrated(path)
                _first_open(uri)
                refuse_half_migrated(path)  # what a concurrent creator left must be a whole schema
        except Timeout:
            raise TrackingError(
                f"tracking store {uri}: another process has held {lock.lock_file} for over {LOCK_TIMEOUT_S:.0f} s "
                "while creating the store; stop it, or remove the lock file if no runner or mlflow process is left"
            ) from None
    _opened.add(uri)


def _first_open(uri: str) -> None:
    """Open the store with MLflow (which creates or upgrades its schema); MLflow's refusal becomes a TrackingError.

    A schema being created by another client at the same moment ("already exists", "database is
    locked") is waited for: up to :data:`OPEN_ATTEMPTS` tries with doubling pauses.
    """
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    for attempt in range(OPEN_ATTEMPTS):
        try:
            MlflowClient(tracking_uri=uri).search_experiments(max_results=1)
            return
        except Exception as exc:  # MlflowException, sqlalchemy / alembic errors of a damaged database
            text = exc.message if isinstance(exc, MlflowException) else f"{type(exc).__name__}: {exc}"
            racing = "already exists" in text or "database is locked" in text
            if not racing or attempt == OPEN_ATTEMPTS - 1:
                first = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
                raise TrackingError(f"MLflow cannot open the tracking store {uri}: {first[:500]}") from None
            time.sleep(0.5 * 2**attempt)


def refuse_half_migrated(path: Path) -> None:
    """Raise when the sqlite database at ``path`` was left between two schema versions; never changes it.

    Signs of a half-migrated MLflow store: alembic's temporary tables (``_alembic_tmp_*``, left
    when a batch migration stopped midway), or MLflow's tables without the ``alembic_version``
    row that records the schema. A missing or empty file is a new store and passes.

    Raises:
        TrackingError: The store is half-migrated; the message names what was found, how many
            runs the store holds and how to recover.
    """
    if not path.is_file() or path.stat().st_size == 0:
        return
    try:
        with sqlite3.connect(f"{path.as_uri()}?mode=ro", uri=True) as db:
            tables = {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
            version = _schema_version(db) if "alembic_version" in tables else None
            runs = db.execute("SELECT COUNT(*) FROM runs").fetchone()[0] if "runs" in tables else 0
    except sqlite3.DatabaseError as exc:
        raise TrackingError(f"tracking store {path}: not a readable sqlite database ({exc})") from None
    leftovers = sorted(t for t in tables if t.startswith("_alembic_tmp_"))
    if not leftovers and (version is not None or "experiments" not in tables):
        return
    found = f"alembic's temporary tables {', '.join(leftovers)}" if leftovers else "no schema version"
    if version is not None:
        found += f" at schema version {version}"
    fix = (
        f"it holds no run, so nothing is lost by starting afresh: move it away (mv {path} {path}.broken) and run again"
        if runs == 0
        else f"it holds {runs} run(s): restore it from a backup, or move it away (mv {path} {path}.broken) to start a "
        "new store and read the old one with sqlite3"
    )
    raise TrackingError(
        f"tracking store {path} was left half-migrated by an interrupted or concurrent first use ({found}): "
        f"MLflow cannot open it and runner leaves it as it is; {fix}"
    )


def _schema_version(db: sqlite3.Connection) -> str | None:
    row = db.execute("SELECT version_num FROM alembic_version").fetchone()
    return str(row[0]) if row else None

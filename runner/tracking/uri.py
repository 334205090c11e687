"""The tracking store: which URI a run logs to, whether it can be used before training, its first (locked) open.
Importing this module imports neither mlflow nor torch.

A store that cannot be reached or written must fail before training, not after an epoch: its URI is resolved
and checked once, in the driver, before any training process starts.
"""

from __future__ import annotations

import functools
import logging
import os
import sqlite3
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit, urlunsplit

from runner.errors import TrackingError, first_line
from runner.spec.rules import BARE_TRACKING_URIS, store_uri_problem

if TYPE_CHECKING:
    from mlflow.tracking import MlflowClient

    from runner.spec.schema import ExperimentSpec


_DATABASES = ("postgresql", "postgres", "mysql", "mssql")
_SERVER_HINT = (
    "start a server with `mlflow server --host 127.0.0.1 --port 5000 --backend-store-uri sqlite:///mlflow.db`, "
    "fix tracking.uri in the spec, or unset MLFLOW_TRACKING_URI to log to ./mlflow.db"
)


@functools.lru_cache(maxsize=32)
def client_for(uri: str) -> MlflowClient:
    """The process's one MLflow client of the store at ``uri``, through which runner reads and writes every run (a
    client holds no connection: MLflow keeps one store, with its pool, per URI). Errors map with ``store_errors``."""
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)


def _absolute_uri(uri: str, cwd: Path) -> str:
    """Resolve a relative sqlite path, ``file:`` URI or plain path against ``cwd``."""
    if uri in BARE_TRACKING_URIS:
        return uri
    if uri.startswith("sqlite:"):
        prefix = "sqlite:///"
        if not uri.startswith(prefix):
            return uri  # sqlite:// (in memory) or something MLflow will reject with its own message
        rest, sep, query = uri[len(prefix) :].partition("?")
        if not rest or rest.startswith(":memory:") or rest.startswith("/"):
            return uri
        return f"{prefix}{(cwd / rest).resolve()}{sep}{query}"
    parts = urlsplit(uri)
    if parts.scheme == "file":
        path = Path(parts.path)
        if parts.netloc or path.is_absolute():
            return uri
        return (cwd / path).resolve().as_uri()
    if len(parts.scheme) > 1:  # http, https, postgresql, databricks://profile, ...
        return uri
    return str((cwd / Path(uri).expanduser()).resolve())  # plain local path (a file store)


def resolve_tracking_uri(
    spec: ExperimentSpec, env: Mapping[str, str] | None = None, cwd: str | os.PathLike[str] | None = None
) -> str:
    """The absolute tracking URI a run of ``spec`` logs to: ``tracking.uri``, ``$MLFLOW_TRACKING_URI``, ``./mlflow.db``.

    A relative path is resolved against ``cwd`` once, so workers started elsewhere log to the same store. Raises
    TrackingError when ``MLFLOW_TRACKING_URI`` is no store.
    """
    return _resolve(spec.tracking.uri, env, cwd)


def default_tracking_uri(env: Mapping[str, str] | None = None, cwd: str | os.PathLike[str] | None = None) -> str:
    """Where ``resume``, ``reproduce``, ``diff`` and ``status`` look: ``$MLFLOW_TRACKING_URI``, else ``./mlflow.db``."""
    return _resolve(None, env, cwd)


def _resolve(given: str | None, env: Mapping[str, str] | None, cwd: str | os.PathLike[str] | None) -> str:
    env = os.environ if env is None else env
    base = Path.cwd() if cwd is None else Path(cwd)
    raw = (given or "").strip()
    if not raw:
        raw = env.get("MLFLOW_TRACKING_URI", "").strip()
        problem = store_uri_problem(raw) if raw else None
        if problem is not None:
            raise TrackingError(
                f"MLFLOW_TRACKING_URI={raw}: {problem} (set the variable to one, or unset it to log to ./mlflow.db)"
            )
    if not raw:
        return f"sqlite:///{(base / 'mlflow.db').resolve()}"
    return _absolute_uri(raw, base)


def absolute_uri(uri: str, cwd: str | os.PathLike[str] | None = None) -> str:
    """``uri`` with a relative sqlite path, ``file:`` URI or plain path resolved against ``cwd`` (default: here)."""
    return _absolute_uri(uri.strip(), Path.cwd() if cwd is None else Path(cwd))


def local_store_missing(uri: str) -> bool:
    """Whether ``uri`` names a local store that does not exist yet (reading it would create an empty one)."""
    local = local_store_path(uri)
    return local is not None and not local[1].exists()


def local_store_path(uri: str) -> tuple[str, Path] | None:
    """``("sqlite"|"file", path)`` for local stores, ``None`` for anything else."""
    if uri.startswith("sqlite:///"):
        rest = uri[len("sqlite:///") :].partition("?")[0]
        if not rest or rest.startswith(":memory:"):
            return None
        return "sqlite", Path(rest if rest.startswith("/") else os.path.abspath(rest))
    parts = urlsplit(uri)
    if parts.scheme == "file":
        from urllib.request import url2pathname

        return "file", Path(url2pathname(parts.path))
    if uri not in BARE_TRACKING_URIS and len(parts.scheme) <= 1:
        return "file", Path(uri).expanduser()
    return None


def sqlite_path(uri: str) -> Path | None:
    """The database file of a ``sqlite:///`` URI, or ``None`` for other stores (and in-memory sqlite)."""
    local = local_store_path(uri)
    return local[1] if local is not None and local[0] == "sqlite" else None


def checkpoint_root(tracking_uri: str | None, spec_dir: str | None) -> Path:
    """The absolute folder that holds each run's checkpoint folder (named by its run id): ``checkpoint.dir``, else
    ``checkpoints/`` beside a sqlite or file store, else in the working directory."""
    if spec_dir:
        return Path(spec_dir)
    local = local_store_path(tracking_uri) if tracking_uri else None
    return ((local[1].parent if local is not None else Path.cwd()) / "checkpoints").resolve()


def check_reachable(uri: str, timeout_s: float = 5.0) -> None:
    """Fail fast, before training, when the store cannot be used; nothing is written.

    http(s): ``GET /health``, then the REST API, no retries. sqlite and file stores: their folders are writable. Other
    databases: one SQLAlchemy connection within ``timeout_s``. Databricks is not checked. Raises TrackingError: No
    answer, not an MLflow server, credentials rejected, or not writable (URI masked when shown)."""
    scheme = urlsplit(uri).scheme
    if scheme in ("http", "https"):
        _check_http(uri, timeout_s)
        return
    if scheme.partition("+")[0] in _DATABASES:
        _check_database(uri, timeout_s)
        return
    local = local_store_path(uri)
    if local is None:
        return
    kind, path = local
    if kind == "sqlite":
        _check_sqlite(uri, path)
        return
    target = path if path.exists() else path.parent
    if not target.is_dir() or not os.access(target, os.W_OK | os.X_OK):
        raise TrackingError(f"tracking store {uri}: {target} is not a writable folder")


def _check_sqlite(uri: str, path: Path) -> None:
    """The database's folder exists and is writable (sqlite writes a journal beside it), the file too."""
    folder = path.parent
    if not folder.is_dir():
        raise TrackingError(
            f"tracking store {uri}: folder {folder} does not exist; create it (mkdir -p {folder}) "
            "or set tracking.uri / MLFLOW_TRACKING_URI to another location"
        )
    if not os.access(folder, os.W_OK | os.X_OK):
        raise TrackingError(
            f"tracking store {uri}: folder {folder} is not writable (sqlite writes a journal next to the database)"
        )
    if path.exists() and not os.access(path, os.R_OK | os.W_OK):
        raise TrackingError(f"tracking store {uri}: database {path} is not readable and writable by this user")


def _check_database(uri: str, timeout_s: float) -> None:
    """Connect once to a database store with SQLAlchemy; any failure is a :class:`TrackingError`."""
    from sqlalchemy import create_engine

    dialect = urlsplit(uri).scheme.partition("+")[0]
    args = {"connect_timeout": max(1, round(timeout_s))} if dialect in ("postgresql", "mysql") else {}
    try:
        engine = create_engine(uri, connect_args=args)
        try:
            with engine.connect():
                pass
        finally:
            engine.dispose()
    except Exception as exc:  # ArgumentError (malformed), NoSuchModuleError / ImportError (driver), OperationalError
        reason = first_line(exc)
        fix = (
            f"install the {dialect} driver, or name an installed one in the URI ({dialect}+DRIVER://...)"
            if isinstance(exc, ImportError) or type(exc).__name__ == "NoSuchModuleError"
            else "start the database server, or fix the URI"
        )
        raise TrackingError(f"cannot open the tracking store {uri} ({type(exc).__name__}: {reason}); {fix}") from None


def _check_http(uri: str, timeout_s: float) -> None:
    """``GET /health``, then the REST API, once each through MLflow's client (its credentials); 200 or TrackingError."""
    from mlflow.exceptions import MlflowException
    from mlflow.utils.credentials import get_default_host_creds
    from mlflow.utils.rest_utils import http_request

    creds = get_default_host_creds(uri.rstrip("/"))

    def get(endpoint: str, params: dict[str, int] | None = None) -> int:
        try:
            response = http_request(
                creds,
                endpoint,
                "GET",
                max_retries=0,
                backoff_factor=0,
                backoff_jitter=0,
                timeout=timeout_s,
                raise_on_status=False,
                params=params,
            )
        except MlflowException as exc:
            raise TrackingError(
                f"cannot reach the MLflow tracking server at {uri} ({exc.message}); {_SERVER_HINT}"
            ) from exc
        return int(response.status_code)

    health = get("/health")
    if health == 200:
        return
    api = get("/api/2.0/mlflow/experiments/search", {"max_results": 1})
    if api == 200:
        return
    if api in (401, 403):
        raise TrackingError(
            f"the MLflow tracking server at {uri} rejected the request (HTTP {api}): set "
            "MLFLOW_TRACKING_TOKEN, or MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD (or "
            "~/.mlflow/credentials), or the auth plugin of MLFLOW_TRACKING_AUTH"
        )
    raise TrackingError(
        f"{uri} answered HTTP {health} to GET /health and HTTP {api} to the MLflow REST API: it does "
        f"not look like an MLflow tracking server; {_SERVER_HINT}"
    )


LOCK_TIMEOUT_S = 300.0  # a first migration takes seconds; a lock held longer is a stuck process
OPEN_ATTEMPTS = 6  # a concurrent creator's migration takes seconds
# Errors of a store that another client is creating or migrating at the same moment: the open is tried again once the
# file is still. "dimension_attributes": MLflow's ORM reading a table whose migration has not added that column yet
# (`mlflow ui` beside a first `runner exec`, 1 in 6 tries).
RACE_SIGNS = (
    "already exists",
    "database is locked",
    "out-of-date database",
    "Online migration",
    "duplicate column",
    "dimension_attributes",
)
_opened: set[str] = set()  # URIs opened by this process (MLflow keeps the engine; tables exist from then on)


def open_store(uri: str) -> None:
    """Check the store and open it once in this process, creating or migrating a sqlite schema under a lock.

    Every process calls it before its first MLflow request. Raises TrackingError: unreachable or not writable, the lock
    held past :data:`LOCK_TIMEOUT_S`, a half-migrated sqlite store (with the fix), or MLflow's refusal.
    """
    if uri in _opened:
        return
    check_reachable(uri)
    path = sqlite_path(uri)
    if path is not None:
        from filelock import FileLock, Timeout

        lock = FileLock(f"{path}.lock", timeout=LOCK_TIMEOUT_S)
        try:
            with lock:  # other MLflow clients (`mlflow ui`, a notebook) do not take it: wait while they migrate
                if not _holds_a_schema(path):
                    _create_aside(uri, path)
                _open_whole(uri, path)
        except Timeout:
            raise TrackingError(
                f"tracking store {uri}: another process has held {lock.lock_file} for over {LOCK_TIMEOUT_S:.0f} s "
                "while creating the store; stop it, or remove the lock file if no runner or mlflow process is left"
            ) from None
    _opened.add(uri)


def _open_whole(uri: str, path: Path) -> None:
    """Open the sqlite store at ``path`` once it is a whole schema. A new store that other clients broke, racing each
    other or runner (two alembic migrations of one file), and that holds nothing is replaced by one made aside, before
    the open or after it: the second check is where `mlflow ui` beside a first `runner exec` left it, 1 try in 6."""
    for last in (False, True):
        try:
            _refuse_half_migrated_when_still(path)
            _first_open(uri, path)
            _refuse_half_migrated_when_still(path)  # what a concurrent creator left must be a whole schema
            return
        except TrackingError:
            if last or not _holds_nothing(path):
                raise
            _create_aside(uri, path, replace=True)


def _holds_a_schema(path: Path) -> bool:
    """Whether the sqlite file at ``path`` exists and has MLflow's tables (whole or not)."""
    if not path.is_file() or path.stat().st_size == 0:
        return False
    try:
        with sqlite3.connect(f"{path.as_uri()}?mode=ro", uri=True) as db:
            return db.execute("SELECT COUNT(*) FROM sqlite_master WHERE name = 'experiments'").fetchone()[0] > 0
    except sqlite3.DatabaseError:
        return True  # not ours to judge here: refuse_half_migrated names what is wrong with it


def _create_aside(uri: str, path: Path, replace: bool = False) -> None:
    """Make and migrate a new store beside ``path``, then link it into place; a file that appeared is kept (§12)."""
    aside = path.with_name(f".{path.name}.{os.getpid()}-{time.monotonic_ns()}.creating")  # MLflow caches a URI's engine
    query = uri.partition("?")[2]
    try:
        _first_open(f"sqlite:///{aside}" + (f"?{query}" if query else ""))
        try:
            if not replace:
                os.link(aside, path)  # never over a file that appeared meanwhile: FileExistsError
        except FileExistsError:  # the client that made it may be migrating it (seconds); one in use is never still
            wait_until_still(path, timeout_s=30.0)
        except OSError:  # a file system without hard links: the same, but for a tiny window
            replace = not path.exists()
        if replace:
            os.replace(aside, path)
    finally:
        aside.unlink(missing_ok=True)


def _holds_nothing(path: Path) -> bool:
    """Whether ``path`` is missing, empty, or an MLflow store with no run, model or experiment of its own."""
    if not path.is_file() or path.stat().st_size == 0:
        return True
    counts = {"runs": 0, "registered_models": 0, "experiments": 1}  # the most each may hold; 1: "Default"
    try:
        with sqlite3.connect(f"{path.as_uri()}?mode=ro", uri=True) as db:
            tables = {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
            return all(
                db.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0] <= most
                for table, most in counts.items()
                if table in tables
            )
    except sqlite3.DatabaseError:
        return False  # not an MLflow store: never replaced


def _first_open(uri: str, path: Path | None = None) -> None:
    """Open the store with MLflow, waiting out a schema another client creates (:data:`OPEN_ATTEMPTS` tries)."""
    from mlflow.exceptions import MlflowException

    for name in ("mlflow.store.db.utils", "alembic"):  # "Creating initial MLflow database tables..." at INFO
        logging.getLogger(name).setLevel(logging.WARNING)
    for attempt in range(OPEN_ATTEMPTS):
        try:
            client_for(uri).search_experiments(max_results=1)
            return
        except Exception as exc:  # MlflowException, sqlalchemy / alembic errors of a damaged database
            text = exc.message if isinstance(exc, MlflowException) else f"{type(exc).__name__}: {exc}"
            if attempt == OPEN_ATTEMPTS - 1 or not any(sign in text for sign in RACE_SIGNS):
                first = first_line(text) or type(exc).__name__
                raise TrackingError(f"MLflow cannot open the tracking store {uri}: {first[:500]}") from None
            if path is None or not wait_until_still(path):
                time.sleep(0.5 * 2**attempt)


def _refuse_half_migrated_when_still(path: Path) -> None:
    """:func:`refuse_half_migrated`, judged again once a client that is migrating the file has finished."""
    try:
        refuse_half_migrated(path)
    except TrackingError:
        if not wait_until_still(path):
            raise
        refuse_half_migrated(path)


STILL_S = 2.0  # MLflow's schema migrations change the sqlite file many times a second while they run


def wait_until_still(path: Path, timeout_s: float = LOCK_TIMEOUT_S) -> bool:
    """Wait until the sqlite file (and journal) at ``path`` has not changed for :data:`STILL_S`; return whether it
    changed."""

    def signature() -> tuple[tuple[int, int], ...]:
        found = []
        for file in (path, path.with_name(path.name + "-journal"), path.with_name(path.name + "-wal")):
            try:
                info = file.stat()
                found.append((info.st_mtime_ns, info.st_size))
            except FileNotFoundError:
                found.append((0, -1))
        return tuple(found)

    start = last_change = time.monotonic()
    seen, changed = signature(), False
    while time.monotonic() - last_change < STILL_S and time.monotonic() - start < timeout_s:
        time.sleep(0.1)
        now = signature()
        if now != seen:
            seen, changed, last_change = now, True, time.monotonic()
    return changed


def refuse_half_migrated(path: Path) -> None:
    """Raise TrackingError (what was found, the runs held, the fix) for a sqlite store left between schema versions.

    Signs: ``_alembic_tmp_*`` tables, or MLflow's tables without the ``alembic_version`` row. Never changes the file.
    """
    if not path.is_file() or path.stat().st_size == 0:
        return
    try:
        with sqlite3.connect(f"{path.as_uri()}?mode=ro", uri=True) as db:
            tables = {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
            version = None
            if "alembic_version" in tables:
                row = db.execute("SELECT version_num FROM alembic_version").fetchone()
                version = str(row[0]) if row else None
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


LOCAL_UI = "http://127.0.0.1:5000"  # where `mlflow ui` serves a local store by default
TRAINING_VIEW = "workflowType=machine_learning"


def ui_line(uri: str, experiment_id: str, run_id: str | None = None, what: str = "the run") -> str:
    """How to open a run or experiment in the MLflow UI's training view (``?workflowType=machine_learning``); a link
    to a server has no credentials, a local store needs ``mlflow ui`` first (its URI masked at the sinks)."""
    parts = urlsplit(uri)
    served = parts.scheme in ("http", "https")
    base = urlunsplit((parts.scheme, parts.netloc.rpartition("@")[2], parts.path, "", "")) if served else LOCAL_UI
    route = f"#/experiments/{experiment_id}/runs" + (f"/{run_id}" if run_id else "")
    link = f"{base.rstrip('/')}/{route}?{TRAINING_VIEW}"
    if served:
        return f"open {what}: {link}"
    return f"open {what}: mlflow ui --backend-store-uri {uri}, then {link}"

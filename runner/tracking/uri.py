"""The tracking store: which URI a run logs to, and whether that store can be used before training starts.

Importing this module imports neither mlflow nor torch; the HTTP check imports MLflow's REST
client helpers inside the function that needs them.

Also: opening the tracking store: the first open of a sqlite store, which creates or migrates its schema, is locked.
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

from runner.errors import TrackingError, first_line, mask_secrets
from runner.spec.rules import store_uri_problem

if TYPE_CHECKING:
    from mlflow.tracking import MlflowClient

    from runner.spec.schema import ExperimentSpec


_BARE_URIS = ("databricks", "databricks-uc", "uc")
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
    if uri in _BARE_URIS:
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
    """Return the tracking URI a run of ``spec`` logs to.

    Precedence: ``spec.tracking.uri``, then ``$MLFLOW_TRACKING_URI``, then
    ``sqlite:///<cwd>/mlflow.db``. A relative sqlite path, relative ``file:`` URI or plain
    path is resolved once against ``cwd`` (MLflow's own convention), so worker processes
    started elsewhere log to the same store.

    Returns:
        An absolute tracking URI, e.g. ``sqlite:////home/me/proj/mlflow.db``.

    Raises:
        TrackingError: ``MLFLOW_TRACKING_URI`` is no store (:func:`runner.spec.rules.store_uri_problem`).
    """
    return _resolve(spec.tracking.uri, env, cwd)


def default_tracking_uri(env: Mapping[str, str] | None = None, cwd: str | os.PathLike[str] | None = None) -> str:
    """The tracking URI of a spec without ``tracking.uri``: ``$MLFLOW_TRACKING_URI``, else ``./mlflow.db``.

    It is where ``runner resume``, ``reproduce``, ``diff`` and ``status`` look for a run id without
    ``--tracking-uri``.

    Raises:
        TrackingError: ``MLFLOW_TRACKING_URI`` is no store.
    """
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
                f"MLFLOW_TRACKING_URI={mask_secrets(raw)}: {problem} (set the variable to one, or unset it to log "
                "to ./mlflow.db)"
            )
    if not raw:
        return f"sqlite:///{(base / 'mlflow.db').resolve()}"
    return _absolute_uri(raw, base)


def absolute_uri(uri: str, cwd: str | os.PathLike[str] | None = None) -> str:
    """``uri`` with a relative sqlite path, ``file:`` URI or plain path resolved against ``cwd`` (default: here)."""
    return _absolute_uri(uri.strip(), Path.cwd() if cwd is None else Path(cwd))


def local_store_missing(uri: str) -> bool:
    """Whether ``uri`` names a local store (sqlite file or file store) that does not exist yet.

    Reading a run from such a store would only create an empty one; callers say "no such run" instead.
    """
    local = _local_store_path(uri)
    return local is not None and not local[1].exists()


def _local_store_path(uri: str) -> tuple[str, Path] | None:
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
    if uri not in _BARE_URIS and len(parts.scheme) <= 1:
        return "file", Path(uri).expanduser()
    return None


def sqlite_path(uri: str) -> Path | None:
    """The database file of a ``sqlite:///`` URI, or ``None`` for other stores (and in-memory sqlite)."""
    local = _local_store_path(uri)
    return local[1] if local is not None and local[0] == "sqlite" else None


def check_reachable(uri: str, timeout_s: float = 5.0) -> None:
    """Fail fast, before any training, when the tracking store cannot be used.

    http(s): ``GET <uri>/health`` (falling back to the REST experiments-search endpoint),
    with no retries. sqlite: the database's folder exists and is writable (and the file,
    if it exists, too). Local file store: the folder, or its parent, is writable. Another
    database (postgresql, mysql, mssql): one connection within ``timeout_s``, made by
    SQLAlchemy as MLflow makes it (a malformed URL, a missing driver and a server that does
    not answer all fail here). Databricks is not checked. Nothing is written.

    Args:
        uri: An absolute tracking URI, e.g. from :func:`resolve_tracking_uri`.
        timeout_s: Seconds to wait for the server to answer each request.

    Raises:
        TrackingError: The server does not answer, answers like something other than an
            MLflow server, rejects the credentials, or the local store is not writable; the
            message shows the URI with its credentials masked.
    """
    scheme = urlsplit(uri).scheme
    if scheme in ("http", "https"):
        _check_http(uri, timeout_s)
        return
    if scheme.partition("+")[0] in _DATABASES:
        _check_database(uri, timeout_s)
        return
    local = _local_store_path(uri)
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
        reason = mask_secrets(first_line(exc))
        fix = (
            f"install the {dialect} driver, or name an installed one in the URI ({dialect}+DRIVER://...)"
            if isinstance(exc, ImportError) or type(exc).__name__ == "NoSuchModuleError"
            else "start the database server, or fix the URI"
        )
        raise TrackingError(
            f"cannot open the tracking store {mask_secrets(uri)} ({type(exc).__name__}: {reason}); {fix}"
        ) from None


def _check_http(uri: str, timeout_s: float) -> None:
    """``GET /health``, then the REST API; any answer but 200 from both is a :class:`TrackingError`. The requests go
    through MLflow's own client (``mlflow.utils.rest_utils.http_request`` with the host credentials of
    ``mlflow.utils.credentials.get_default_host_creds``), so they carry what every MLflow request carries: token or
    basic auth from the environment or ``~/.mlflow/credentials``, ``MLFLOW_TRACKING_AUTH`` plugins, AWS SigV4, client
    certificates, the server certificate or ``MLFLOW_TRACKING_INSECURE_TLS``, and the request-header plugins. Nothing is
    retried: a server that does not answer fails the check at once."""
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
                f"cannot reach the MLflow tracking server at {mask_secrets(uri)} ({exc.message}); {_SERVER_HINT}"
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
            f"the MLflow tracking server at {mask_secrets(uri)} rejected the request (HTTP {api}): set "
            "MLFLOW_TRACKING_TOKEN, or MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD (or "
            "~/.mlflow/credentials), or the auth plugin of MLFLOW_TRACKING_AUTH"
        )
    raise TrackingError(
        f"{mask_secrets(uri)} answered HTTP {health} to GET /health and HTTP {api} to the MLflow REST API: it does "
        f"not look like an MLflow tracking server; {_SERVER_HINT}"
    )


LOCK_TIMEOUT_S = 300.0  # a first migration takes seconds; a lock held longer is a stuck process
OPEN_ATTEMPTS = 6  # a concurrent creator's migration takes seconds
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
            with lock:  # other MLflow clients (`mlflow ui`, a notebook) do not take it: wait while they migrate
                if not _holds_a_schema(path):
                    _create_aside(uri, path)
                try:
                    _refuse_half_migrated_when_still(path)
                except TrackingError:
                    if not _holds_nothing(path):
                        raise
                    _create_aside(uri, path)  # other clients broke a new store racing each other: nothing is lost
                _first_open(uri, path)
                _refuse_half_migrated_when_still(path)  # what a concurrent creator left must be a whole schema
        except Timeout:
            raise TrackingError(
                f"tracking store {uri}: another process has held {lock.lock_file} for over {LOCK_TIMEOUT_S:.0f} s "
                "while creating the store; stop it, or remove the lock file if no runner or mlflow process is left"
            ) from None
    _opened.add(uri)


def _holds_a_schema(path: Path) -> bool:
    """Whether the sqlite file at ``path`` exists and has MLflow's tables (whole or not)."""
    if not path.is_file() or path.stat().st_size == 0:
        return False
    try:
        with sqlite3.connect(f"{path.as_uri()}?mode=ro", uri=True) as db:
            return db.execute("SELECT COUNT(*) FROM sqlite_master WHERE name = 'experiments'").fetchone()[0] > 0
    except sqlite3.DatabaseError:
        return True  # not ours to judge here: refuse_half_migrated names what is wrong with it


def _create_aside(uri: str, path: Path) -> None:
    """Create and migrate a new store in a hidden file beside ``path``, then move it into place whole. Another MLflow
    client that opens ``path`` meanwhile (`mlflow ui`, a notebook) would otherwise migrate the same new file at the same
    moment, and two alembic migrations of one sqlite file can leave it broken. What such a client made at ``path`` in
    the meantime, holding nothing yet, is replaced."""
    aside = path.with_name(f".{path.name}.{os.getpid()}.creating")
    query = uri.partition("?")[2]
    try:
        _first_open(f"sqlite:///{aside}" + (f"?{query}" if query else ""))
        if _holds_nothing(path):  # else a store appeared meanwhile and is in use: it is opened as it is
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
    """Open the store with MLflow (which creates or upgrades its schema); MLflow's refusal becomes a TrackingError. A
    schema being created or upgraded by another client at the same moment ("already exists", "database is locked",
    "out-of-date database schema" while the file still changes) is waited for: up to :data:`OPEN_ATTEMPTS` tries, each
    after the sqlite file has been still for :data:`STILL_S`."""
    from mlflow.exceptions import MlflowException

    for name in ("mlflow.store.db.utils", "alembic"):  # "Creating initial MLflow database tables..." at INFO
        logging.getLogger(name).setLevel(logging.WARNING)
    for attempt in range(OPEN_ATTEMPTS):
        try:
            client_for(uri).search_experiments(max_results=1)
            return
        except Exception as exc:  # MlflowException, sqlalchemy / alembic errors of a damaged database
            text = exc.message if isinstance(exc, MlflowException) else f"{type(exc).__name__}: {exc}"
            racing = any(sign in text for sign in ("already exists", "database is locked", "out-of-date database"))
            if not racing or attempt == OPEN_ATTEMPTS - 1:
                first = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
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
    """Wait until the sqlite database at ``path`` (and its journal) has not changed for :data:`STILL_S` seconds.

    Another MLflow client creating or upgrading the schema changes it many times a second; what is
    still afterwards is what that client left. Returns whether it changed at all while watched.
    """

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


LOCAL_UI = "http://127.0.0.1:5000"  # where `mlflow ui` serves a local store by default
TRAINING_VIEW = "workflowType=machine_learning"


def ui_line(uri: str, experiment_id: str, run_id: str | None = None, what: str = "the run") -> str:
    """How to open a run (or an experiment's runs list) in the MLflow UI's training view, for the user.

    MLflow 3's UI opens an experiment in its GenAI view unless the link asks for the training view
    (``?workflowType=machine_learning`` after the hash route; the browser then remembers the choice).
    A tracking server's link leaves out its credentials; a local store needs ``mlflow ui`` first.
    """
    parts = urlsplit(uri)
    served = parts.scheme in ("http", "https")
    base = urlunsplit((parts.scheme, parts.netloc.rpartition("@")[2], parts.path, "", "")) if served else LOCAL_UI
    route = f"#/experiments/{experiment_id}/runs" + (f"/{run_id}" if run_id else "")
    link = f"{base.rstrip('/')}/{route}?{TRAINING_VIEW}"
    if served:
        return f"open {what}: {link}"
    return f"open {what}: mlflow ui --backend-store-uri {mask_secrets(uri)}, then {link}"

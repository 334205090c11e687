"""MLflow runs: tracking URI, reachability, run creation with provenance, run end and resume.

Only :class:`mlflow.tracking.MlflowClient` is used, always with an explicit run id, so
runs never depend on MLflow's fluent "active run" stack. The trackers that log a run's
metrics live in :mod:`runner.tracking.trackers`. mlflow and torch are
imported inside functions, never when this module is imported.
"""

from __future__ import annotations

import getpass
import json
import logging
import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from runner.errors import TrackingError
from runner.tracking.gitinfo import git_diff, git_info
from runner.tracking.trackers import PARAMS_PER_BATCH, param_value

log = logging.getLogger(__name__)

TERMINAL_STATUSES = ("FINISHED", "FAILED", "KILLED")
ERROR_TAG_CHARS = 1000
_BARE_URIS = ("databricks", "databricks-uc", "uc")
_BAD_KEY_CHARS = re.compile(r"[^/\w.\- :]")
_SERVER_HINT = (
    "start a server with `mlflow server --host 127.0.0.1 --port 5000 --backend-store-uri sqlite:///mlflow.db`, "
    "fix tracking.uri in the spec, or unset MLFLOW_TRACKING_URI to log to ./mlflow.db"
)


# --------------------------------------------------------------------------- URI


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
    spec: Any, env: Mapping[str, str] | None = None, cwd: str | os.PathLike[str] | None = None
) -> str:
    """Return the tracking URI a run of ``spec`` logs to.

    Precedence: ``spec.tracking.uri``, then ``$MLFLOW_TRACKING_URI``, then
    ``sqlite:///<cwd>/mlflow.db``. A relative sqlite path, relative ``file:`` URI or plain
    path is resolved once against ``cwd`` (MLflow's own convention), so worker processes
    started elsewhere log to the same store.

    Args:
        spec: An ``ExperimentSpec`` (only ``spec.tracking.uri`` is read).
        env: Environment to read ``MLFLOW_TRACKING_URI`` from. Default: ``os.environ``.
        cwd: Folder relative paths are taken from. Default: the current directory.

    Returns:
        An absolute tracking URI, e.g. ``sqlite:////home/me/proj/mlflow.db``.
    """
    env = os.environ if env is None else env
    base = Path.cwd() if cwd is None else Path(cwd)
    raw = (spec.tracking.uri or "").strip() or env.get("MLFLOW_TRACKING_URI", "").strip()
    if not raw:
        return f"sqlite:///{(base / 'mlflow.db').resolve()}"
    return _absolute_uri(raw, base)


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


def _http_auth() -> tuple[dict[str, str], Any, Any]:
    """Headers, basic auth and TLS verification from MLflow's standard environment variables."""
    headers: dict[str, str] = {}
    auth = None
    token = os.environ.get("MLFLOW_TRACKING_TOKEN")
    user, password = os.environ.get("MLFLOW_TRACKING_USERNAME"), os.environ.get("MLFLOW_TRACKING_PASSWORD")
    if token:
        headers["Authorization"] = f"Bearer {token}"
    elif user and password:
        auth = (user, password)
    verify: Any = True
    if os.environ.get("MLFLOW_TRACKING_INSECURE_TLS", "").lower() in ("1", "true"):
        verify = False
    elif os.environ.get("MLFLOW_TRACKING_SERVER_CERT_PATH"):
        verify = os.environ["MLFLOW_TRACKING_SERVER_CERT_PATH"]
    return headers, auth, verify


def check_reachable(uri: str, timeout_s: float = 5.0) -> None:
    """Fail fast, before any training, when the tracking store cannot be used.

    http(s): ``GET <uri>/health`` (falling back to the REST experiments-search endpoint),
    with no retries. sqlite: the database's folder exists and is writable (and the file,
    if it exists, too). Local file store: the folder, or its parent, is writable. Other
    schemes (postgresql, databricks, ...) are not checked here. Nothing is written.

    Args:
        uri: An absolute tracking URI, e.g. from :func:`resolve_tracking_uri`.
        timeout_s: Seconds to wait for the server to answer each request.

    Raises:
        TrackingError: The server does not answer, answers like something other than an
            MLflow server, rejects the credentials, or the local store is not writable.
    """
    scheme = urlsplit(uri).scheme
    if scheme in ("http", "https"):
        _check_http(uri, timeout_s)
        return
    local = _local_store_path(uri)
    if local is None:
        return
    kind, path = local
    if kind == "sqlite":
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
        return
    target = path if path.exists() else path.parent
    if not target.is_dir() or not os.access(target, os.W_OK | os.X_OK):
        raise TrackingError(f"tracking store {uri}: {target} is not a writable folder")


def _check_http(uri: str, timeout_s: float) -> None:
    import requests

    headers, auth, verify = _http_auth()
    base = uri.rstrip("/")

    def get(endpoint: str) -> int:
        try:
            resp = requests.get(
                base + endpoint, headers=headers, auth=auth, verify=verify, timeout=timeout_s, allow_redirects=True
            )
        except requests.exceptions.RequestException as exc:
            raise TrackingError(
                f"cannot reach the MLflow tracking server at {uri} ({type(exc).__name__}: {exc}); {_SERVER_HINT}"
            ) from exc
        return resp.status_code

    health = get("/health")
    if health == 200:
        return
    api = get("/api/2.0/mlflow/experiments/search?max_results=1")
    if api == 200:
        return
    if api in (401, 403):
        raise TrackingError(
            f"the MLflow tracking server at {uri} rejected the request (HTTP {api}): set MLFLOW_TRACKING_TOKEN, "
            "or MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD"
        )
    raise TrackingError(
        f"{uri} answered HTTP {health} to GET /health and HTTP {api} to the MLflow REST API: it does not look like "
        f"an MLflow tracking server; {_SERVER_HINT}"
    )


# --------------------------------------------------------------------------- run creation


@dataclass(frozen=True)
class RunHandle:
    """Where a run lives.

    Attributes:
        uri: Absolute tracking URI.
        run_id: MLflow run id (32 hex digits).
        experiment_id: MLflow experiment id.
        experiment_name: MLflow experiment name.
        run_name: The run's display name (given or generated by MLflow).
        artifact_uri: Root of the run's artifacts.
    """

    uri: str
    run_id: str
    experiment_id: str
    experiment_name: str
    run_name: str = ""
    artifact_uri: str = ""


def _spec_codec() -> tuple[Any, Any]:
    """``(flatten_spec, dump_spec)`` from :mod:`runner.spec.dump` (imported lazily)."""
    from runner.spec.dump import dump_spec, flatten_spec

    return flatten_spec, dump_spec


def _shorten(text: str, limit: int, where: str) -> str:
    """Cut ``text`` to ``limit`` characters with a marker saying how long it was and where the rest is."""
    if len(text) <= limit:
        return text
    marker = f"...[truncated from {len(text)} chars; full text in {where}]"
    return text[: max(0, limit - len(marker))] + marker


def spec_params(spec: Any) -> dict[str, str]:
    """Return the MLflow params of a spec: dotted keys to strings within MLflow's limits.

    Keys come from ``runner.spec.dump.flatten_spec`` (``None`` values are left out);
    characters MLflow rejects in keys become ``_``; values longer than MLflow's limit
    (``MAX_PARAM_VAL_LENGTH``, 6000) are shortened with a marker pointing at the
    ``spec/resolved.toml`` artifact, which holds the full spec.

    Args:
        spec: An ``ExperimentSpec``.
    """
    from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH

    flatten_spec, _ = _spec_codec()
    out: dict[str, str] = {}
    for key, value in flatten_spec(spec).items():
        if value is None:
            continue
        out[_BAD_KEY_CHARS.sub("_", key)] = _shorten(
            param_value(value), MAX_PARAM_VAL_LENGTH, "artifact spec/resolved.toml"
        )
    return out


def _check_fluent_run(nested: bool) -> str | None:
    """Raise when a fluent MLflow run is active and nesting was not asked for; return the parent id."""
    import mlflow

    active = mlflow.active_run()
    if active is None:
        return None
    active_id = active.info.run_id
    if not nested:
        raise TrackingError(
            f"an MLflow run ({active_id}) is already active in this process (mlflow.start_run() was called before runner): "
            "end it with mlflow.end_run() first, or pass nested=True to record this run as its child"
        )
    return active_id


def _torch_versions() -> tuple[str, str]:
    """``(torch version, CUDA version of the torch build or "none")`` without initialising CUDA."""
    try:
        import torch
    except ImportError:
        return "none", "none"
    return str(torch.__version__), str(torch.version.cuda or "none")


def _runner_version() -> str:
    import runner

    return str(getattr(runner, "__version__", "unknown"))


def run_tags(
    loaded: Any,
    plan_description: Mapping[str, Any],
    info: Any,
    extra_tags: Mapping[str, Any] | None = None,
    parent_run_id: str | None = None,
) -> dict[str, str]:
    """Build the tags of a new run: provenance, environment, spec tags, then ``extra_tags``.

    Args:
        loaded: A ``LoadedSpec``.
        plan_description: ``DevicePlan.describe()``; ``devices[*].name`` (or ``names``),
            ``world_size``, ``accelerator`` and ``mode`` are read when present.
        info: :class:`runner.tracking.gitinfo.GitInfo` of the repository holding the spec, or ``None``.
        extra_tags: Tags that override all others.
        parent_run_id: Set ``mlflow.parentRunId`` (nested runs).

    Returns:
        Tag key -> string value (values cut to MLflow's ``MAX_TAG_VAL_LENGTH``).
    """
    from mlflow.utils.validation import MAX_TAG_VAL_LENGTH

    spec = loaded.spec
    torch_version, cuda_version = _torch_versions()
    spec_path = info.relpath(loaded.path) if info is not None else str(Path(loaded.path).resolve())
    tags: dict[str, Any] = {
        "mlflow.source.type": "LOCAL",
        "mlflow.source.name": spec_path,
        "runner.spec.path": spec_path,
        "runner.spec.sha256": loaded.sha256,
        "runner.version": _runner_version(),
        "runner.torch_version": torch_version,
        "runner.cuda_version": cuda_version,
        "runner.hostname": socket.gethostname(),
        "runner.parallel_mode": plan_description.get("mode", spec.parallel.mode),
    }
    try:
        tags["mlflow.user"] = getpass.getuser()
    except Exception:  # no user name in containers without a passwd entry
        pass
    if info is not None:
        tags["runner.git.dirty"] = "true" if info.dirty else "false"
        tags["runner.git.untracked_files"] = str(info.untracked_count)
        if info.commit:
            tags["mlflow.source.git.commit"] = info.commit
        if info.branch:
            tags["runner.git.branch"] = info.branch
            tags["mlflow.source.git.branch"] = info.branch
        if info.remote_url:
            tags["mlflow.source.git.repoURL"] = info.remote_url
    # ``plan_description`` is either a DevicePlan description or a whole plan holding one under "devices".
    nested = plan_description.get("devices")
    device_plan = nested if isinstance(nested, Mapping) else plan_description
    names = device_plan.get("names") or [
        d["name"] for d in device_plan.get("devices") or () if isinstance(d, Mapping) and d.get("name")
    ]
    if names:
        tags["runner.devices"] = ", ".join(str(n) for n in names)
    elif device_plan.get("accelerator") == "cpu":
        tags["runner.devices"] = "cpu"
    for key in ("world_size", "accelerator"):
        value = plan_description.get(key, device_plan.get(key))
        if value is not None:
            tags[f"runner.{key}"] = value
    if spec.description:
        tags["mlflow.note.content"] = spec.description
    if parent_run_id:
        tags["mlflow.parentRunId"] = parent_run_id
    tags.update(spec.tags)
    tags.update(extra_tags or {})
    return {k: _shorten(param_value(v), MAX_TAG_VAL_LENGTH, "the run's artifacts") for k, v in tags.items()}


def _ensure_experiment(client: Any, name: str, uri: str) -> str:
    """Return the id of experiment ``name``, creating it when missing (race-safe)."""
    from mlflow.exceptions import MlflowException

    exp = client.get_experiment_by_name(name)
    if exp is None:
        try:
            return client.create_experiment(name)
        except MlflowException as exc:
            if getattr(exc, "error_code", "") != "RESOURCE_ALREADY_EXISTS":
                raise
            exp = client.get_experiment_by_name(name)  # another process created it meanwhile
            if exp is None:
                raise
    if exp.lifecycle_stage == "deleted":
        raise TrackingError(
            f"MLflow experiment {name!r} (id {exp.experiment_id}) in {uri} is deleted: restore it with "
            f"`mlflow experiments restore --experiment-id {exp.experiment_id}` or set tracking.experiment to another name"
        )
    return exp.experiment_id


def start_run(
    loaded: Any,
    plan_description: Mapping[str, Any],
    run_name: str | None = None,
    extra_tags: Mapping[str, Any] | None = None,
    *,
    uri: str | None = None,
    nested: bool = False,
) -> RunHandle:
    """Create the MLflow run of an experiment and record its spec, provenance and plan.

    Creates the experiment (``spec.tracking.experiment``, else ``spec.name``) when
    missing, then one run with an explicit id (MLflow's fluent active run is neither used
    nor changed). Logs the flattened spec as params (batches of 100); tags from
    :func:`run_tags`; artifacts ``spec/<spec file name>`` (the file's own text),
    ``spec/resolved.toml``, ``spec/plan.json``, and ``git/diff.patch`` when tracked files
    differ from HEAD and ``git/untracked.txt`` when untracked files exist, in the git
    repository that contains the spec file. If logging fails after the run was created,
    the run is marked FAILED before the error is raised.

    Args:
        loaded: A ``runner.spec.loading.LoadedSpec`` (``spec``, ``path``, ``source_text``, ``sha256``).
        plan_description: JSON-able description of the device plan (``DevicePlan.describe()``).
        run_name: Display name. Default: ``spec.tracking.run_name``, else MLflow's generated name.
        extra_tags: Further tags; they override every other tag.
        uri: Tracking URI. Default: :func:`resolve_tracking_uri` of the spec.
        nested: Allow a fluent MLflow run to be active and record it as this run's parent.

    Returns:
        The new run's :class:`RunHandle`; the run is RUNNING until :func:`end_run`.

    Raises:
        TrackingError: A fluent run is active and ``nested`` is false, the store is not
            reachable, the experiment is deleted, or MLflow rejects a request.
    """
    from mlflow.entities import Param
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    spec = loaded.spec
    uri = uri or resolve_tracking_uri(spec)
    parent_run_id = _check_fluent_run(nested)
    check_reachable(uri)
    # Everything that can fail without the network is computed before the run exists.
    _, dump_spec = _spec_codec()
    params = [Param(k, v) for k, v in spec_params(spec).items()]
    resolved_toml = dump_spec(spec)
    plan_json = json.dumps(dict(plan_description), indent=2, sort_keys=True, default=str) + "\n"
    info = git_info(loaded.path)
    tags = run_tags(loaded, plan_description, info, extra_tags, parent_run_id)
    experiment_name = spec.tracking.experiment or spec.name
    run_name = run_name or spec.tracking.run_name

    client = MlflowClient(tracking_uri=uri)
    try:
        experiment_id = _ensure_experiment(client, experiment_name, uri)
        run = client.create_run(experiment_id, tags=tags, run_name=run_name)
    except MlflowException as exc:
        raise TrackingError(
            f"could not create an MLflow run in experiment {experiment_name!r} at {uri}: {exc}"
        ) from exc
    run_id = run.info.run_id
    try:
        for i in range(0, len(params), PARAMS_PER_BATCH):
            client.log_batch(run_id, params=params[i : i + PARAMS_PER_BATCH], synchronous=True)
        source_name = Path(loaded.path).name
        if source_name in ("resolved.toml", "plan.json"):
            source_name = f"source-{source_name}"
        client.log_text(run_id, loaded.source_text, f"spec/{source_name}")
        client.log_text(run_id, resolved_toml, "spec/resolved.toml")
        client.log_text(run_id, plan_json, "spec/plan.json")
        if info is not None and info.dirty:
            client.log_text(run_id, git_diff(info), "git/diff.patch")
        if info is not None and info.untracked:
            more = info.untracked_count - len(info.untracked)
            listing = "\n".join(info.untracked) + (f"\n[... and {more} more]" if more > 0 else "") + "\n"
            client.log_text(run_id, listing, "git/untracked.txt")
    except Exception as exc:
        try:
            client.set_terminated(run_id, "FAILED")
        except Exception:  # the original error matters more
            log.debug("could not mark run %s FAILED", run_id, exc_info=True)
        raise TrackingError(f"could not record the spec of run {run_id} at {uri}: {type(exc).__name__}: {exc}") from exc
    return RunHandle(
        uri=uri,
        run_id=run_id,
        experiment_id=experiment_id,
        experiment_name=experiment_name,
        run_name=run.info.run_name or "",
        artifact_uri=run.info.artifact_uri or "",
    )


def _error_tag(error: str) -> str:
    """Keep both ends of a long error (a traceback ends with the exception message)."""
    text = error.strip()
    if len(text) <= ERROR_TAG_CHARS:
        return text
    head, tail = 200, ERROR_TAG_CHARS - 260
    return (
        f"{text[:head]}\n...[{len(text) - head - tail} chars cut; full text in artifact error.txt]...\n{text[-tail:]}"
    )


def end_run(uri: str, run_id: str, status: str, error: str | None = None) -> None:
    """Give a run its terminal status, recording the error when there is one.

    Args:
        uri: Tracking URI of the run.
        run_id: The run.
        status: ``"FINISHED"``, ``"FAILED"`` or ``"KILLED"``.
        error: What went wrong (message or traceback); stored in full as artifact
            ``error.txt`` and, cut to both ends of about 1000 characters, as tag ``runner.error``.

    Raises:
        ValueError: ``status`` is not a terminal status.
        TrackingError: MLflow rejects a request (unknown run, unreachable store).
    """
    if status not in TERMINAL_STATUSES:
        raise ValueError(f"status {status!r} is not one of {', '.join(TERMINAL_STATUSES)}")
    from mlflow.entities import RunTag
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    try:
        if error:
            client.log_batch(run_id, tags=[RunTag("runner.error", _error_tag(error))], synchronous=True)
            client.log_text(run_id, error if error.endswith("\n") else error + "\n", "error.txt")
        client.set_terminated(run_id, status)
    except Exception as exc:
        raise TrackingError(
            f"could not end MLflow run {run_id} at {uri} with status {status}: {type(exc).__name__}: {exc}"
        ) from exc


def run_exists(uri: str, run_id: str) -> bool:
    """Whether ``run_id`` is a run of the store at ``uri`` (deleted runs do not count)."""
    from mlflow.tracking import MlflowClient

    try:
        run = MlflowClient(tracking_uri=uri).get_run(run_id)
    except Exception:
        return False
    return run.info.lifecycle_stage != "deleted"


def delete_run(uri: str, run_id: str) -> None:
    """Delete a run that never trained (its spec turned out not to build); see ``MlflowClient.delete_run``."""
    from mlflow.tracking import MlflowClient

    try:
        MlflowClient(tracking_uri=uri).delete_run(run_id)
    except Exception as exc:
        raise TrackingError(f"could not delete MLflow run {run_id} at {uri}: {type(exc).__name__}: {exc}") from exc


def run_status(uri: str, run_id: str) -> str:
    """MLflow status of a run: ``RUNNING``, ``FINISHED``, ``FAILED`` or ``KILLED``."""
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri).get_run(run_id).info.status


def latest_run_id(uri: str, experiment: str) -> str | None:
    """Id of the most recently started top-level run of ``experiment``, or ``None``.

    Child runs of sweeps and benches (tag ``mlflow.parentRunId``) are not candidates.
    """
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        return None
    runs = client.search_runs([exp.experiment_id], order_by=["attributes.start_time DESC"], max_results=50)
    for run in runs:
        if "mlflow.parentRunId" not in run.data.tags and run.data.tags.get("runner.sweep") != "parent":
            return run.info.run_id
    return None


def reopen_run(uri: str, run_id: str, spec_change: str | None = None) -> None:
    """Mark a stopped run RUNNING again so a resumed job continues it (params are not logged again).

    Args:
        uri: Tracking URI.
        run_id: The run to continue.
        spec_change: JSON object ``{dotted key: [old, new]}`` of the changes the user allowed;
            recorded as tag ``runner.resume.spec_change`` (params keep their first values).

    Raises:
        TrackingError: MLflow rejects the update.
    """
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    try:
        client.update_run(run_id, status="RUNNING")
        count = int(client.get_run(run_id).data.tags.get("runner.resume.count", "0")) + 1
        client.set_tag(run_id, "runner.resume.count", str(count))
        if spec_change:
            client.set_tag(run_id, "runner.resume.spec_change", spec_change)
    except Exception as exc:
        raise TrackingError(f"could not reopen MLflow run {run_id} at {uri}: {type(exc).__name__}: {exc}") from exc


def last_logged_steps(uri: str, run_id: str) -> dict[str, int]:
    """The highest step logged so far for every metric of a run (``{}`` for a new run).

    A resumed job uses it to skip steps it recomputes after its last checkpoint, so that the
    run's metric histories never hold a step twice.
    """
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    keys = client.get_run(run_id).data.metrics.keys()
    return {key: max((m.step for m in client.get_metric_history(run_id, key)), default=-1) for key in keys}

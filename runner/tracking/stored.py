"""A run read back from MLflow: its status, tags and stored spec; look runs up and tag them afterwards.

``runner resume``, ``runner reproduce`` and ``runner diff`` start from a run id alone: the spec a
run trained with is its artifact ``spec/resolved.toml`` (every default written out, paths absolute),
and ``spec/plan.json`` names the spec file it came from. Runs are read back as ``runner.tracking.runs.RunRecord``,
one by id (``runner.tracking.runs.TrackedRun.find``) or by experiment, tags and status (``search_runs``), so no
MLflow object leaves the package. mlflow is imported inside functions.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from runner.devices.inventory import scoped_environ
from runner.errors import UsageError, store_errors
from runner.tracking.runs import RunRecord, TrackedRun, run_record
from runner.tracking.tags import PLAN, RESOLVED
from runner.tracking.uri import (
    absolute_uri,
    check_reachable,
    client_for,
    default_tracking_uri,
    local_store_missing,
)

if TYPE_CHECKING:
    import torch
    from mlflow.entities import Dataset
    from mlflow.tracking import MlflowClient

    from runner.spec.loading import LoadedSpec


@dataclass(frozen=True, kw_only=True)
class StoredRun(RunRecord):
    """What runner recorded about one run: the record, the original spec path (may be gone), ``spec/plan.json``."""

    uri: str
    resolved_text: str
    spec_path: Path
    plan: dict[str, Any] = field(default_factory=dict)

    def loaded(self) -> LoadedSpec:
        """The stored spec, validated (factories from the original folder); SpecError when it no longer validates."""
        from runner.spec.loading import load_resolved_text

        return load_resolved_text(self.resolved_text, self.spec_path, f"run {self.run_id}: {RESOLVED}")


def store_uri(given: str | None) -> str:
    """The store to read a run id from: ``--tracking-uri`` (made absolute), else :func:`default_tracking_uri`."""
    return absolute_uri(given) if given else default_tracking_uri()


def read_stored_run(run: TrackedRun) -> StoredRun:
    """Read ``run`` and its stored spec. Raises TrackingError: The store cannot be reached. UsageError: No such run
    (or deleted), or no ``spec/resolved.toml``; naming the run and store."""
    run_id = run.run_id
    where = f"at {run.uri}"
    if local_store_missing(run.uri):
        raise UsageError(f"no run {run_id} {where}: there is no tracking store there; {STORE_HINT}")
    check_reachable(run.uri)
    record = run.find()
    if record is None:
        raise UsageError(f"no run {run_id} {where}: copy the run id from the MLflow UI; {STORE_HINT}")
    texts = _download_texts(run.client, run_id, (RESOLVED, PLAN))
    if RESOLVED not in texts:
        raise UsageError(_not_an_exec_run(run_id, where, record.tags))
    plan = _json_object(texts.get(PLAN, ""))
    spec_path = Path(str(plan.get("spec") or record.tags.get("runner.spec.path") or "spec.toml"))
    return StoredRun(
        **vars(record),
        uri=run.uri,
        resolved_text=texts[RESOLVED],
        spec_path=spec_path if spec_path.is_absolute() else Path.cwd() / spec_path,
        plan=plan,
    )


def _not_an_exec_run(run_id: str, where: str, tags: dict[str, str]) -> str:
    """Why a run without ``spec/resolved.toml`` cannot be continued or repeated, and what to do instead."""
    spec = tags.get("runner.spec.path") or "SPEC"
    if tags.get("runner.sweep") == "parent":
        return (
            f"run {run_id} {where} is a sweep's parent run: `runner sweep {spec}` continues the study, "
            "or reproduce one of its trials by the trial's run id"
        )
    if tags.get("runner.bench") == "parent":
        return (
            f"run {run_id} {where} is a bench's parent run: `runner bench {spec}` measures again, "
            "or reproduce one configuration by its run id"
        )
    return (
        f"run {run_id} {where} has no spec stored by runner (artifact {RESOLVED}): "
        "it was not started by `runner exec`, so there is nothing to continue or repeat"
    )


STORE_HINT = "pass --tracking-uri URI of the store that holds it (default: $MLFLOW_TRACKING_URI, else ./mlflow.db)"


def _download_texts(client: MlflowClient, run_id: str, paths: tuple[str, ...]) -> dict[str, str]:
    """The artifacts of ``paths`` that exist, as text."""
    out: dict[str, str] = {}
    quiet = {"MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false"}  # a few small texts: no progress bars
    with tempfile.TemporaryDirectory(prefix="runner-stored-") as tmp, scoped_environ(quiet):
        for path in paths:
            try:
                local = client.download_artifacts(run_id, path, tmp)
                out[path] = Path(local).read_text(encoding="utf-8")
            except Exception:
                continue
    return out


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text) if text else {}
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


CHECKPOINT_DIR_TAG = "runner.checkpoint_dir"


def run_checkpoint_dir(run: TrackedRun, root: Path, tags: Mapping[str, str] | None = None) -> Path:
    """Where ``run`` keeps its checkpoints, from any working directory: its folder under the plan's ``root`` when it
    exists, else the tag ``runner.checkpoint_dir`` (of ``tags``, else read from the run)."""
    default = root / run.run_id
    if default.is_dir():
        return default
    tagged = (run.record().tags if tags is None else tags).get(CHECKPOINT_DIR_TAG)
    return Path(tagged) if tagged else default


def search_runs(
    uri: str, experiment: str | None, tags: Mapping[str, str] | None = None, *, status: str = "", limit: int = 0
) -> list[RunRecord]:
    """The runs of ``experiment`` (``None``: of every active experiment) with ``tags`` and ``status``, newest first;
    at most ``limit``, else every one, page by page. No such experiment: none. TrackingError when unsearchable."""
    from mlflow.entities import ViewType

    client = client_for(uri)
    quoted = {key: value.replace("'", "\\'") for key, value in (tags or {}).items()}
    conditions = [f"tags.`{key}` = '{value}'" for key, value in quoted.items()]
    conditions += [f"attributes.status = '{status}'"] if status else []
    with store_errors(f"search the runs at {uri}"):
        if experiment is None:
            names = {e.experiment_id: e.name for e in client.search_experiments(view_type=ViewType.ACTIVE_ONLY)}
        else:
            found = client.get_experiment_by_name(experiment)
            names = {found.experiment_id: experiment} if found is not None else {}
        runs = []
        token = None
        newest = ["attributes.start_time DESC"]
        while names:
            page = client.search_runs(
                list(names), " and ".join(conditions), order_by=newest, max_results=limit or 1000, page_token=token
            )
            runs += [run_record(r, names[r.info.experiment_id]) for r in page]
            token = page.token
            if limit or not token:
                break
    return runs


def continuable_runs(uri: str, experiment: str, limit: int = 100) -> list[RunRecord]:
    """The KILLED, FAILED or RUNNING runs of ``experiment`` that ``runner exec`` could continue, newest first.

    Parents of sweeps and benches and child runs are left out; whether a RUNNING run's owner is gone is for
    :mod:`runner.launch.resume`.
    """
    return [
        r
        for r in search_runs(uri, experiment, limit=limit)
        if r.status in ("RUNNING", "KILLED", "FAILED")
        and "mlflow.parentRunId" not in r.tags
        and "parent" not in (r.tags.get("runner.sweep"), r.tags.get("runner.bench"))
    ]


MODEL_NAME = "model"


def with_normalization(
    model: torch.nn.Module, normalization: tuple[float, float] | None, channels: int
) -> torch.nn.Module:
    """``model`` behind ``torchvision.transforms.Normalize(mean, std)``, or ``model`` when not normalised."""
    if normalization is None:
        return model
    import torch
    from torchvision.transforms import Normalize

    mean, std = normalization
    return torch.nn.Sequential(Normalize([mean] * channels, [std] * channels), model)


@contextlib.contextmanager
def _tracking_uri(uri: str) -> Iterator[None]:
    """Point MLflow's fluent API at ``uri`` for the duration (``mlflow.pytorch.log_model`` reads it), then restore."""
    import mlflow
    from mlflow.tracking._tracking_service import utils

    before_uri, before_env = utils._tracking_uri, os.environ.get("MLFLOW_TRACKING_URI")
    mlflow.set_tracking_uri(uri)
    try:
        yield
    finally:
        mlflow.set_tracking_uri(before_uri)  # type: ignore[arg-type]  # None unsets the variable: put the user's back
        if before_env is not None:
            os.environ["MLFLOW_TRACKING_URI"] = before_env


def _served(
    model: torch.nn.Module, example: torch.Tensor | dict[str, torch.Tensor], normalization: tuple[float, float] | None
) -> tuple[torch.nn.Module, Any, Any]:
    """``(the model to log, its input example, its signature)``: on CPU, in eval mode, normalising its input."""
    import torch
    from mlflow.models import infer_signature

    if isinstance(example, dict):
        shown = {k: v.detach().cpu().numpy() for k, v in example.items()}
        return model.to("cpu").eval(), shown, infer_signature(shown)
    x = example.detach().cpu()
    channels = int(x.shape[1]) if x.dim() >= 3 else 1
    served = with_normalization(model.to("cpu").eval(), normalization, channels).eval()
    with torch.no_grad():
        y = served(x)
    return served, x.numpy(), infer_signature(x.numpy(), y.detach().numpy())


def log_model(
    run: TrackedRun,
    model: torch.nn.Module,
    example: torch.Tensor | dict[str, torch.Tensor],
    *,
    step: int = 0,
    normalization: tuple[float, float] | None = None,
) -> None:
    """Log the unwrapped model as a LoggedModel of ``run``, linked to the metrics at ``step``.

    ``create_logged_model`` then ``mlflow.pytorch.log_model(model_id=...)``, without MLflow's fluent run stack. The
    model is pickled (``pt2`` needs a traceable forward). ``example`` is one input before normalisation (a tensor or a
    dict of them) and gives the signature. Raises MlflowException when MLflow cannot save or upload it.
    """
    import mlflow.pytorch

    found = run.client.get_run(run.run_id)
    served, shown, signature = _served(model, example, normalization)
    logged = run.client.create_logged_model(
        found.info.experiment_id, name=MODEL_NAME, source_run_id=run.run_id, params=dict(found.data.params)
    )
    with _tracking_uri(run.uri):
        mlflow.pytorch.log_model(
            served,
            name=MODEL_NAME,
            model_id=logged.model_id,
            run_id=run.run_id,
            step=step,
            input_example=shown,
            signature=signature,
            serialization_format="pickle",
        )


VAL_SPLIT_TAG = "runner.data.val_split_sha256"
ATTEMPTS = 5  # tries of a transient store error, 0.2 s doubling pauses between them (3 s in all)


@dataclass(frozen=True)
class DatasetRecord:
    """One part of a run's data as MLflow shows it: digest, ``training``/``validation``, source, sample shape."""

    name: str
    digest: str
    context: str
    num_samples: int
    source: str
    input_shape: tuple[int, ...]


def record_data(run: TrackedRun, records: list[DatasetRecord], val_split_sha256: str | None) -> None:
    """Log the data's parts as dataset inputs and tag the validation split's fingerprint; TrackingError if rejected."""
    from mlflow.entities import DatasetInput, InputTag

    inputs = [DatasetInput(_dataset(r), tags=[InputTag("mlflow.data.context", r.context)]) for r in records]
    with run.errors("record the datasets of"):
        for attempt in range(ATTEMPTS):
            try:
                if inputs:
                    run.client.log_inputs(run.run_id, datasets=inputs)
                if val_split_sha256:
                    run.client.set_tag(run.run_id, VAL_SPLIT_TAG, val_split_sha256)
                return
            except Exception as exc:
                # Runs of one experiment logging the same dataset at once (sweep workers) race on its row: the
                # loser's "UNIQUE constraint failed: datasets..." means it is logged, and the next try links it.
                if attempt + 1 == ATTEMPTS or not _transient(exc):
                    raise
                time.sleep(0.2 * 2**attempt)


def _transient(exc: BaseException) -> bool:
    """A store error another try can get past: a row another client just wrote, a lock, a dropped connection."""
    text = str(exc)
    signs = ("UNIQUE constraint", "Duplicate entry", "duplicate key", "database is locked", "Connection", "timed out")
    return isinstance(exc, (ConnectionError, TimeoutError)) or any(sign in text for sign in signs)


def _dataset(record: DatasetRecord) -> Dataset:
    """The MLflow entity of one part: tensor schema of a sample (float32 inputs, int64 labels), sample count."""
    import numpy as np
    from mlflow.entities import Dataset
    from mlflow.types import Schema, TensorSpec

    features = Schema([TensorSpec(np.dtype("float32"), (-1, *record.input_shape))]).to_json()
    targets = Schema([TensorSpec(np.dtype("int64"), (-1,))]).to_json()
    local = record.source.startswith("/")
    return Dataset(
        name=record.name,
        digest=record.digest,
        source_type="local" if local else "code",
        source=json.dumps({"uri": record.source} if local else {"tags": {"mlflow.source.name": record.source}}),
        schema=json.dumps({"mlflow_tensorspec": {"features": features, "targets": targets}}),
        profile=json.dumps({"num_rows": record.num_samples}),
    )

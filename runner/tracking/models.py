"""Log a trained model to its MLflow run with ``mlflow.pytorch.log_model``: a LoggedModel linked to the run.

MLflow 3 records a model as a LoggedModel: logged with ``step`` = the run's last step, it takes
the run's params and is linked to the metrics of that step, so the run page and the Models tab
show which numbers the model scored. The model is logged with an input example and a signature
(inferred from it), and the input normalisation the data was trained with is inside it, so the
loaded model takes the samples as the dataset yields them before normalisation (for
``sklearn.digits``: pixels scaled to [0, 1]).

Also: a run's data as MLflow dataset inputs (the runs table's Datasets column) and the split fingerprint tag.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from runner.errors import TrackingError, mask_secrets

if TYPE_CHECKING:
    import torch
    from mlflow.entities import Dataset


MODEL_NAME = "model"


def with_normalization(
    model: torch.nn.Module, normalization: tuple[float, float] | None, channels: int
) -> torch.nn.Module:
    """``model`` behind ``torchvision.transforms.Normalize(mean, std)`` (the same value per channel), or ``model``.

    ``torchvision.transforms.Normalize`` is an ``nn.Module`` working on ``(N, C, H, W)`` tensors, so
    the saved model needs torch and torchvision only to load.

    Args:
        normalization: ``(mean, std)`` of the training data, or ``None`` when it was not normalised.
    """
    if normalization is None:
        return model
    import torch
    from torchvision.transforms import Normalize

    mean, std = normalization
    return torch.nn.Sequential(Normalize([mean] * channels, [std] * channels), model)


@contextlib.contextmanager
def _tracking_uri(uri: str | None) -> Iterator[None]:
    """Point MLflow's fluent API at ``uri`` for the duration (``mlflow.pytorch.log_model`` reads it), then restore."""
    import mlflow
    from mlflow.tracking._tracking_service import utils

    before_uri, before_env = utils._tracking_uri, os.environ.get("MLFLOW_TRACKING_URI")
    if uri is not None:
        mlflow.set_tracking_uri(uri)
    try:
        yield
    finally:
        mlflow.set_tracking_uri(before_uri)  # type: ignore[arg-type]  # None unsets the variable: put the user's back
        if before_env is not None:
            os.environ["MLFLOW_TRACKING_URI"] = before_env


def log_model(
    uri: str | None,
    run_id: str,
    model: torch.nn.Module,
    example: torch.Tensor | dict[str, torch.Tensor],
    *,
    step: int = 0,
    normalization: tuple[float, float] | None = None,
) -> str:
    """Log the unwrapped model as a LoggedModel of run ``run_id`` (``mlflow.pytorch.log_model``).

    The LoggedModel is created with ``MlflowClient.create_logged_model`` in the run's experiment,
    then ``mlflow.pytorch.log_model(..., model_id=..., run_id=...)`` saves it, links it to the run's
    metrics at ``step`` and uploads it; MLflow's fluent run stack is neither used nor changed (the
    driver, not this worker, ends the run). The model is pickled (MLflow's ``pt2`` export needs a
    traceable forward, which user models need not have).

    Args:
        model: The unwrapped ``nn.Module``; moved to CPU and put in eval mode.
        example: One input before normalisation, shape ``(1, *input_shape)``, or a dict of such tensors for
            a model that takes dict batches (``forward(**batch)``): the input example, and with the
            model's output on it (tensor inputs only), the signature.
        step: The run's last optimizer step: the metrics logged there are linked to the model.
        normalization: ``(mean, std)`` the training data was normalised with; put inside the model.

    Returns:
        The LoggedModel's id (``models:/<id>`` loads it).

    Raises:
        mlflow.exceptions.MlflowException: MLflow cannot save or upload the model.
    """
    import mlflow.pytorch
    import torch
    from mlflow.models import infer_signature
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    run = client.get_run(run_id)
    if isinstance(example, dict):
        served = model.to("cpu").eval()
        shown: Any = {k: v.detach().cpu().numpy() for k, v in example.items()}
        signature = infer_signature(shown)
    else:
        x = example.detach().cpu()
        channels = int(x.shape[1]) if x.dim() >= 3 else 1
        served = with_normalization(model.to("cpu").eval(), normalization, channels).eval()
        with torch.no_grad():
            y = served(x)
        shown = x.numpy()
        signature = infer_signature(shown, y.detach().numpy())
    logged = client.create_logged_model(
        run.info.experiment_id, name=MODEL_NAME, source_run_id=run_id, params=dict(run.data.params)
    )
    with _tracking_uri(uri):
        mlflow.pytorch.log_model(
            served,
            name=MODEL_NAME,
            model_id=logged.model_id,
            run_id=run_id,
            step=step,
            input_example=shown,
            signature=signature,
            serialization_format="pickle",
        )
    return str(logged.model_id)


VAL_SPLIT_TAG = "runner.data.val_split_sha256"
ATTEMPTS = 5  # tries of a transient store error, 0.2 s doubling pauses between them (3 s in all)


@dataclass(frozen=True)
class DatasetRecord:
    """One part of a run's data, as MLflow shows it.

    Attributes:
        digest: Short digest of the part (dataset settings and members).
        context: ``training`` or ``validation`` (input tag ``mlflow.data.context``).
        source: Where the samples are read from (a folder, ``sklearn.datasets.load_digits``, a factory).
        input_shape: Shape of one sample, e.g. ``(1, 8, 8)``.
    """

    name: str
    digest: str
    context: str
    num_samples: int
    source: str
    input_shape: tuple[int, ...]


def record_data(uri: str, run_id: str, records: list[DatasetRecord], val_split_sha256: str | None) -> None:
    """Log the parts of a run's data as dataset inputs and tag the validation split's fingerprint.

    Args:
        records: The parts to log (training first).
        val_split_sha256: Hex SHA-256 of the validation split, or ``None`` (no tag).

    Raises:
        TrackingError: MLflow rejects the request.
    """
    from mlflow.entities import DatasetInput, InputTag
    from mlflow.tracking import MlflowClient

    inputs = [DatasetInput(_dataset(r), tags=[InputTag("mlflow.data.context", r.context)]) for r in records]
    client = MlflowClient(tracking_uri=uri)
    for attempt in range(ATTEMPTS):
        try:
            if inputs:
                client.log_inputs(run_id, datasets=inputs)
            if val_split_sha256:
                client.set_tag(run_id, VAL_SPLIT_TAG, val_split_sha256)
            return
        except Exception as exc:
            # Runs of one experiment logging the same dataset at once (sweep workers) race on its row: the
            # loser's "UNIQUE constraint failed: datasets..." means it is logged, and the next try links it.
            if attempt + 1 < ATTEMPTS and _transient(exc):
                time.sleep(0.2 * 2**attempt)
                continue
            raise TrackingError(
                f"could not record the datasets of run {run_id} at {mask_secrets(uri)}: {type(exc).__name__}: {exc}"
            ) from exc


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

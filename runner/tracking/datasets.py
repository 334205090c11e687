"""A run's data as MLflow dataset inputs (the runs table's Datasets column) and the split fingerprint tag.

Each part (training, validation) is logged with ``MlflowClient.log_inputs`` as an
``mlflow.entities.Dataset``: its name, a digest of its settings and members, its source, the
tensor schema of one sample and a profile with the sample count; the input tag
``mlflow.data.context`` says which part it is (MLflow's convention, as ``mlflow.log_input``
sets it). The tag ``runner.data.val_split_sha256`` makes runs on the same validation samples
visibly comparable (docs/design.md §11). mlflow is imported inside functions.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from runner.errors import TrackingError, mask_secrets

if TYPE_CHECKING:
    from mlflow.entities import Dataset

VAL_SPLIT_TAG = "runner.data.val_split_sha256"
ATTEMPTS = 5  # tries of a transient store error, 0.2 s doubling pauses between them (3 s in all)


@dataclass(frozen=True)
class DatasetRecord:
    """One part of a run's data, as MLflow shows it.

    Attributes:
        name: E.g. ``sklearn.digits train``.
        digest: Short digest of the part (dataset settings and members).
        context: ``training`` or ``validation`` (input tag ``mlflow.data.context``).
        num_samples: Samples in the part.
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
        uri: Tracking URI of the run.
        run_id: The run.
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

"""Log a trained model to its MLflow run with ``mlflow.pytorch.log_model``: a LoggedModel linked to the run.

MLflow 3 records a model as a LoggedModel: logged with ``step`` = the run's last step, it takes
the run's params and is linked to the metrics of that step, so the run page and the Models tab
show which numbers the model scored. The model is logged with an input example and a signature
(inferred from it), and the input normalisation the data was trained with is inside it, so the
loaded model takes the samples as the dataset yields them before normalisation (for
``sklearn.digits``: pixels scaled to [0, 1]).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

MODEL_NAME = "model"


def with_normalization(
    model: torch.nn.Module, normalization: tuple[float, float] | None, channels: int
) -> torch.nn.Module:
    """``model`` behind ``torchvision.transforms.Normalize(mean, std)`` (the same value per channel), or ``model``.

    ``torchvision.transforms.Normalize`` is an ``nn.Module`` working on ``(N, C, H, W)`` tensors, so
    the saved model needs torch and torchvision only to load.

    Args:
        model: The trained network, on CPU.
        normalization: ``(mean, std)`` of the training data, or ``None`` when it was not normalised.
        channels: Channels ``C`` of one input.
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
        uri: Tracking URI of the run.
        run_id: The run.
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

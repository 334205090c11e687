"""Log a trained model to its MLflow run in the pytorch flavour."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def log_model(
    uri: str | None, run_id: str, model: torch.nn.Module, example: torch.Tensor | dict[str, torch.Tensor]
) -> None:
    """Save the unwrapped model in MLflow's pytorch flavour and upload it as artifact ``model/``.

    ``mlflow.pytorch.save_model`` + ``MlflowClient.log_artifacts`` keep MLflow's fluent run
    stack untouched (the driver, not this worker, ends the run). The model is pickled (MLflow's
    ``pt2`` export needs a traceable forward, which user models need not have).

    Args:
        uri: Tracking URI of the run.
        run_id: The run.
        model: The unwrapped ``nn.Module``; moved to CPU and put in eval mode.
        example: One input of shape ``(1, *input_shape)``, or a dict of them for a dict batch; it gives the
            model signature.

    Raises:
        mlflow.exceptions.MlflowException: MLflow cannot save or upload the model.
    """
    import tempfile

    import mlflow.pytorch
    from mlflow.tracking import MlflowClient

    with tempfile.TemporaryDirectory() as tmp:
        model = model.to("cpu").eval()
        shown = {k: v.cpu().numpy() for k, v in example.items()} if isinstance(example, dict) else example.cpu().numpy()
        mlflow.pytorch.save_model(model, f"{tmp}/model", input_example=shown, serialization_format="pickle")
        MlflowClient(tracking_uri=uri).log_artifacts(run_id, f"{tmp}/model", "model")

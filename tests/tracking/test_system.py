"""On a GPU machine, `tracking.system_metrics = true` records MLflow's GPU system metrics (through NVML)."""

from __future__ import annotations

import os

import pytest
import torch
from mlflow.tracking import MlflowClient

from runner.cli import main
from runner.devices.inventory import probe_inventory
from tests.helpers import exec_args

pytestmark = [pytest.mark.cuda, pytest.mark.timeout(300)]

_GAP = None if torch.backends.cuda.is_built() and torch.cuda.device_count() > 0 else "needs a CUDA GPU"


@pytest.mark.skipif(_GAP is not None, reason=_GAP or "")
def test_nvml_inventory_and_gpu_system_metrics(write_spec, store: str, monkeypatch: pytest.MonkeyPatch) -> None:
    inventory = probe_inventory(os.environ)
    assert inventory.source.startswith("NVML") and len(inventory.gpus) == torch.cuda.device_count()
    monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "0.2")
    monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_SAMPLES_BEFORE_LOGGING", "1")
    spec = write_spec(
        text=write_spec().read_text().replace('accelerator = "cpu"', 'accelerator = "cuda"\nids = [0]'), name="gpu.toml"
    )
    sets = [
        "tracking.system_metrics=true",
        "data.num_samples=40000",
        "data.input_shape=[512]",
        "model.kwargs={ hidden = [2048, 2048] }",
        "data.batch_size=64",
        "train.epochs=3",
        "train.log_every_n_steps=50",
    ]
    assert main(exec_args(spec, *sets)) == 0
    client = MlflowClient(store)
    (run,) = client.search_runs([client.get_experiment_by_name("tests").experiment_id])
    gpu = {k for k in run.data.metrics if k.startswith("system/gpu_0_")}
    assert {"system/gpu_0_memory_usage_megabytes", "system/gpu_0_utilization_percentage"} <= gpu, sorted(
        run.data.metrics
    )
    assert run.data.metrics["system/gpu_0_memory_usage_megabytes"] > 0

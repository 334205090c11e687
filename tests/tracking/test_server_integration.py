"""runner.tracking against a real `mlflow server` process on 127.0.0.1 (REST over HTTP)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from runner.errors import TrackingError
from runner.spec.loading import load_spec
from runner.tracking.mlflow_tracker import MlflowTracker
from runner.tracking.runs import end_run, start_run
from runner.tracking.uri import check_reachable
from tests.helpers import SMALL, MlflowServer, spec_text

SPEC = spec_text(SMALL, name="served", tracking={"experiment": "over-http"})

SERVER_START_TIMEOUT_S = 120


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch, tmp_path):
    for key in list(os.environ):
        if key.startswith("MLFLOW_"):
            monkeypatch.delenv(key)
    monkeypatch.chdir(tmp_path)


@pytest.fixture
def mlflow_server(tmp_path):
    """An `mlflow server` of this test's own (the test stops it); stopped, with its process group, at the end."""
    server = MlflowServer(tmp_path)
    try:
        server.start(timeout_s=SERVER_START_TIMEOUT_S)
        yield server
    finally:
        server.stop()


@pytest.mark.integration
@pytest.mark.timeout(180)
def test_run_over_http_then_server_goes_away(tmp_path, mlflow_server, monkeypatch):
    import requests
    from mlflow.tracking import MlflowClient

    url = mlflow_server.url
    spec_path = tmp_path / "served.toml"
    spec_path.write_text(SPEC)
    handle = start_run(load_spec(spec_path), {"accelerator": "cpu", "world_size": 1}, uri=url)
    assert handle.uri == url

    tracker = MlflowTracker(url, handle.run_id, flush_every_s=0.5)
    for step in range(1500):  # two log_batch requests of <= 1000 metrics
        tracker.log_metrics({"train/loss": 1.0 / (step + 1)}, step=step)
    tracker.set_tags({"phase": "done"})
    tracker.close()
    end_run(url, handle.run_id, "FINISHED")

    # Read back through the REST API directly, not only through the client.
    resp = requests.get(f"{url}/api/2.0/mlflow/runs/get", params={"run_id": handle.run_id}, timeout=10)
    resp.raise_for_status()
    run = resp.json()["run"]
    assert run["info"]["status"] == "FINISHED"
    params = {p["key"]: p["value"] for p in run["data"]["params"]}
    assert params["optim.lr"] == "0.1" and params["name"] == "served"
    tags = {t["key"]: t["value"] for t in run["data"]["tags"]}
    assert tags["phase"] == "done" and tags["runner.spec.sha256"]

    client = MlflowClient(tracking_uri=url)
    hist = sorted(client.get_metric_history(handle.run_id, "train/loss"), key=lambda m: m.step)
    assert [m.step for m in hist] == list(range(1500))
    arts = {f.path for f in client.list_artifacts(handle.run_id, "spec")}
    assert arts == {"spec/served.toml", "spec/resolved.toml", "spec/plan.json"}
    # artifacts went through the server's proxy into --artifacts-destination
    assert any(Path(tmp_path, "server-artifacts").rglob("resolved.toml"))

    # The server goes away mid-run: the loss is reported on close, not swallowed.
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    run_id = client.create_run(handle.experiment_id).info.run_id
    tracker = MlflowTracker(url, run_id, flush_every_s=3600)
    tracker.log_metrics({"m": 1.0}, step=0)
    tracker.flush()
    mlflow_server.stop()
    tracker.log_metrics({"m": 2.0}, step=1)
    t0 = time.monotonic()
    with pytest.raises(TrackingError, match="1 items were not recorded"):
        tracker.close(timeout_s=60)
    assert time.monotonic() - t0 < 30
    with pytest.raises(TrackingError, match="mlflow server"):
        check_reachable(url, timeout_s=2.0)

"""runner.tracking against a real `mlflow server` process on 127.0.0.1 (REST over HTTP)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from runner.errors import TrackingError
from runner.spec.loading import load_spec
from runner.tracking.mlflow_tracker import MlflowTracker
from runner.tracking.runs import end_run, start_run
from runner.tracking.uri import check_reachable
from tests.helpers import SMALL, spec_text

SPEC = spec_text(SMALL, name="served", tracking={"experiment": "over-http"})

SERVER_START_TIMEOUT_S = 120


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch, tmp_path):
    for key in list(os.environ):
        if key.startswith("MLFLOW_"):
            monkeypatch.delenv(key)
    monkeypatch.chdir(tmp_path)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A running `mlflow server` child process (in its own process group)."""

    def __init__(self, proc: subprocess.Popen, url: str):
        self.proc, self.url = proc, url

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=20)


@pytest.fixture
def mlflow_server(tmp_path):
    """Start `mlflow server` on a free port; yield it; stop its whole process group."""
    port = free_port()
    log_path = tmp_path / "server.log"
    cmd = [
        sys.executable, "-m", "mlflow", "server",
        "--host", "127.0.0.1",
        "--port", str(port),
        "--workers", "1",
        "--backend-store-uri", f"sqlite:///{tmp_path}/server.db",
        "--artifacts-destination", str(tmp_path / "server-artifacts"),
    ]  # fmt: skip
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path, start_new_session=True)
    server = Server(proc, f"http://127.0.0.1:{port}")
    url = server.url
    try:
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"mlflow server exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
            try:
                check_reachable(url, timeout_s=1.0)
                break
            except TrackingError:
                if time.monotonic() > deadline:
                    pytest.fail(
                        f"mlflow server not healthy after {SERVER_START_TIMEOUT_S} s:\n{log_path.read_text()[-3000:]}"
                    )
                time.sleep(0.5)
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

"""runner.tracking against a real `mlflow server` process on 127.0.0.1 (REST over HTTP)."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from runner.errors import TrackingError
from runner.spec.loading import load_spec
from runner.tracking.runs import TrackedRun, start_run
from runner.tracking.trackers import MlflowTracker
from runner.tracking.uri import check_reachable
from tests.helpers import REPO, SMALL, MlflowServer, exec_args, spec_text, write_spec_file

SPEC = spec_text(SMALL, name="served", tracking={"experiment": "over-http"})

SERVER_START_TIMEOUT_S = 300  # a loaded 2-core machine takes over 120 s to start it


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


@pytest.fixture(scope="module")
def shared_server(tmp_path_factory):
    """An `mlflow server` for the tests that leave it running, started once (its store: ``server.folder``)."""
    server = MlflowServer(tmp_path_factory.mktemp("served"))
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
    assert handle.status == "RUNNING"

    tracker = MlflowTracker(TrackedRun(url, handle.run_id), flush_every_s=0.5)
    for step in range(1500):  # two log_batch requests of <= 1000 metrics
        tracker.log_metrics({"train/loss": 1.0 / (step + 1)}, step=step)
    tracker.set_tags({"phase": "done"})
    tracker.close()
    TrackedRun(url, handle.run_id).end("FINISHED")

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
    tracker = MlflowTracker(TrackedRun(url, run_id), flush_every_s=3600)
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


def _runner(cwd: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    import sys

    clean = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    clean["PYTHONPATH"] = os.pathsep.join([str(REPO), clean.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, "-m", "runner", *args], cwd=cwd, env={**clean, **env}, capture_output=True, text=True,
        timeout=240,
    )  # fmt: skip


@pytest.mark.integration
@pytest.mark.timeout(900)
def test_credentials_in_the_tracking_uri_leave_no_trace(tmp_path, shared_server):
    """A password in tracking.uri (--set or MLFLOW_TRACKING_URI) is in no run field, artifact, file or printed line."""
    from mlflow.tracking import MlflowClient

    mlflow_server = shared_server
    host = mlflow_server.url.removeprefix("http://")
    spec = write_spec_file(tmp_path / "creds.toml", name="creds", train={"epochs": 1}, tracking={"experiment": "c"})
    given = f'tracking.uri="http://alice:s3cret@{host}"'
    quoted = f'tracking.uri="http://dan:it\'s@n0t@{host}"'  # a quote and an unencoded @, as urllib reads them
    printed = [_runner(tmp_path, "plan", str(spec), "--set", given)]
    printed.append(_runner(tmp_path, *exec_args(spec, given)))
    printed.append(_runner(tmp_path, *exec_args(spec), MLFLOW_TRACKING_URI=f"http://bob:t0psecret@{host}"))
    printed.append(_runner(tmp_path, *exec_args(spec, 'tracking.uri="postgresql://carol:pgs3cret@127.0.0.1:1/db"')))
    bench = ("bench", str(spec), "--modes", "none", "--steps", "2", "--warmup", "1", "--repeats", "1:1")
    printed.append(_runner(tmp_path, *bench, "--out", str(tmp_path / "bench"), "--set", quoted))
    assert [p.returncode for p in printed] == [0, 0, 0, 2, 0], [p.stderr for p in printed]
    secrets = ("s3cret", "t0psecret", "pgs3cret", "it's", "s@n0t", "n0t@", "it%27s")
    for proc in printed:
        for secret in secrets:
            assert secret not in proc.stdout + proc.stderr, (secret, proc.stdout, proc.stderr)
    assert "alice:***@" in printed[0].stdout  # the plan names the store, masked; the run's link has no credentials
    assert f"open the run: {mlflow_server.url}/#/experiments/" in printed[2].stdout
    assert "carol:***@127.0.0.1:1" in printed[3].stderr
    assert json.loads((tmp_path / "bench" / "bench.json").read_text())["tracking_uri"] == f"http://dan:***@{host}"

    client = MlflowClient(mlflow_server.url)
    runs = client.search_runs([client.get_experiment_by_name("c").experiment_id])
    assert len(runs) == 2 and {r.info.status for r in runs} == {"FINISHED"}
    runs += client.search_runs([client.get_experiment_by_name("c/bench").experiment_id])
    assert len(runs) == 4, [r.info.run_name for r in runs]  # the bench's parent and its one configuration
    for run in runs:
        fields = [run.info.run_name, *run.data.params.items(), *run.data.tags.items()]
        downloaded = Path(client.download_artifacts(run.info.run_id, "", str(tmp_path / run.info.run_id)))
        fields += [p.read_bytes().decode(errors="replace") for p in downloaded.rglob("*") if p.is_file()]
        assert {"spec/plan.json", "spec/resolved.toml"} <= {
            p.relative_to(downloaded).as_posix() for p in downloaded.rglob("*")
        } or run.data.tags.get("runner.bench") == "parent"
        for secret in secrets:
            assert not [f for f in fields if secret in str(f)], secret
    for path in [*tmp_path.rglob("*"), *mlflow_server.folder.rglob("*")]:  # checkpoints, bench.json, the store
        if path.is_file():
            data = path.read_bytes()
            assert not [s for s in secrets if s.encode() in data], path


@pytest.mark.integration
@pytest.mark.timeout(600)
def test_a_served_run_resumes_and_exports_from_another_directory(tmp_path, shared_server):
    """Checkpoints are found through the run's tag ``runner.checkpoint_dir``, not the working directory."""
    mlflow_server = shared_server
    import torch
    from mlflow.tracking import MlflowClient

    spec = write_spec_file(tmp_path / "away.toml", name="away", train={"epochs": 1}, tracking={"experiment": "a"})
    uri = f'tracking.uri="{mlflow_server.url}"'
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    assert _runner(tmp_path, *exec_args(spec, uri)).returncode == 0
    client = MlflowClient(mlflow_server.url)
    (run,) = client.search_runs([client.get_experiment_by_name("a").experiment_id])
    folder = Path(run.data.tags["runner.checkpoint_dir"])
    assert folder.parent == tmp_path / "checkpoints" and any(folder.iterdir())

    exported = _runner(elsewhere, "export", run.info.run_id, "--tracking-uri", mlflow_server.url, "--out", "m.pt")
    assert exported.returncode == 0, exported.stderr
    assert torch.load(elsewhere / "m.pt", weights_only=True).keys()
    more = ("train.epochs=2", "--allow-spec-change", "train.epochs", "--resume", run.info.run_id)
    resumed = _runner(elsewhere, *exec_args(spec, uri, *more[:1]), *more[1:])
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming from step-" in resumed.stdout + resumed.stderr, resumed.stdout
    assert not (elsewhere / "checkpoints").exists()  # the run's own folder holds the new checkpoints too
    assert client.get_run(run.info.run_id).data.tags["runner.checkpoint_dir"] == str(folder)

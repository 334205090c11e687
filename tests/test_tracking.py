"""Tests of runner.tracking.runs against a throw-away sqlite MLflow store (CPU, no server)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from types import SimpleNamespace

import pytest

from runner.errors import TrackingError
from runner.spec.loading import load_spec
from runner.tracking import runs as tracking
from runner.tracking.runs import RunHandle, check_reachable, end_run, resolve_tracking_uri, start_run
from runner.tracking.trackers import MlflowTracker, NullTracker, param_value

SPEC = """\
name = "demo"
description = "a test run"
seed = 1
tags = { team = "vision" }

[model]
name = "mlp"
kwargs = { hidden = [32, 16] }

[data]
dataset = "synthetic"
batch_size = 8

[optim]
lr = 1.0

[tracking]
experiment = "exp-demo"
"""

PLAN = {
    "accelerator": "cpu",
    "mode": "none",
    "devices": [{"id": 0, "name": "Fake GPU A"}, {"id": 1, "name": "Fake GPU B"}],
    "world_size": 1,
}

needs_git = pytest.mark.skipif(shutil.which("git") is None, reason="needs the git executable")


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch, tmp_path, git_identity):
    """Restore MLFLOW_* variables, isolate git config, and keep MLflow's ./mlruns inside tmp_path."""
    for key in list(os.environ):
        if key.startswith("MLFLOW_"):
            monkeypatch.delenv(key)
    work = tmp_path / "cwd"
    work.mkdir()
    monkeypatch.chdir(work)
    yield
    import mlflow

    while mlflow.active_run() is not None:
        mlflow.end_run()


@pytest.fixture
def uri(tmp_path) -> str:
    return f"sqlite:///{tmp_path}/mlflow.db"


@pytest.fixture
def client(uri):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout


def write_spec(folder: Path, text: str = SPEC, name: str = "demo.toml") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(text)
    return path


def make_repo(root: Path, text: str = SPEC) -> Path:
    """A committed git repo holding experiments/demo.toml; returns the spec path."""
    spec_path = write_spec(root / "experiments", text)
    git(root, "init", "-q", "-b", "main")
    git(root, "add", "-A")
    git(root, "commit", "-q", "-m", "init")
    return spec_path


def artifact_paths(client, run_id: str, path: str | None = None) -> set[str]:
    out: set[str] = set()
    for f in client.list_artifacts(run_id, path):
        out |= artifact_paths(client, run_id, f.path) if f.is_dir else {f.path}
    return out


def read_artifact(client, run_id: str, path: str, tmp_path: Path) -> str:
    dst = tmp_path / "dl"
    dst.mkdir(exist_ok=True)
    return Path(client.download_artifacts(run_id, path, str(dst))).read_text()


# --------------------------------------------------------------------------- URI


def spec_with_uri(value):
    return SimpleNamespace(tracking=SimpleNamespace(uri=value))


def test_resolve_uri_precedence(tmp_path):
    env = {"MLFLOW_TRACKING_URI": "http://env-host:5000"}
    assert resolve_tracking_uri(spec_with_uri("http://spec-host:5000"), env=env) == "http://spec-host:5000"
    assert resolve_tracking_uri(spec_with_uri(None), env=env) == "http://env-host:5000"
    assert (
        resolve_tracking_uri(spec_with_uri(None), env={}, cwd=tmp_path) == f"sqlite:///{tmp_path.resolve()}/mlflow.db"
    )
    assert resolve_tracking_uri(spec_with_uri(None), env={"MLFLOW_TRACKING_URI": "  "}, cwd=tmp_path).startswith(
        "sqlite:////"
    )


def test_resolve_uri_makes_local_paths_absolute(tmp_path):
    def r(value):
        return resolve_tracking_uri(spec_with_uri(value), env={}, cwd=tmp_path)

    base = tmp_path.resolve()
    assert r("sqlite:///runs/m.db") == f"sqlite:///{base}/runs/m.db"
    assert r("sqlite:///m.db?timeout=30") == f"sqlite:///{base}/m.db?timeout=30"
    assert r("sqlite:////abs/m.db") == "sqlite:////abs/m.db"
    assert r("mlruns") == str(base / "mlruns")
    assert r("file:mlruns") == (base / "mlruns").as_uri()
    assert r("file:///abs/mlruns") == "file:///abs/mlruns"
    assert r("https://host/mlflow") == "https://host/mlflow"
    assert r("databricks") == "databricks"
    assert r("postgresql://u@h/db") == "postgresql://u@h/db"
    # from the environment too, resolved once
    env = {"MLFLOW_TRACKING_URI": "sqlite:///x.db"}
    assert resolve_tracking_uri(spec_with_uri(None), env=env, cwd=tmp_path) == f"sqlite:///{base}/x.db"


# --------------------------------------------------------------------------- reachability


def test_check_reachable_sqlite(tmp_path):
    check_reachable(f"sqlite:///{tmp_path}/ok.db")
    missing = tmp_path / "no" / "such"
    with pytest.raises(TrackingError, match="does not exist") as err:
        check_reachable(f"sqlite:///{missing}/m.db")
    assert str(missing) in str(err.value)
    assert not (tmp_path / "no").exists() and not (tmp_path / "ok.db").exists()


@pytest.mark.skipif(os.geteuid() == 0, reason="root can write anywhere")
def test_check_reachable_sqlite_read_only_folder(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        with pytest.raises(TrackingError, match="not writable"):
            check_reachable(f"sqlite:///{ro}/m.db")
    finally:
        ro.chmod(0o755)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_check_reachable_closed_port_fails_fast():
    url = f"http://127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    with pytest.raises(TrackingError) as err:
        check_reachable(url, timeout_s=2.0)
    assert time.monotonic() - t0 < 10
    assert url in str(err.value) and "mlflow server" in str(err.value) and "MLFLOW_TRACKING_URI" in str(err.value)


def test_check_reachable_rejects_a_server_that_is_not_mlflow():
    class NotFound(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(404)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), NotFound)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        with pytest.raises(TrackingError, match="does not look like an MLflow"):
            check_reachable(f"http://127.0.0.1:{server.server_address[1]}", timeout_s=2.0)
    finally:
        server.shutdown()
        server.server_close()


# --------------------------------------------------------------------------- start_run


def test_param_value_is_stable():
    assert param_value(True) == "true" and param_value(False) == "false"
    assert param_value(1) == "1" and param_value(1.0) == "1.0" and param_value(1e-5) == "1e-05"
    assert param_value([3, 32, 32]) == "[3, 32, 32]"
    assert param_value("sgd") == "sgd"


@needs_git
def test_start_run_records_params_tags_and_artifacts(tmp_path, uri, client, monkeypatch):
    spec_path = make_repo(tmp_path / "repo")
    other = tmp_path / "other-repo"  # the cwd is a different repository
    other.mkdir()
    git(other, "init", "-q")
    monkeypatch.chdir(other)
    loaded = load_spec(spec_path)

    handle = start_run(loaded, PLAN, uri=uri)

    assert isinstance(handle, RunHandle) and handle.uri == uri
    exp = client.get_experiment_by_name("exp-demo")
    assert exp is not None and exp.experiment_id == handle.experiment_id and handle.experiment_name == "exp-demo"
    runs = client.search_runs([exp.experiment_id])
    assert [r.info.run_id for r in runs] == [handle.run_id]
    run = runs[0]
    assert run.info.status == "RUNNING"

    params = run.data.params
    assert params["name"] == "demo"
    assert params["seed"] == "1"
    assert params["optim.lr"] == "1.0"
    assert params["data.batch_size"] == "8"
    assert params["data.shuffle"] == "true"
    assert params["model.kwargs.hidden"] == "[32, 16]"
    assert params["tracking.experiment"] == "exp-demo"

    tags = run.data.tags
    assert tags["mlflow.source.git.commit"] == git(spec_path.parent, "rev-parse", "HEAD").strip()
    assert tags["runner.git.branch"] == "main"
    assert tags["runner.git.dirty"] == "false"
    assert tags["runner.spec.path"] == "experiments/demo.toml"
    assert tags["runner.spec.sha256"] == loaded.sha256
    assert tags["runner.torch_version"]
    assert tags["runner.cuda_version"]
    assert tags["runner.devices"] == "Fake GPU A, Fake GPU B"
    assert tags["runner.world_size"] == "1"
    assert tags["runner.hostname"] == socket.gethostname()
    assert tags["mlflow.note.content"] == "a test run"
    assert tags["team"] == "vision"
    assert "mlflow.parentRunId" not in tags

    assert artifact_paths(client, handle.run_id) == {"spec/demo.toml", "spec/resolved.toml", "spec/plan.json"}
    assert read_artifact(client, handle.run_id, "spec/demo.toml", tmp_path) == SPEC
    assert 'name = "demo"' in read_artifact(client, handle.run_id, "spec/resolved.toml", tmp_path)
    assert '"Fake GPU A"' in read_artifact(client, handle.run_id, "spec/plan.json", tmp_path)


@needs_git
def test_start_run_dirty_repository_logs_diff(tmp_path, uri, client):
    spec_path = make_repo(tmp_path / "repo")
    (spec_path.parent.parent / "train_helper.py").write_text("untracked = True\n")
    spec_path.write_text(SPEC.replace("lr = 1.0", "lr = 0.5"))
    handle = start_run(load_spec(spec_path), PLAN, run_name="r1", extra_tags={"team": "override"}, uri=uri)

    run = client.get_run(handle.run_id)
    assert run.data.tags["runner.git.dirty"] == "true"
    assert run.data.tags["runner.git.untracked_files"] == "1"
    assert run.data.tags["team"] == "override"
    assert run.info.run_name == "r1" and handle.run_name == "r1"
    assert run.data.params["optim.lr"] == "0.5"
    arts = artifact_paths(client, handle.run_id)
    assert {"git/diff.patch", "git/untracked.txt"} <= arts
    diff = read_artifact(client, handle.run_id, "git/diff.patch", tmp_path)
    assert "-lr = 1.0" in diff and "+lr = 0.5" in diff
    assert "train_helper.py" in read_artifact(client, handle.run_id, "git/untracked.txt", tmp_path)


def test_start_run_outside_git_and_experiment_reuse(tmp_path, uri, client):
    spec_path = write_spec(tmp_path / "loose")
    loaded = load_spec(spec_path)
    first = start_run(loaded, {}, uri=uri)
    second = start_run(loaded, {}, uri=uri)
    assert first.experiment_id == second.experiment_id and first.run_id != second.run_id
    tags = client.get_run(first.run_id).data.tags
    assert tags["runner.spec.path"] == str(spec_path.resolve())
    assert "mlflow.source.git.commit" not in tags and "runner.git.dirty" not in tags
    assert not any(p.startswith("git/") for p in artifact_paths(client, first.run_id))


def test_start_run_defaults_experiment_to_spec_name(tmp_path, uri, client):
    spec_path = write_spec(tmp_path / "loose", SPEC.replace('experiment = "exp-demo"', 'run_name = "from-spec"'))
    handle = start_run(load_spec(spec_path), {}, uri=uri)
    assert handle.experiment_name == "demo"
    assert client.get_run(handle.run_id).info.run_name == "from-spec"


def test_start_run_deleted_experiment_is_a_clear_error(tmp_path, uri, client):
    client.delete_experiment(client.create_experiment("exp-demo"))
    with pytest.raises(TrackingError, match="is deleted"):
        start_run(load_spec(write_spec(tmp_path / "loose")), {}, uri=uri)


def test_start_run_truncates_long_params(tmp_path, uri, client):
    from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH

    blob = "x" * 10_000
    text = SPEC.replace("kwargs = { hidden = [32, 16] }", f'kwargs = {{ blob = "{blob}" }}')
    handle = start_run(load_spec(write_spec(tmp_path / "loose", text)), {}, uri=uri)
    value = client.get_run(handle.run_id).data.params["model.kwargs.blob"]
    assert len(value) <= MAX_PARAM_VAL_LENGTH
    assert value.startswith("xxxx") and "truncated from 10000 chars" in value and "resolved.toml" in value
    assert blob in read_artifact(client, handle.run_id, "spec/resolved.toml", tmp_path)


def test_start_run_with_active_fluent_run(tmp_path, uri, client, monkeypatch):
    import mlflow

    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    loaded = load_spec(write_spec(tmp_path / "loose"))
    with mlflow.start_run() as outer:
        with pytest.raises(TrackingError, match=r"already active.*mlflow\.end_run\(\).*nested=True") as err:
            start_run(loaded, {}, uri=uri)
        assert outer.info.run_id in str(err.value)
        child = start_run(loaded, {}, uri=uri, nested=True)
        assert mlflow.active_run().info.run_id == outer.info.run_id  # the fluent stack is untouched
    assert client.get_run(child.run_id).data.tags["mlflow.parentRunId"] == outer.info.run_id
    # only the outer run and the nested child exist: the refused call created nothing
    exp = client.get_experiment_by_name("exp-demo")
    assert [r.info.run_id for r in client.search_runs([exp.experiment_id])] == [child.run_id]


def test_start_run_unreachable_store_creates_nothing(tmp_path):
    loaded = load_spec(write_spec(tmp_path / "loose"))
    with pytest.raises(TrackingError):
        start_run(loaded, {}, uri=f"sqlite:///{tmp_path}/missing/mlflow.db")
    assert not (tmp_path / "missing").exists()


# --------------------------------------------------------------------------- trackers


def new_run(client) -> str:
    exp = client.create_experiment(f"e{time.monotonic_ns()}")
    return client.create_run(exp).info.run_id


def test_tracker_logs_2500_metrics_in_order(uri, client):
    run_id = new_run(client)
    tracker = MlflowTracker(uri, run_id, flush_every_s=0.2)
    for step in range(2500):
        tracker.log_metrics({"train/loss": 1.0 / (step + 1), "lr": 0.1}, step=step)
    tracker.close()
    hist = client.get_metric_history(run_id, "train/loss")
    assert len(hist) == 2500
    ordered = sorted(hist, key=lambda m: (m.step, m.timestamp))
    assert [m.step for m in ordered] == list(range(2500))
    assert all(isinstance(m.step, int) for m in ordered)
    assert [m.value for m in ordered] == [1.0 / (s + 1) for s in range(2500)]
    ts = [m.timestamp for m in ordered]
    assert ts == sorted(ts)
    assert len(client.get_metric_history(run_id, "lr")) == 2500


def test_tracker_flush_semantics(uri, client):
    run_id = new_run(client)
    tracker = MlflowTracker(uri, run_id, flush_every_s=3600)
    for step in range(10):
        tracker.log_metrics({"m": float(step)}, step=step)
    time.sleep(0.3)
    assert client.get_metric_history(run_id, "m") == []  # nothing sent before it is due
    tracker.flush()
    assert [m.step for m in client.get_metric_history(run_id, "m")] == list(range(10))
    tracker.flush()  # nothing new: returns at once
    tracker.close()
    tracker.close()  # idempotent
    with pytest.raises(TrackingError, match="closed"):
        tracker.log_metrics({"m": 1.0}, step=11)


def test_tracker_sends_when_batch_is_full_or_due(uri, client):
    run_id = new_run(client)
    tracker = MlflowTracker(uri, run_id, flush_every_s=3600, max_batch=5)
    for step in range(5):
        tracker.log_metrics({"full": 1.0}, step=step)
    deadline = time.monotonic() + 10
    while len(client.get_metric_history(run_id, "full")) < 5 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(client.get_metric_history(run_id, "full")) == 5
    tracker.close()

    timed = MlflowTracker(uri, run_id, flush_every_s=0.2)
    timed.log_metrics({"due": 1.0}, step=0)
    deadline = time.monotonic() + 10
    while not client.get_metric_history(run_id, "due") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(client.get_metric_history(run_id, "due")) == 1
    timed.close()


def test_tracker_never_blocks_the_caller(uri, client):
    run_id = new_run(client)
    tracker = MlflowTracker(uri, run_id, flush_every_s=0.05, max_batch=1)
    real = tracker._client

    class Slow:
        def log_batch(self, *args, **kwargs):
            time.sleep(0.2)
            return real.log_batch(*args, **kwargs)

    tracker._client = Slow()
    worst = 0.0
    for step in range(10):
        t0 = time.perf_counter()
        tracker.log_metrics({"slow": float(step)}, step=step)
        worst = max(worst, time.perf_counter() - t0)
        time.sleep(0.005)
    assert worst < 0.1
    tracker.close()
    assert len(client.get_metric_history(run_id, "slow")) == 10


def test_tracker_tags_and_artifacts(tmp_path, uri, client):
    run_id = new_run(client)
    f = tmp_path / "notes.txt"
    f.write_text("hello\n")
    with MlflowTracker(uri, run_id, flush_every_s=3600) as tracker:
        tracker.set_tags({"phase": "train", "best_epoch": 3, "ok": True})
        tracker.log_artifact(f, "extra")
        with pytest.raises(FileNotFoundError):
            tracker.log_artifact(tmp_path / "absent.bin")
    tags = client.get_run(run_id).data.tags
    assert tags["phase"] == "train" and tags["best_epoch"] == "3" and tags["ok"] == "true"
    assert "extra/notes.txt" in artifact_paths(client, run_id)


def test_tracker_rejects_bad_input(uri, client):
    tracker = MlflowTracker(uri, new_run(client), flush_every_s=3600)
    with pytest.raises(TypeError):
        tracker.log_metrics({"m": 1.0}, step=1.5)
    with pytest.raises(ValueError, match="metric name"):
        tracker.log_metrics({"bad|name": 1.0}, step=1)
    tracker.close()
    with pytest.raises(ValueError):
        MlflowTracker(uri, "x", flush_every_s=0)


def test_tracker_errors_surface_on_flush(uri, client):
    tracker = MlflowTracker(uri, "0" * 32, flush_every_s=3600)
    tracker.log_metrics({"m": 1.0}, step=0)
    with pytest.raises(TrackingError, match="1 items were not recorded") as err:
        tracker.flush()
    assert "0" * 32 in str(err.value)
    tracker.flush()  # reported once
    tracker.close()


def test_tracker_errors_surface_on_close_for_deleted_run(uri, client):
    run_id = new_run(client)
    tracker = MlflowTracker(uri, run_id, flush_every_s=3600)
    tracker.log_metrics({"m": 1.0}, step=0)
    tracker.flush()
    client.delete_run(run_id)
    tracker.log_metrics({"m": 2.0}, step=1)
    with pytest.raises(TrackingError, match="failed"):
        tracker.close()


def test_null_tracker_does_nothing(tmp_path):
    with NullTracker() as t:
        t.log_metrics({"m": 1.0}, step=0)
        t.set_tags({"a": "b"})
        t.log_artifact(tmp_path / "absent")
        t.flush()
    t.close()


# --------------------------------------------------------------------------- end_run


def test_end_run_finished_and_failed(tmp_path, uri, client):
    ok = new_run(client)
    end_run(uri, ok, "FINISHED")
    run = client.get_run(ok)
    assert run.info.status == "FINISHED" and run.info.end_time
    assert "runner.error" not in run.data.tags

    bad = new_run(client)
    error = "Traceback (most recent call last):\n" + "  frame\n" * 500 + "RuntimeError: loss is nan"
    end_run(uri, bad, "FAILED", error=error)
    run = client.get_run(bad)
    assert run.info.status == "FAILED"
    tag = run.data.tags["runner.error"]
    assert len(tag) <= 1100 and tag.startswith("Traceback") and tag.endswith("RuntimeError: loss is nan")
    assert read_artifact(client, bad, "error.txt", tmp_path).strip() == error

    killed = new_run(client)
    end_run(uri, killed, "KILLED", error="interrupted by signal 2")
    assert client.get_run(killed).info.status == "KILLED"
    assert client.get_run(killed).data.tags["runner.error"] == "interrupted by signal 2"


def test_end_run_errors(uri, client):
    with pytest.raises(ValueError, match="FINISHED"):
        end_run(uri, new_run(client), "DONE")
    with pytest.raises(TrackingError, match="could not end"):
        end_run(uri, "f" * 32, "FINISHED")


def test_module_import_is_light():
    code = "import sys, runner.tracking.runs, runner.tracking.gitinfo; assert 'mlflow' not in sys.modules and 'torch' not in sys.modules"
    subprocess.run([os.sys.executable, "-c", code], check=True)


def test_start_run_fails_before_creating_anything_when_spec_cannot_be_dumped(tmp_path, uri, client, monkeypatch):
    loaded = load_spec(write_spec(tmp_path / "loose"))

    def boom(spec):
        raise RuntimeError("cannot dump")

    monkeypatch.setattr(tracking, "_spec_codec", lambda: (lambda s: {"name": "demo"}, boom))
    with pytest.raises(RuntimeError):
        start_run(loaded, {}, uri=uri)
    assert client.get_experiment_by_name("exp-demo") is None


def test_start_run_marks_run_failed_when_recording_fails(tmp_path, uri, client, monkeypatch):
    from mlflow.tracking import MlflowClient

    loaded = load_spec(write_spec(tmp_path / "loose"))

    def broken_log_text(self, run_id, text, artifact_file):
        raise OSError("disk full")

    monkeypatch.setattr(MlflowClient, "log_text", broken_log_text)
    with pytest.raises(TrackingError, match="disk full"):
        start_run(loaded, {}, uri=uri)
    exp = client.get_experiment_by_name("exp-demo")
    (run,) = client.search_runs([exp.experiment_id])
    assert run.info.status == "FAILED"

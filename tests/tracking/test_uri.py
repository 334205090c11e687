"""Tests of runner.tracking.uri: which store a run logs to, and the checks made before any run exists."""

from __future__ import annotations

import os
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer
from types import SimpleNamespace

import pytest

from runner.errors import TrackingError, mask_secrets
from runner.tracking.uri import check_reachable, resolve_tracking_uri

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
    assert time.monotonic() - t0 < 30  # no HTTP retries (those take minutes)
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


# --------------------------------------------------------------------------- file stores


@pytest.mark.parametrize("uri", ["file:./mlruns", "file:///abs/mlruns", "./mlruns", "/abs/mlruns", "mlruns"])
def test_a_file_store_in_the_spec_is_a_spec_error_at_its_line(write_spec, uri):
    from runner.errors import SpecError
    from runner.spec.loading import load_spec

    path = write_spec()
    path.write_text(path.read_text().replace('uri = "sqlite:', f'uri = "{uri}"\n# was "sqlite:'))
    line = next(i for i, text in enumerate(path.read_text().splitlines(), 1) if text.startswith("uri = "))
    with pytest.raises(SpecError) as info:
        load_spec(path)
    (issue,) = info.value.issues
    assert (issue.file, issue.line, issue.key) == (path, line, "tracking.uri")
    assert "is a file store" in issue.message and '"sqlite:///mlflow.db"' in issue.message


def test_a_file_store_in_the_environment_names_the_variable(write_spec, monkeypatch, capsys):
    from runner.cli import main

    path = write_spec()
    path.write_text(path.read_text().replace('uri = "sqlite:', '# uri = "sqlite:'))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "file:./mlruns")
    assert main(["exec", str(path)]) == 2
    err = capsys.readouterr().err
    assert "MLFLOW_TRACKING_URI=file:./mlruns: " in err and "sqlite:///mlflow.db" in err and "Traceback" not in err
    assert main(["plan", str(path)]) == 2
    for fine in ("sqlite:///x.db", "http://127.0.0.1:5000", "databricks", "postgresql://u@h/db"):
        assert resolve_tracking_uri(spec_with_uri(None), env={"MLFLOW_TRACKING_URI": fine})


@pytest.mark.parametrize(
    ("uri", "run_id", "line"),
    [
        (
            "http://alice:s3cret@127.0.0.1:5000/",
            "r1",
            "open the run: http://127.0.0.1:5000/#/experiments/7/runs/r1?workflowType=machine_learning",
        ),
        (
            "https://h.example/mlflow",
            None,
            "open the run: https://h.example/mlflow/#/experiments/7/runs?workflowType=machine_learning",
        ),
        (
            "postgresql://u:pw@h/db",
            "r1",
            "open the run: mlflow ui --backend-store-uri postgresql://u:***@h/db, "
            "then http://127.0.0.1:5000/#/experiments/7/runs/r1?workflowType=machine_learning",
        ),
    ],
)
def test_every_ui_link_asks_for_the_training_view_and_carries_no_credentials(uri, run_id, line) -> None:
    from runner.tracking.uri import ui_line

    assert mask_secrets(ui_line(uri, "7", run_id)) == line  # a local store's URI is masked where the line is shown
    assert "s3cret" not in ui_line(uri, "7", run_id)  # a link to a server never carries the credentials

"""The tracking-server check sends MLflow's own requests: credentials MLflow would use reach the server."""

from __future__ import annotations

import base64
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest

from runner.errors import TrackingError
from runner.tracking.uri import check_reachable

USER, PASSWORD = "alice", "s3cret"


@pytest.fixture
def guarded_server() -> Iterator[tuple[str, list[dict[str, str]]]]:
    """An MLflow-like server on 127.0.0.1 that answers /health only with basic auth alice:s3cret."""
    seen: list[dict[str, str]] = []
    expected = "Basic " + base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()

    class Guarded(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            seen.append({"path": self.path, **{k.lower(): v for k, v in self.headers.items()}})
            ok = self.headers.get("Authorization") == expected
            self.send_response(200 if ok else 401)
            self.end_headers()
            self.wfile.write(b"OK" if ok else b"")

        def log_message(self, *args: object) -> None:
            pass

    server = HTTPServer(("127.0.0.1", 0), Guarded)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", seen
    finally:
        server.shutdown()
        server.server_close()


def test_credentials_from_mlflows_credentials_file_are_sent(
    guarded_server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    uri, seen = guarded_server
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / ".mlflow").mkdir()
    (tmp_path / ".mlflow" / "credentials").write_text(
        f"[mlflow]\nmlflow_tracking_username = {USER}\nmlflow_tracking_password = {PASSWORD}\n", encoding="utf-8"
    )
    check_reachable(uri, timeout_s=5.0)
    assert seen[-1]["path"] == "/health"
    assert seen[-1]["user-agent"].startswith("mlflow-python-client"), "MLflow's request headers are sent"


def test_credentials_from_the_environment_are_sent(guarded_server, monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    uri, _ = guarded_server
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", USER)
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", PASSWORD)
    check_reachable(uri, timeout_s=5.0)


def test_missing_credentials_are_named_in_the_error(guarded_server, monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    uri, seen = guarded_server
    monkeypatch.setenv("HOME", str(tmp_path))
    with pytest.raises(TrackingError, match=r"rejected the request \(HTTP 401\).*~/.mlflow/credentials"):
        check_reachable(uri, timeout_s=5.0)
    assert [s["path"] for s in seen] == ["/health", "/api/2.0/mlflow/experiments/search?max_results=1"]

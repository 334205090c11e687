"""Tests of runner.tracking.trackers against a throw-away sqlite store."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from runner.errors import TrackingError
from runner.launch.channel import ChannelTracker, Close, Metrics, Restored
from runner.launch.session import RunSession
from runner.tracking.runs import TrackedRun
from runner.tracking.trackers import MlflowTracker, NullTracker, Tracker
from tests.helpers import AsyncStore


def artifact_paths(client, run_id: str, path: str | None = None) -> set[str]:
    out: set[str] = set()
    for f in client.list_artifacts(run_id, path):
        out |= artifact_paths(client, run_id, f.path) if f.is_dir else {f.path}
    return out


# --------------------------------------------------------------------------- MlflowTracker


def new_run(client) -> str:
    exp = client.create_experiment(f"e{time.monotonic_ns()}")
    return client.create_run(exp).info.run_id


def test_tracker_logs_2500_metrics_in_order(uri, client):
    run_id = new_run(client)
    tracker = MlflowTracker(TrackedRun(uri, run_id), flush_every_s=0.2)
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


def test_a_full_batch_of_values_and_tags_goes_in_one_request(uri, client):
    # Bug: a batch of 1,000 values with a tag made MLflow split it into two requests, which the tracker took for a
    # failed batch: every value was reported lost (or, with a spool, sent again and again).
    run_id = new_run(client)
    tracker = MlflowTracker(TrackedRun(uri, run_id), flush_every_s=3600)
    tracker.set_tags({f"t{i}": str(i) for i in range(150)})
    for step in range(2000):
        tracker.log_metrics({"m": float(step)}, step=step)
    tracker.flush(timeout_s=120)
    assert sorted(m.step for m in client.get_metric_history(run_id, "m")) == list(range(2000))
    assert {f"t{i}" for i in range(150)} <= set(client.get_run(run_id).data.tags)
    tracker.close()


def test_a_value_keeps_the_time_it_was_taken_at_on_its_rank(uri, client):
    run_id = new_run(client)
    with MlflowTracker(TrackedRun(uri, run_id), flush_every_s=3600) as tracker:
        tracker.log_metrics({"train/loss": 0.5}, step=3, timestamp_ms=1_234_567)
    ((metric,),) = [client.get_metric_history(run_id, "train/loss")]
    assert (metric.step, metric.value, metric.timestamp) == (3, 0.5, 1_234_567)


def test_tracker_flush_semantics(uri, client):
    run_id = new_run(client)
    tracker = MlflowTracker(TrackedRun(uri, run_id), flush_every_s=3600)
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
    tracker = MlflowTracker(TrackedRun(uri, run_id), flush_every_s=3600, max_batch=5)
    for step in range(5):
        tracker.log_metrics({"full": 1.0}, step=step)
    deadline = time.monotonic() + 60
    while len(client.get_metric_history(run_id, "full")) < 5 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(client.get_metric_history(run_id, "full")) == 5
    tracker.close()

    timed = MlflowTracker(TrackedRun(uri, run_id), flush_every_s=0.2)
    timed.log_metrics({"due": 1.0}, step=0)
    deadline = time.monotonic() + 60
    while not client.get_metric_history(run_id, "due") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(client.get_metric_history(run_id, "due")) == 1
    timed.close()


def test_tracker_never_blocks_the_caller(uri, client):
    run_id = new_run(client)
    tracker = MlflowTracker(TrackedRun(uri, run_id), flush_every_s=0.05, max_batch=1)
    store = tracker._client = AsyncStore(tracker._client)
    store.gate = release = threading.Event()  # a store that takes no request until released (no timing)
    tracker.log_metrics({"slow": 0.0}, step=0)
    assert store.started.wait(60)  # MLflow's thread is inside a request that does not return
    for step in range(1, 10):
        tracker.log_metrics({"slow": float(step)}, step=step)  # returns while the sender is stuck
    release.set()
    tracker.close()
    assert len(client.get_metric_history(run_id, "slow")) == 10


def test_a_closed_tracker_leaves_mlflow_no_exit_drain_to_wait_on(uri, client, monkeypatch):
    """MLflow's at-exit drain waits up to 1 s for its idle loop; after a close with nothing in flight it is dropped
    (this also fails at once if MLflow moves the attributes the tracker reaches it through)."""
    import atexit

    unregistered: list = []
    monkeypatch.setattr(atexit, "unregister", unregistered.append)
    tracker = MlflowTracker(TrackedRun(uri, new_run(client)), flush_every_s=3600)
    tracker.log_metrics({"m": 1.0}, step=0)
    tracker.close()
    assert unregistered == [tracker._client._tracking_client.store._async_logging_queue._at_exit_callback]


def test_ending_a_run_after_async_logging_does_not_shut_mlflow_logging_down(uri, client):
    """MlflowClient.set_terminated joins MLflow's idle logging loop (up to 1 s a run); runner's end_run must not."""

    run_id = new_run(client)
    with MlflowTracker(TrackedRun(uri, run_id), flush_every_s=3600) as tracker:
        tracker.log_metrics({"m": 1.0}, step=0)
    queue = tracker._client._tracking_client.store._async_logging_queue
    assert queue.is_active()
    TrackedRun(uri, run_id).end("FINISHED")
    run = client.get_run(run_id)
    assert queue.is_active() and run.info.status == "FINISHED" and run.info.end_time >= run.info.start_time
    assert [m.value for m in client.get_metric_history(run_id, "m")] == [1.0]


def test_tracker_tags_and_artifacts(tmp_path, uri, client):
    run_id = new_run(client)
    f = tmp_path / "notes.txt"
    f.write_text("hello\n")
    with MlflowTracker(TrackedRun(uri, run_id), flush_every_s=3600) as tracker:
        tracker.set_tags({"phase": "train", "best_epoch": 3, "ok": True})
        tracker.log_artifact(f, "extra")
        with pytest.raises(FileNotFoundError):
            tracker.log_artifact(tmp_path / "absent.bin")
    tags = client.get_run(run_id).data.tags
    assert tags["phase"] == "train" and tags["best_epoch"] == "3" and tags["ok"] == "true"
    assert "extra/notes.txt" in artifact_paths(client, run_id)


def test_tracker_rejects_bad_input(uri, client):
    tracker = MlflowTracker(TrackedRun(uri, new_run(client)), flush_every_s=3600)
    with pytest.raises(TypeError):
        tracker.log_metrics({"m": 1.0}, step=1.5)
    with pytest.raises(ValueError, match="metric name"):
        tracker.log_metrics({"bad|name": 1.0}, step=1)
    tracker.close()
    with pytest.raises(ValueError):
        MlflowTracker(TrackedRun(uri, "x"), flush_every_s=0)


def test_tracker_errors_surface_on_flush(uri, client):
    tracker = MlflowTracker(TrackedRun(uri, "0" * 32), flush_every_s=3600)
    tracker.log_metrics({"m": 1.0}, step=0)
    with pytest.raises(TrackingError, match="1 items were not recorded") as err:
        tracker.flush()
    assert "0" * 32 in str(err.value)
    tracker.flush()  # reported once
    tracker.close()


def test_tracker_errors_surface_on_close_for_deleted_run(uri, client):
    run_id = new_run(client)
    tracker = MlflowTracker(TrackedRun(uri, run_id), flush_every_s=3600)
    tracker.log_metrics({"m": 1.0}, step=0)
    tracker.flush()
    client.delete_run(run_id)
    tracker.log_metrics({"m": 2.0}, step=1)
    with pytest.raises(TrackingError, match="failed"):
        tracker.close()


# --------------------------------------------------------------------------- the protocol, NullTracker

# One call of every method of the Tracker protocol: name -> (args, kwargs).
PROTOCOL_CALLS = {
    "log_metrics": (({"train/loss": 1.0},), {"step": 0}),
    "log_artifact": (("absent/model.bin", "checkpoints"), {}),
    "set_tags": (({"phase": "train"},), {}),
    "flush": ((), {}),
    "send": (("a message for a driver",), {}),
    "recorded": ((), {}),
    "close": ((), {}),
}


def test_protocol_calls_cover_every_method_of_the_protocol():
    methods = {name for name, value in vars(Tracker).items() if callable(value) and not name.startswith("_")}
    assert methods == set(PROTOCOL_CALLS)
    for name in methods:
        assert getattr(Tracker, name).__doc__, f"Tracker.{name} has no docstring"


def test_every_tracker_has_every_protocol_method():
    for cls in (NullTracker, MlflowTracker, ChannelTracker):
        missing = [name for name in PROTOCOL_CALLS if not callable(getattr(cls, name, None))]
        assert not missing, (cls.__name__, missing)


def test_null_tracker_does_nothing(tmp_path):
    """Every protocol call returns None, and the tracker starts no thread, writes no file and imports no mlflow."""
    code = f"""
import os, sys, threading
from runner.tracking.trackers import NullTracker, Tracker
calls = {PROTOCOL_CALLS!r}
threads = threading.active_count()
tracker = NullTracker()
assert isinstance(tracker, Tracker)
results = {{name: getattr(tracker, name)(*args, **kwargs) for name, (args, kwargs) in calls.items()}}
tracker.close()
assert results == {{**dict.fromkeys(calls), "recorded": 0}}, results
assert threading.active_count() == threads, threading.enumerate()
assert "mlflow" not in sys.modules
assert os.listdir(".") == [], os.listdir(".")
print("ok")
"""
    work = tmp_path / "empty"
    work.mkdir()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    done = subprocess.run([sys.executable, "-c", code], cwd=work, env=env, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


def _session(uri: str, run_id: str, folder: Path) -> RunSession:
    """A driver's session of ``run_id`` as the hub's handler, with only what its tracker's making reads."""
    tracking = SimpleNamespace(flush_every_s=3600.0, system_metrics=False)
    plan = SimpleNamespace(tracking_uri=uri, loaded=SimpleNamespace(spec=SimpleNamespace(tracking=tracking)))
    session = RunSession(plan, None, None)  # type: ignore[arg-type]
    session.run = TrackedRun(uri, run_id)
    session.checkpoint_dir = str(folder)
    return session


def test_a_resumed_runs_session_logs_only_the_steps_the_run_lacks_at_the_ranks_times(uri, client, tmp_path):
    run_id = new_run(client)
    client.log_metric(run_id, "train/loss", 1.0, step=5)
    session = _session(uri, run_id, tmp_path)
    assert session.handle(Restored(0, True, False)) == []  # resumed: what the run holds is read once
    assert session._last_steps == {"train/loss": 5}
    logged = [
        ({"train/loss": 9.0, "lr": 0.1}, 5, 1_000),
        ({"train/loss": 2.0}, 4, 2_000),
        ({"train/loss": 3.0}, 6, 3_000),
    ]
    session.handle(Metrics(logged))
    assert session.handle(Close()) == 2  # values the run numbered: lr at 5, train/loss at 6
    history = client.get_metric_history(run_id, "train/loss")
    assert sorted((m.step, m.value, m.timestamp) for m in history)[1:] == [(6, 3.0, 3_000)]
    assert [(m.step, m.value, m.timestamp) for m in client.get_metric_history(run_id, "lr")] == [(5, 0.1, 1_000)]


def test_a_new_runs_session_logs_every_step(uri, client, tmp_path):
    run_id = new_run(client)
    session = _session(uri, run_id, tmp_path)
    session.handle(Restored(0, False, False))
    assert session._last_steps == {}
    session.handle(Metrics([({"train/loss": 1.0}, 1, 10), ({"train/loss": 0.5}, 2, 20)]))
    session.handle(Close())
    assert sorted(m.step for m in client.get_metric_history(run_id, "train/loss")) == [1, 2]

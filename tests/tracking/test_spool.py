"""The metric spool: values the store could not take wait in memory and then in a file, and none is lost or sent twice."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from runner.errors import TrackingError
from runner.launch.session import Spooled, end_run_or_spool
from runner.tracking import spool
from runner.tracking.runs import TrackedRun
from runner.tracking.trackers import MlflowTracker
from tests.helpers import AsyncStore, wait_for


@pytest.fixture
def run(ready_store: str) -> str:
    client = MlflowClient(ready_store)
    return str(client.create_run(client.create_experiment("spool")).info.run_id)


def _steps(store: str, run_id: str, key: str = "m") -> list[int]:
    return sorted(m.step for m in MlflowClient(store).get_metric_history(run_id, key))


def _tracker(
    store: str, run_id: str, path: Path, spill_after_s: float = 0.5, **kwargs
) -> tuple[MlflowTracker, AsyncStore]:
    tracker = MlflowTracker(
        TrackedRun(store, run_id), flush_every_s=0.05, spool=path, spill_after_s=spill_after_s, **kwargs
    )
    switch = AsyncStore(tracker._client)
    tracker._client = switch
    return tracker, switch


def _wait(condition, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_values_wait_in_the_spool_while_the_store_is_away_and_are_sent_once_when_it_returns(
    ready_store: str, run: str, tmp_path: Path
) -> None:
    path = tmp_path / "ck" / spool.SPOOL_NAME
    # spill_after_s far above what a loaded machine adds: "no wait" is told from "waited spill_after_s"
    tracker, switch = _tracker(ready_store, run, path, spill_after_s=60)
    for step in range(5):
        tracker.log_metrics({"m": float(step)}, step=step)
    tracker.flush()
    assert _steps(ready_store, run) == [0, 1, 2, 3, 4] and not path.exists()
    switch.down = True
    for step in range(5, 12):
        tracker.log_metrics({"m": float(step)}, step=step)
    t0 = time.monotonic()
    tracker.flush()  # a checkpoint: returns once the values are safe, without waiting for the store
    assert time.monotonic() - t0 < 30
    kept, _ = spool.read(path)
    assert [i.step for i in kept.items] == list(range(5, 12))
    t0 = time.monotonic()
    tracker.flush()  # the store is known to be away: no wait at all
    assert time.monotonic() - t0 < 30
    switch.down = False
    _wait(lambda: _steps(ready_store, run) == list(range(12)))
    _wait(lambda: not path.exists())  # everything in it was sent
    tracker.log_metrics({"m": 12.0}, step=12)
    tracker.close()
    assert _steps(ready_store, run) == list(range(13)) and not path.exists()


def test_memory_is_bounded_while_the_store_is_away(ready_store: str, run: str, tmp_path: Path) -> None:
    path = tmp_path / spool.SPOOL_NAME
    tracker, switch = _tracker(ready_store, run, path, max_batch=10, max_memory=20)
    switch.down = True
    for step in range(95):
        tracker.log_metrics({"m": float(step)}, step=step)
    assert len(tracker._queue) < 20 and len(spool.read(path)[0].items) >= 75
    switch.down = False
    tracker.close()
    assert _steps(ready_store, run) == list(range(95))


def test_close_while_the_store_is_away_leaves_values_and_tags_in_the_spool(
    ready_store: str, run: str, tmp_path: Path
) -> None:
    path = tmp_path / spool.SPOOL_NAME
    tracker, switch = _tracker(ready_store, run, path, first_seq=100)
    tracker.log_metrics({"m": 0.0}, step=0)
    tracker.flush()
    switch.down = True
    tracker.log_metrics({"m": 1.0, "lr": 0.1}, step=1)
    tracker.set_tags({"phase": "late"})
    tracker._client.real = None  # never reached again: close must not wait on it
    t0 = time.monotonic()
    tracker.close(timeout_s=1.0)
    assert time.monotonic() - t0 < 30 and tracker.recorded() == 103  # not stuck on it
    kept, _ = spool.read(path)
    assert sorted((i.seq, i.key, i.step) for i in kept.items) == [(101, "m", 1), (102, "lr", 1)]
    assert kept.tags == {"phase": "late"}


def test_send_spool_sends_only_what_the_run_lacks_and_applies_the_end(
    ready_store: str, run: str, tmp_path: Path
) -> None:
    path = tmp_path / spool.SPOOL_NAME
    MlflowClient(ready_store).log_metric(run, "m", 0.0, step=0)
    items = [spool.Item(s, "m", float(s), 1000 + s, s) for s in range(4)]
    spool.append(path, items, tags={"t": "1"})
    end_run_or_spool(TrackedRun(f"sqlite:///{tmp_path}/no/such/folder/m.db", run), "FINISHED", None, str(tmp_path))
    kept = Spooled.of(tmp_path)
    assert kept is not None and (kept.metrics, kept.status) == (4, "FINISHED")
    assert "4 metric values and the status FINISHED could only be spooled" in kept.describe(run)
    sent = spool.send_spool(TrackedRun(ready_store, run), path)
    assert (sent.metrics, sent.skipped, sent.ended) == (3, 1, "FINISHED")  # step 0 was already in the run
    assert _steps(ready_store, run) == [0, 1, 2, 3] and not path.exists()
    got = MlflowClient(ready_store).get_run(run)
    assert got.info.status == "FINISHED" and got.data.tags["t"] == "1"


def test_a_resume_sends_what_came_before_its_checkpoint_only(ready_store: str, run: str, tmp_path: Path) -> None:
    path = tmp_path / spool.SPOOL_NAME
    spool.append(path, [spool.Item(s, "m", float(s), 1000 + s, s) for s in range(6)])
    sent = spool.send_spool(TrackedRun(ready_store, run), path, before_seq=4, apply_end=False)
    assert (sent.metrics, sent.skipped) == (4, 2) and _steps(ready_store, run) == [0, 1, 2, 3]


def test_a_torn_last_line_is_ignored(tmp_path: Path) -> None:
    path = tmp_path / spool.SPOOL_NAME
    spool.append(path, [spool.Item(0, "m", 1.0, 1, 0)])
    with open(path, "a") as fh:
        fh.write(json.dumps({"seq": 1, "key": "m"})[:9])
    assert [i.seq for i in spool.read(path)[0].items] == [0]


def test_values_the_store_rejects_are_reported_not_spooled(ready_store: str, tmp_path: Path) -> None:
    path = tmp_path / spool.SPOOL_NAME
    tracker = MlflowTracker(TrackedRun(ready_store, "0" * 32), flush_every_s=3600, spool=path)
    tracker.log_metrics({"m": 1.0}, step=0)
    with pytest.raises(TrackingError, match="1 items were not recorded"):
        tracker.flush()
    tracker.close()
    assert not path.exists()


def test_a_store_that_hangs_delays_one_flush_only(ready_store: str, run: str, tmp_path: Path) -> None:
    """A server stopped with SIGSTOP neither answers nor refuses: the first checkpoint's flush waits
    ``spill_after_s``, the later ones spill at once, until a batch gets through again."""
    import threading

    path = tmp_path / "ck" / spool.SPOOL_NAME
    tracker = MlflowTracker(TrackedRun(ready_store, run), flush_every_s=0.05, spool=path, spill_after_s=2.0)
    switch = tracker._client = AsyncStore(tracker._client)
    switch.gate = released = threading.Event()
    waits = []
    for step in range(3):
        tracker.log_metrics({"m": float(step)}, step=step)
        began = time.monotonic()
        tracker.flush()  # as before each checkpoint
        waits.append(time.monotonic() - began)
    assert waits[0] >= 2.0 and max(waits[1:]) < 2.0, waits  # not 2 s per checkpoint
    released.set()
    tracker.close()
    assert _steps(ready_store, run) == [0, 1, 2]


def test_a_process_that_gave_up_on_a_hanging_store_exits_without_waiting_for_its_request(tmp_path: Path) -> None:
    """A socket that listens and never answers holds MLflow's request for ``MLFLOW_HTTP_REQUEST_TIMEOUT`` (600 s
    here): close spools the value and the process ends at once, not when the request times out."""
    path = tmp_path / spool.SPOOL_NAME
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        code = f"""
from pathlib import Path
from runner.errors import exit_quickly
from runner.tracking.runs import TrackedRun
from runner.tracking.trackers import MlflowTracker
tracker = MlflowTracker(TrackedRun("http://127.0.0.1:{listener.getsockname()[1]}", "0" * 32), spool=Path({str(path)!r}))
tracker.log_metrics({{"m": 1.0}}, step=0)
tracker.close(timeout_s=1)
exit_quickly(3)
"""
        env = {**os.environ, "MLFLOW_HTTP_REQUEST_TIMEOUT": "600", "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0"}
        proc = subprocess.Popen([sys.executable, "-c", code], env=env, stderr=subprocess.PIPE, text=True)
        wait_for(lambda: proc.poll() is not None, "the process to exit", timeout_s=300)
        assert proc.returncode == 3, proc.communicate()[1]
    assert [(i.key, i.step) for i in spool.read(path)[0].items] == [("m", 0)]

"""The pipe between rank 0 and the driver's hub (runner.launch.channel), and what crosses it."""

from __future__ import annotations

import pickle
import time
from multiprocessing import AuthenticationError

import pytest

from runner.errors import Interrupted, SpecError, SpecIssue, TrackingError, UserCodeError
from runner.launch.channel import ChannelTracker, HandedRun, Hub, Link


class Recorder:
    """A hub handler that keeps every message and answers as the driver's session would."""

    def __init__(self) -> None:
        self.seen: list[tuple] = []

    def handle(self, kind: str, *payload):
        self.seen.append((kind, *payload))
        if kind == "built":
            return HandedRun("run-1", "/tmp/ck", False)
        if kind == "flush":
            return sum(len(values) for p in self.seen if p[0] == "metrics" for values, _, _ in p[1])
        if kind == "close":
            raise TrackingError("the store refused the last batch")
        return None


def test_messages_arrive_in_order_and_answers_come_back(monkeypatch):
    booted = time.monotonic() - 1.0  # a machine booted a second ago: its monotonic clock is near 0
    monkeypatch.setattr(time, "monotonic", lambda real=time.monotonic: real() - booted)
    recorder = Recorder()
    hub = Hub(recorder.handle)
    hub.start()
    link = Link(hub.address)
    try:
        assert link.ask("built", None, ["a note"]) == HandedRun("run-1", "/tmp/ck", False)
        tracker = ChannelTracker(link, every_s=3600)  # the first values go at once, the next wait for a message
        tracker.log_metrics({"train/loss": 1.5, "lr": 0.1}, step=1)
        tracker.log_metrics({"train/loss": 1.25}, step=2, timestamp_ms=1_000)
        tracker.log_metrics({"train/loss": 1.0}, step=3, timestamp_ms=2_000)
        tracker.set_tags({"k": "v"})
        tracker.flush()
        assert tracker.recorded() == 4
        with pytest.raises(TrackingError, match="refused the last batch"):
            tracker.close()
        with pytest.raises(TrackingError, match="closed"):
            tracker.log_metrics({"x": 1.0}, step=2)
    finally:
        link.close()
        hub.stop()
    kinds = [m[0] for m in recorder.seen]
    assert kinds == ["built", "metrics", "metrics", "tags", "flush", "close"]
    ((first, step, stamp),) = recorder.seen[1][1]
    assert (first, step) == ({"train/loss": 1.5, "lr": 0.1}, 1) and stamp > 1_000_000_000_000  # ms since the epoch
    assert recorder.seen[2][1] == [({"train/loss": 1.25}, 2, 1_000), ({"train/loss": 1.0}, 3, 2_000)]


def test_values_logged_after_the_interval_go_at_once_and_none_is_left_at_close():
    recorder = Recorder()
    hub = Hub(recorder.handle)
    hub.start()
    link = Link(hub.address)
    try:
        tracker = ChannelTracker(link, every_s=0.0)
        for step in (1, 2):
            tracker.log_metrics({"x": float(step)}, step=step, timestamp_ms=step)
        late = ChannelTracker(link, every_s=3600)
        late.log_metrics({"y": 1.0}, step=1, timestamp_ms=5)
        late.log_metrics({"y": 2.0}, step=2, timestamp_ms=6)  # waits: sent by close
        with pytest.raises(TrackingError):
            late.close()
    finally:
        link.close()
        hub.stop()
    metrics = [p[1] for p in recorder.seen if p[0] == "metrics"]
    assert metrics == [[({"x": 1.0}, 1, 1)], [({"x": 2.0}, 2, 2)], [({"y": 1.0}, 1, 5)], [({"y": 2.0}, 2, 6)]]


def test_a_step_that_is_not_an_integer_is_refused_on_the_training_side():
    hub = Hub(Recorder().handle)
    hub.start()
    link = Link(hub.address)
    try:
        with pytest.raises(TypeError, match="int"):
            ChannelTracker(link).log_metrics({"x": 1.0}, step=1.5)  # type: ignore[arg-type]
    finally:
        link.close()
        hub.stop()


def test_a_hub_that_nobody_reached_stops_at_once():
    hub = Hub(Recorder().handle)
    hub.start()
    hub.stop(wait_s=30)
    assert not hub._thread.is_alive()


def test_a_wrong_key_is_refused_and_the_hub_still_serves_rank_0():
    from dataclasses import replace

    hub = Hub(Recorder().handle)
    hub.start()
    try:
        with pytest.raises(AuthenticationError):
            Link(replace(hub.address, key=b"0" * 16))
        link = Link(hub.address)
        assert link.ask("built", None, []).run_id == "run-1"
        link.close()
    finally:
        hub.stop()


@pytest.mark.parametrize(
    "error",
    [
        SpecError([SpecIssue(None, None, "data.target", "no such key")]),
        Interrupted(15, run_id="r", checkpoint="step-3.pt"),
        UserCodeError("model.name: your code raised ValueError"),
    ],
    ids=["spec", "interrupted", "user-code"],
)
def test_runners_errors_cross_a_pipe_whole(error):
    back = pickle.loads(pickle.dumps(error))
    assert type(back) is type(error) and str(back) == str(error) and back.__dict__ == error.__dict__


def test_the_run_records_torch_versions_without_importing_torch():
    import torch

    from runner.tracking.tags import _torch_versions

    assert _torch_versions() == (str(torch.__version__), str(torch.version.cuda or "none"))

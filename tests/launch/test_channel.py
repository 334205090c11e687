"""The pipe between rank 0 and the driver's hub (runner.launch.channel), and what crosses it."""

from __future__ import annotations

import pickle
import time
from multiprocessing import AuthenticationError

import pytest

from runner.errors import Interrupted, SpecError, SpecIssue, TrackingError, UserCodeError
from runner.launch.channel import Built, ChannelTracker, Close, Flush, HandedRun, Hub, Link, Message, Metrics, Tags


class Recorder:
    """A hub handler that keeps every message and answers as the driver's session would."""

    def __init__(self) -> None:
        self.seen: list[Message] = []

    def handle(self, message: Message):
        self.seen.append(message)
        match message:
            case Built():
                return HandedRun("run-1", "/tmp/ck", False)
            case Flush():
                return sum(len(values) for m in self.seen if isinstance(m, Metrics) for values, _, _ in m.logged)
            case Close():
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
        assert link.ask(Built(None, ["a note"])) == HandedRun("run-1", "/tmp/ck", False)
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
    kinds = [type(m) for m in recorder.seen]
    assert kinds == [Built, Metrics, Metrics, Tags, Flush, Close]
    ((first, step, stamp),) = recorder.seen[1].logged
    assert (first, step) == ({"train/loss": 1.5, "lr": 0.1}, 1) and stamp > 1_000_000_000_000  # ms since the epoch
    assert recorder.seen[2].logged == [({"train/loss": 1.25}, 2, 1_000), ({"train/loss": 1.0}, 3, 2_000)]
    assert recorder.seen[3] == Tags({"k": "v"})


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
    metrics = [m.logged for m in recorder.seen if isinstance(m, Metrics)]
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
        assert link.ask(Built(None, [])).run_id == "run-1"
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


def test_every_message_crosses_the_pipe_as_its_type():
    from runner.launch import channel

    messages = [
        channel.Built(SpecError([SpecIssue(None, None, "model.name", "no such model")]), ["a note"]),
        channel.Restored(3, True, False),
        channel.Metrics([({"train/loss": 0.5}, 1, 10)]),
        channel.Tags({"k": "v"}),
        channel.Artifact("/tmp/x", None),
        channel.Data({"name": "digits"}),
        channel.LoggedModel("/tmp/model.pt", 4, (0.0, 1.0)),
        channel.Flush(),
        channel.Close(),
        channel.Result({"rank": 0}),
        channel.Failed(TrackingError("gone")),
    ]
    assert {type(m) for m in messages} == set(channel.Message.__args__)  # one of each kind there is
    for message in messages:
        back = pickle.loads(pickle.dumps(message))
        assert type(back) is type(message)
        assert str(back) == str(message)  # errors compare by their text

"""The elastic launcher's process (runner.launch.elastic): what crosses back to the driver, and one stop per signal."""

from __future__ import annotations

import logging
import os
import pickle
import signal
import time

import pytest
from torch.distributed.elastic.multiprocessing.api import SignalException

from runner.errors import SpecError, SpecIssue
from runner.launch.elastic import LaunchFailed, _stop_once, launch_failure
from runner.launch.failures import JobContext, quiet_launcher_logs


def test_a_launch_failure_crosses_to_the_driver_whole() -> None:
    failed = LaunchFailed("rank 1 failed", (15, 1), SpecError([SpecIssue(None, None, "data.target", "no such key")]))
    back = pickle.loads(pickle.dumps(failed))
    assert (back.error, back.stopped) == ("rank 1 failed", (15, 1))
    assert isinstance(back.spec_error, SpecError) and "data.target" in str(back.spec_error)


def test_the_launcher_stopped_by_a_signal_is_a_stop_and_any_other_error_the_runs_message() -> None:
    stopped = launch_failure(SignalException("got signal", sigval=signal.SIGTERM), JobContext(30))
    assert stopped.stopped == (signal.SIGTERM, None) and stopped.spec_error is None
    failed = launch_failure(RuntimeError("the rendezvous closed"), JobContext(30))
    assert failed.stopped is None and "the rendezvous closed" in failed.error


def test_a_stop_signal_that_arrives_twice_within_a_second_is_one_stop() -> None:
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        _stop_once()
        with pytest.raises(SignalException) as stop:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.01)  # the handler runs at the next bytecode at the latest
        assert stop.value.sigval == signal.SIGTERM
        os.kill(os.getpid(), signal.SIGINT)  # the same stop again (the driver passed on what the terminal sent)
        time.sleep(0.01)
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


class _Ended:
    """A launcher process that ended with ``code`` and left no outcome."""

    def __init__(self, code: int):
        self.code = code

    def wait(self, timeout: float | None = None) -> int:
        return self.code

    def send_signal(self, signum: int) -> None:
        raise AssertionError("nothing to pass on")


def test_a_launcher_ended_without_an_outcome_is_a_stop_when_a_stop_signal_ended_it_else_a_failure(monkeypatch) -> None:
    from runner.errors import TrainingError
    from runner.launch import elastic

    monkeypatch.setattr(elastic.subprocess, "Popen", lambda *a, **k: _Ended(-signal.SIGTERM))
    with pytest.raises(LaunchFailed) as stopped:
        elastic.run_agent("plan", "args", {})  # type: ignore[arg-type]  # only pickled
    assert stopped.value.stopped == (signal.SIGTERM, None)
    monkeypatch.setattr(elastic.subprocess, "Popen", lambda *a, **k: _Ended(-signal.SIGKILL))
    with pytest.raises(TrainingError, match=r"the elastic launcher was killed by signal 9 \(SIGKILL"):
        elastic.run_agent("plan", "args", {})  # type: ignore[arg-type]


def test_a_prestarted_process_starts_again_only_when_the_devices_changed_after_cuda_started(monkeypatch) -> None:
    import torch

    from runner.launch.elastic import fresh_start_needed

    before, chosen = {"CUDA_VISIBLE_DEVICES": "0,1"}, {"CUDA_VISIBLE_DEVICES": "1"}
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert not fresh_start_needed(before, chosen)  # CUDA reads the variables when it starts, later
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert fresh_start_needed(before, chosen) and not fresh_start_needed(before, dict(before))


def test_the_wait_on_a_training_child_asks_until_the_run_is_handed_over_then_blocks() -> None:
    import subprocess
    import sys

    from runner.launch.elastic import _wait_passing_signals

    def child(seconds: float) -> subprocess.Popen[bytes]:
        return subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({seconds})"])

    asked: list[bool | None] = []

    def handed_after_two() -> bool | None:  # not known, not known, then handed over: never pointless
        asked.append(None if len(asked) >= 2 else False)
        return asked[-1]

    assert _wait_passing_signals(child(1.5), handed_after_two) == 0
    assert asked == [False, False, None]  # asked three times in 1.5 s, then no wake-ups until the child ended
    assert _wait_passing_signals(child(60), lambda: True) == -signal.SIGKILL  # no run will be made: killed


def test_a_ranks_spec_error_is_read_back_from_the_launchers_failure_record() -> None:
    from types import SimpleNamespace

    from runner.launch.elastic import spec_error_of_child

    def failed(trace: str) -> SimpleNamespace:
        record = SimpleNamespace(
            exitcode=1, timestamp=0, error_file_data={"message": {"extraInfo": {"py_callstack": trace}}}
        )
        return SimpleNamespace(failures={1: record})

    trace = "Traceback (most recent call last):\n  ...\nrunner.errors.SpecError: model.kwargs.width: got 0\ndata.target: no such key\n"
    found = spec_error_of_child(failed(trace))
    assert found is not None and [(i.key, i.message) for i in found.issues] == [
        ("model.kwargs.width", "got 0"),
        ("data.target", "no such key"),
    ]
    assert spec_error_of_child(failed("Traceback ...\nrunner.errors.TrainingError: diverged\n")) is None
    assert spec_error_of_child(RuntimeError("no failures recorded")) is None


class _GrowingLoggers(dict):
    """A logger registry to which another thread adds a logger while it is being iterated."""

    def items(self):  # type: ignore[override]
        for pair in super().items():
            self.setdefault("another.library", logging.PlaceHolder(logging.getLogger("x")))
            yield pair


def test_the_launcher_loggers_are_quieted_while_another_thread_makes_loggers(tmp_path, monkeypatch) -> None:
    """A two-node driver launches in its own process while its hub thread opens the store (importing mlflow): the
    registry of loggers must be read without iterating it live (a flaky 'dictionary changed size' before)."""
    child = logging.getLogger("torch.distributed.elastic.agent.server")
    registry = _GrowingLoggers(logging.Logger.manager.loggerDict)
    monkeypatch.setattr(logging.Logger.manager, "loggerDict", registry)
    with quiet_launcher_logs(tmp_path / "ranks.log") as quiet:
        assert quiet in child.filters and quiet in logging.getLogger("torch.distributed.elastic").filters
    assert quiet not in child.filters

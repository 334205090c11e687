"""The elastic launcher's process (runner.launch.elastic): what crosses back to the driver, and one stop per signal."""

from __future__ import annotations

import os
import pickle
import signal
import time

import pytest
from torch.distributed.elastic.multiprocessing.api import SignalException

from runner.errors import SpecError, SpecIssue
from runner.launch.elastic import LaunchFailed, _stop_once, launch_failure
from runner.launch.failures import JobContext


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

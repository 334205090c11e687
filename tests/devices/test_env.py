"""``scoped_environ``: variables set for a ``with`` block, the previous values back afterwards."""

from __future__ import annotations

import os

import pytest

from runner.devices.inventory import scoped_environ


def test_scoped_environ_sets_then_restores_and_removes_what_was_unset(monkeypatch) -> None:
    monkeypatch.setenv("RUNNER_TEST_KEPT", "before")
    monkeypatch.delenv("RUNNER_TEST_NEW", raising=False)
    with pytest.raises(RuntimeError), scoped_environ({"RUNNER_TEST_KEPT": "inside", "RUNNER_TEST_NEW": "1"}):
        assert (os.environ["RUNNER_TEST_KEPT"], os.environ["RUNNER_TEST_NEW"]) == ("inside", "1")
        raise RuntimeError  # restored on the way out of an error too
    assert os.environ["RUNNER_TEST_KEPT"] == "before"
    assert "RUNNER_TEST_NEW" not in os.environ

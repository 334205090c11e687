"""The checks that test fixtures rely on are shown to fail when they should."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers import assert_loopback_only


@pytest.mark.parametrize(("address", "passes"), [("127.0.0.1", True), ("0.0.0.0", False)])
def test_the_check_that_test_servers_listen_on_loopback_only_can_fail(address: str, passes: bool) -> None:
    """The fixtures' servers (mlflow, PostgreSQL, Slurm) are checked with this: it must refuse every interface."""
    code = f"import socket, time; s = socket.socket(); s.bind(({address!r}, 0)); s.listen(); print(1, flush=True); time.sleep(60)"
    server = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == "1"
        if passes:
            assert_loopback_only(server.pid, "a loopback server")
        else:
            with pytest.raises(AssertionError, match=r"listens on \['0.0.0.0'\]: bind 127.0.0.1 only"):
                assert_loopback_only(server.pid, "a server on every interface")
    finally:
        server.kill()
        server.wait()

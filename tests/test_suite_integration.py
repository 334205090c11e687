"""The test suite itself: interrupted (Ctrl-C, README command 2), it leaves no process of its tests running."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.helpers import REPO, alive, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

INNER = """
import subprocess
import sys
import time
from pathlib import Path


def test_starts_a_child_and_waits():  # as a test that runs `runner exec` and waits for it
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    Path({pidfile!r}).write_text(str(child.pid))
    time.sleep(600)
"""


@pytest.mark.parametrize("workers", ["2", "0"])
def test_an_interrupted_suite_leaves_no_process_its_tests_started(tmp_path: Path, workers: str) -> None:
    # SIGINT to pytest left 4 to 6 `runner exec` processes of the tests running.
    pidfile = tmp_path / "child.pid"
    (tmp_path / "test_inner.py").write_text(textwrap.dedent(INNER.format(pidfile=str(pidfile))))
    command = [sys.executable, "-m", "pytest", "-q", "-p", "tests.conftest", "-o", "addopts=", "-n", workers]
    command += ["-p", "no:cacheprovider", "--rootdir", str(tmp_path), str(tmp_path / "test_inner.py")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    suite = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wait_for(lambda: pidfile.is_file() and pidfile.read_text().strip() != "", "the test's child", 120, suite)
    child = int(pidfile.read_text())
    suite.send_signal(signal.SIGINT)
    suite.communicate(timeout=120)
    try:
        wait_for(lambda: not alive(child), "the test's child to end with the suite", 60)
    finally:
        if alive(child):
            os.kill(child, signal.SIGKILL)

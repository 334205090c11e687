"""The training process of a single-process job (none, dp): started by the driver, it never imports MLflow.

The driver writes the worker's arguments to a file beside its hub's socket and starts
``python -m runner.launch.child FILE`` with its own standard input, output and error (a ``breakpoint()``
in the user's model works). The child dies with the driver (``PR_SET_PDEATHSIG``); a SIGINT or SIGTERM
that reaches the driver alone is passed on, so the child writes its checkpoint and stops as it would
in the driver's place. The child's result and its failure come back over the hub
(:mod:`runner.launch.channel`); an exit without either (a signal, the OOM killer) is described from
its exit status.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

from runner.errors import Interrupted, RunnerError, TrainingError

if TYPE_CHECKING:  # pragma: no cover
    from runner.launch.session import RunSession
    from runner.launch.worker import WorkerArgs
    from runner.training import WorkerResult

ARGS_FILE = "worker-args.pkl"


def run_child(args: WorkerArgs, session: RunSession) -> WorkerResult:
    """Train ``args`` in a child process; return its result.

    Raises:
        Interrupted: The child stopped on SIGINT/SIGTERM (after its checkpoint).
        RunnerError: What the child reported it failed of (a spec error, a user-code error, ...).
        TrainingError: The child ended without a result or a reason (killed by a signal, say).
    """
    import dataclasses

    from runner.launch.failures import ended_by, oom_kill_count
    from runner.training import WorkerResult

    assert args.hub is not None
    path = Path(args.hub.path).with_name(ARGS_FILE)
    path.write_bytes(pickle.dumps(dataclasses.replace(args, launcher_pid=os.getpid())))
    oom_before = oom_kill_count()
    child = subprocess.Popen([sys.executable, "-m", "runner.launch.child", str(path)])
    code = _wait_passing_signals(child, lambda: session.store_error is not None)
    if session.result is not None and code == 0:
        return WorkerResult(**session.result)
    failure = session.failure
    if failure is not None:
        raise failure
    if session.build_error is not None or session.store_error is not None:
        return WorkerResult(rank=0)  # the driver raises why it made no run
    if code == 0:
        raise TrainingError("the worker exited without a result (sys.exit(0) during training)")
    if code == Interrupted.exit_code:
        raise Interrupted()
    raise TrainingError(f"the training process {ended_by(code, oom_before)}")


def _wait_passing_signals(child: subprocess.Popen[bytes], pointless: Callable[[], bool]) -> int:
    """Wait for ``child``; a SIGINT or SIGTERM this process gets meanwhile is passed on to it.

    Once ``pointless()`` (the store could not be opened: no run will be made) the child is killed rather than
    left to import torch and build for nothing.
    """

    def pass_on(signum: int, frame: FrameType | None) -> None:
        with contextlib.suppress(OSError):
            child.send_signal(signum)

    previous = {sig: signal.signal(sig, pass_on) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        while True:
            try:
                return child.wait(timeout=_POLL_S)
            except subprocess.TimeoutExpired:
                if pointless():
                    child.kill()
            except KeyboardInterrupt:  # a handler installed by someone else raised: keep waiting for the child
                continue
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


_POLL_S = 0.1


def main(argv: list[str] | None = None) -> int:
    """The child's entry: train the pickled arguments; the exit status says how it ended (the hub says why)."""
    from runner.launch.worker import run_worker

    path = Path((argv if argv is not None else sys.argv[1:])[0])
    args = pickle.loads(path.read_bytes())
    try:
        run_worker(args)
    except RunnerError as exc:
        return exc.exit_code
    except KeyboardInterrupt:
        return Interrupted.exit_code
    except Exception:
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Starting ddp workers through torch's elastic launcher, and reading why a launched job failed.

``elastic_launch`` (``torch.distributed.launcher.api``, the machinery behind ``torchrun``) starts
``nproc_per_node`` workers with a c10d rendezvous (``localhost:0`` on one node: the OS picks a
free port). The workers fork from a process that imported torch, ``torch._dynamo`` and the worker's modules
(``PRELOAD``) once per job, instead of each importing them again: the launcher of its own process (``fork``, it
imported them while the driver planned and runs no other thread of ours), else, for a launch inside the driver
(several nodes), Python's fork server, stopped after each job so that the next job's workers start from that
job's environment (every worker holds the server's end-of-clients pipe, so the kernel's parent-death signal never
comes). Each worker watches its launcher's pid (a pidfd) and stops as on SIGTERM when it ends, checkpoint first. The
launcher runs in a process of its own (``run_agent``), which turns what ``elastic_launch`` raised into data
(``LaunchFailed``: the stop signal and rank, the spec error a rank's build found, or the run's message) that the
driver reads back. See
docs/design.md §6. torch is imported inside the functions.

The launcher's process stops the job once on SIGINT or SIGTERM: a signal less than 1 s after the first is the
same stop delivered twice (the driver passes on what a terminal or Slurm also sent there), as the workers count
it (``runner.launch.worker``); a later one stops again. The driver, waiting for it, passes both signals on, and kills
it at once when no run will be made (the store could not be opened), rather than let it import torch for nothing.

A worker that returned its result and then dies by a signal at interpreter exit (torch's gloo
teardown sometimes aborts with ``terminate called without an active exception``, SIGABRT) has
done its work: each worker leaves its result in the launcher's folder as it returns, so such an
exit is noted and the job's results stand, instead of a finished run ending FAILED.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import importlib
import json
import multiprocessing
import os
import pickle
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

from runner.errors import Interrupted, RunnerError, SpecError, SpecIssue, TrainingError, exit_quickly
from runner.launch.failures import (
    JobContext,
    describe_failure,
    die_with_parent,
    ended_by,
    interruption,
    oom_kill_count,
    python_error,
    quiet_launcher_logs,
    read_hang_reports,
)
from runner.launch.worker import run_worker

if TYPE_CHECKING:
    from runner.launch.failures import HangReports
    from runner.launch.worker import WorkerArgs
    from runner.plan import Plan
    from runner.training import WorkerResult


class LaunchFailed(Exception):
    """Why an elastic job failed, judged where its launcher ran: ``stopped`` is ``(signal, rank)`` when the ranks
    stopped on a signal (``rank`` ``None``: the launcher got it); else ``error``, the run's message, and
    ``spec_error``, what a rank's build found."""

    def __init__(self, error: str, stopped: tuple[int, int | None] | None = None, spec_error: SpecError | None = None):
        super().__init__(error, stopped, spec_error)
        self.error = error
        self.stopped = stopped
        self.spec_error = spec_error


def launch_failure(exc: BaseException, context: JobContext) -> LaunchFailed:
    """:class:`LaunchFailed` of what a launch (or an in-process worker) raised."""
    stopped = interruption(exc)  # a signal to one rank: every rank stopped after the checkpoint
    if stopped is None and type(exc).__name__ == "SignalException":  # torch elastic's: the launcher got a stop
        stopped = (int(getattr(exc, "sigval", signal.SIGTERM)), None)
    error = "" if stopped else describe_failure(exc, context)
    if getattr(exc, "ranks_log", None):
        error += f"\nthe ranks' full tracebacks: {exc.ranks_log}"  # type: ignore[attr-defined]
    return LaunchFailed(error, stopped, spec_error_of_child(exc))


_AGENT_ARGS = "agent-args.pkl"
_AGENT_OUTCOME = "agent-outcome.pkl"


def run_agent(plan: Plan, args: WorkerArgs, hangs: HangReports) -> list[WorkerResult]:
    """Run ``plan``'s workers under the elastic launcher in a process of its own that gets this one's stop signals
    (module note); return their results, the logging rank's first. Raises LaunchFailed (with ``hangs``) when the job
    failed or stopped, TrainingError when the launcher died."""
    oom_before = oom_kill_count()
    with tempfile.TemporaryDirectory(prefix="runner-agent-") as folder:
        path = Path(folder) / _AGENT_ARGS
        path.write_bytes(pickle.dumps((plan, args, oom_before, os.getpid())))
        # SIGINT and SIGTERM are the agent's own (_stop_once); elastic handles the rest
        env = {**os.environ, "TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGHUP,SIGQUIT"}
        child = _start(["--agent", str(path)], env)
        code = _wait_passing_signals(child)
        done = path.with_name(_AGENT_OUTCOME)
        if not done.exists() and code in (-signal.SIGINT, -signal.SIGTERM):  # stopped before its handlers were in
            raise LaunchFailed("", (-code, None))
        if not done.exists():
            raise TrainingError(f"the elastic launcher {ended_by(code, oom_before)}")
        outcome, found = pickle.loads(done.read_bytes())
    hangs.update(found)
    if isinstance(outcome, LaunchFailed):
        raise outcome
    return list(outcome)


def _agent_main(path: Path) -> int:
    """The launcher process: run the job, leave its outcome (results or :class:`LaunchFailed`) beside ``path``."""
    plan, args, oom_before, driver = pickle.loads(path.read_bytes())
    die_with_parent(driver, signal.SIGTERM)  # a driver killed hard: stop the workers as a stop signal does
    _stop_once()
    hangs: HangReports = {}
    outcome: list[WorkerResult] | LaunchFailed
    try:
        outcome = launch_elastic(plan, args, hangs, fork=True)
    except Exception as exc:  # SignalException included
        outcome = launch_failure(exc, JobContext(plan.loaded.spec.parallel.timeout_s, oom_before, hangs))
    from runner.training.checkpoint import write_atomic  # here: not on the driver's way to the first step

    write_atomic(path.parent, pickle.dumps((outcome, hangs)), final=path.with_name(_AGENT_OUTCOME))  # whole or absent
    return 0


def _stop_once() -> None:
    """SIGINT and SIGTERM stop the job once: a signal within 1 s of the first is the same stop (module note)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    first: list[float] = []

    def stop(signum: int, frame: FrameType | None) -> None:
        if first and time.monotonic() - first[0] < 1.0:
            return
        first[:] = [time.monotonic()]
        raise SignalException(f"Process {os.getpid()} got signal: {signum}", sigval=signal.Signals(signum))

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, stop)


def launch_elastic(
    plan: Plan, args: WorkerArgs, hangs: HangReports | None = None, *, fork: bool = False
) -> list[WorkerResult]:
    """Run ``plan``'s workers under the elastic launcher in this process; return their results, the logging rank's
    first. The workers fork from this process (``fork``: one that runs nothing else) or from a fork server. Raises
    ``ChildFailedError`` or ``SignalException``."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    par = plan.loaded.spec.parallel
    rdzv = plan.rendezvous
    assert rdzv is not None  # the plan has one for every elastic launch
    config = LaunchConfig(
        min_nodes=rdzv.nnodes,
        max_nodes=rdzv.nnodes,
        nproc_per_node=plan.devices.nproc_per_node,
        run_id=rdzv.run_id,
        rdzv_backend="c10d",
        rdzv_endpoint=rdzv.endpoint or "localhost:0",
        rdzv_configs={"is_host": rdzv.node_rank == 0} if rdzv.nnodes > 1 else {},
        max_restarts=par.max_restarts,
        monitor_interval=0.1,
        start_method="fork" if fork else "forkserver",
    )
    ranks_log = Path(tempfile.gettempdir()) / f"runner-ranks-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"
    with tempfile.TemporaryDirectory(prefix="runner-elastic-") as log_dir, quiet_launcher_logs(ranks_log) as quiet:
        # The launcher keeps per-attempt error files here, the workers their hang reports; removed when the job ends.
        config.logs_specs = DefaultLogsSpecs(log_dir=log_dir)
        launched = dataclasses.replace(args, launcher_pid=None, report_dir=log_dir)  # they watch this process
        if fork:
            preload()
        else:
            multiprocessing.set_forkserver_preload(list(PRELOAD))
        try:
            results = elastic_launch(config, run_and_leave_result)(launched, os.getpid())
        except Exception as exc:
            results = finished_despite(exc, Path(log_dir), plan.devices.nproc_per_node)
            if results is None:
                if quiet.written:
                    exc.ranks_log = str(quiet.path)  # type: ignore[attr-defined]  # named by the failure message
                raise
        finally:
            # A fork server keeps the environment it started with: the next job in this process (a test, a sweep)
            # starts a fresh one. ``ForkServer._stop`` is CPython's own (private) way, since 3.8.
            from multiprocessing import forkserver  # not on the driver's way to the first step

            with contextlib.suppress(Exception):
                forkserver._forkserver._stop()  # type: ignore[attr-defined]
            if hangs is not None:
                hangs.update(read_hang_reports(Path(log_dir)))
    done = [r for r in results.values() if r is not None]
    done.sort(key=lambda r: (not r.metrics, r.rank))
    return done


# The workers fork from a process that imported these once per job, instead of each importing torch (and, at its
# first optimizer step, torch._dynamo) again: the launcher of its own process, which imports them while the driver
# plans, else Python's fork server (benchmarks/README.md). Nothing there starts CUDA or OpenMP's threads.
PRELOAD = ("torch", "torch._dynamo", "runner.launch.worker", "runner.training.setup")


def preload() -> None:
    for name in PRELOAD:
        importlib.import_module(name)


ABORT_AT_EXIT_VAR = "RUNNER_TEST_ABORT_AT_EXIT"  # fault injection: this rank aborts at exit after its work
_RESULT_FILE = "result-rank-{rank}.pkl"


def run_and_leave_result(args: WorkerArgs, launcher: int) -> WorkerResult | None:
    """The elastic workers' entry point: :func:`~runner.launch.worker.run_worker`, then its result left in
    ``args.report_dir`` for :func:`finished_despite`. A worker stops as on SIGTERM when its ``launcher`` ends."""
    from torch.distributed.elastic.multiprocessing.errors import record

    signal.signal(signal.SIGINT, signal.default_int_handler)  # not the launcher's, when forked from it
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _stop_when_gone(launcher)
    result = record(run_worker)(args)  # the failure's traceback in the launcher's error file
    rank = os.environ.get("RANK", "0")
    if args.report_dir is not None:
        path = Path(args.report_dir) / _RESULT_FILE.format(rank=rank)
        from runner.training.checkpoint import write_atomic

        write_atomic(path.parent, pickle.dumps(result), final=path)  # whole or absent
    if os.environ.get(ABORT_AT_EXIT_VAR) == rank:  # at the process's exit, after its result went back
        from multiprocessing.util import Finalize

        Finalize(None, os.abort, exitpriority=0)  # a forked worker ends with os._exit: atexit never runs

    gc.freeze()  # this process ends next: its teardown skips torch's objects (runner.errors.exit_quickly)
    return result


def _stop_when_gone(pid: int) -> None:
    """SIGTERM this process once process ``pid`` ends (a pidfd, else a poll every second; module note)."""

    def watch() -> None:
        try:
            fd = os.pidfd_open(pid)
            select.select([fd], [], [])
        except (AttributeError, OSError):  # no pidfd (before Linux 5.3, not Linux)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                while True:
                    os.kill(pid, 0)
                    time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="runner-launcher-watch", daemon=True).start()


def finished_despite(exc: BaseException, folder: Path, local_workers: int) -> dict[int, WorkerResult | None] | None:
    """The workers' results when every rank of this node finished and the failures are only deaths by a signal after
    that (e.g. SIGABRT in gloo's teardown), each noted on standard error; else ``None`` (a real failure)."""
    failures = getattr(exc, "failures", None) or {}
    files = {int(p.stem.rpartition("-")[2]): p for p in folder.glob(_RESULT_FILE.format(rank="*"))}
    if not failures or len(files) < local_workers:
        return None
    if any(rank not in files or failure.exitcode >= 0 for rank, failure in failures.items()):
        return None
    for rank, failure in sorted(failures.items()):
        print(
            f"runner: note: rank {rank} {ended_by(int(failure.exitcode), None)} after it finished its work "
            f"(torch's gloo teardown at interpreter exit does this at times); the run is complete",
            file=sys.stderr,
            flush=True,
        )
    return {rank: pickle.loads(path.read_bytes()) for rank, path in files.items()}


def spec_error_of_child(exc: BaseException) -> SpecError | None:
    """The SpecError a DDP worker raised while building, recovered from the launcher's failure record."""
    marker = "runner.errors.SpecError: "
    for failure in (getattr(exc, "failures", None) or {}).values():
        text = python_error(failure)
        if text.startswith(marker):
            text = text.removeprefix(marker).strip()
            issues = []
            for line in text.splitlines():
                key, sep, message = line.partition(": ")
                issues.append(
                    SpecIssue(None, None, key, message) if sep and " " not in key else SpecIssue(None, None, "", line)
                )
            return SpecError(issues)
    return None


ARGS_FILE = "worker-args.pkl"
_ready: tuple[subprocess.Popen[bytes], int] | None = None  # the prestarted process and its pipe
_SELF = (sys.executable, "-m", "runner.launch.elastic")  # this module as a process: its main() takes the rest


@contextlib.contextmanager
def prestarted() -> Iterator[None]:
    """Start ``python -m runner.launch.elastic --ready FD`` now: it imports torch while the driver reads the spec and
    plans (benchmarks/README.md), then the block's first launch hands it its arguments, environment and folder on its
    pipe (:func:`_start`); one the block did not use is ended at its end."""
    global _ready
    read, write = os.pipe()
    proc = subprocess.Popen([*_SELF, "--ready", str(read)], pass_fds=(read,))
    os.close(read)
    _ready = (proc, write)
    try:
        yield
    finally:
        if _ready is not None:
            _ready = None
            proc.kill()
            proc.wait()
            os.close(write)


def _start(argv: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
    """``python -m runner.launch.elastic ARGV`` in ``env``: the prestarted process while it lives, else a new one."""
    global _ready
    if _ready is not None:
        (proc, write), _ready = _ready, None
        with contextlib.suppress(OSError), os.fdopen(write, "w") as pipe:
            pipe.write(json.dumps({"argv": argv, "env": env, "cwd": os.getcwd()}))
        if proc.poll() is None:
            return proc
    return subprocess.Popen([*_SELF, *argv], env=env)


def _ready_main(fd: int) -> int:
    """The prestarted process: import what both uses need (:data:`PRELOAD`), then wait for its arguments (none: end)."""
    preload()
    with os.fdopen(fd) as pipe:
        text = pipe.read()
    if not text:
        return 0
    given = json.loads(text)
    os.chdir(given["cwd"])
    if fresh_start_needed(dict(os.environ), given["env"]):
        os.execve(sys.executable, [*_SELF, *given["argv"]], given["env"])  # the same process (pid), started anew
    os.environ.clear()
    os.environ.update(given["env"])  # as the driver has it now: the devices it chose, the launcher's variables
    signal.signal(signal.SIGINT, signal.default_int_handler)
    return main(given["argv"])


def fresh_start_needed(now: dict[str, str], given: dict[str, str]) -> bool:
    """Whether the driver changed the devices (``CUDA_VISIBLE_DEVICES``, ``CUDA_DEVICE_ORDER``) after CUDA started in
    this process while it imported: CUDA reads them once, so the process must start again."""
    import torch

    keys = ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER")
    return torch.cuda.is_initialized() and any(now.get(k) != given.get(k) for k in keys)


def run_child(args: WorkerArgs, pointless: Callable[[], bool | None]) -> tuple[int, int | None]:
    """Train ``args`` in a child process: ``(its exit code, the OOM kills counted before it started)``, for
    :func:`runner.launch.failures.ended_by`. The child is killed once ``pointless()`` says no run will be made; what it
    reported went to the driver's hub."""
    assert args.hub is not None
    path = Path(args.hub.path).with_name(ARGS_FILE)
    path.write_bytes(pickle.dumps(dataclasses.replace(args, launcher_pid=os.getpid())))
    oom_before = oom_kill_count()
    child = _start([str(path)], dict(os.environ))
    return _wait_passing_signals(child, pointless), oom_before


def _wait_passing_signals(child: subprocess.Popen[bytes], pointless: Callable[[], bool | None] | None = None) -> int:
    """Wait for ``child``, passing SIGINT/SIGTERM on; kill it once ``pointless()`` says no run will be made."""

    def pass_on(signum: int, frame: FrameType | None) -> None:
        with contextlib.suppress(OSError):
            child.send_signal(signum)

    previous = {sig: signal.signal(sig, pass_on) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        while True:
            try:
                return child.wait(timeout=_POLL_S if pointless is not None else None)
            except subprocess.TimeoutExpired:
                verdict = pointless() if pointless is not None else None
                if verdict:
                    child.kill()
                elif verdict is None:
                    pointless = None
            except KeyboardInterrupt:  # a handler installed by someone else raised: keep waiting for the child
                continue
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


_POLL_S = 0.1


def main(argv: list[str] | None = None) -> int:
    """The child's entry: train the pickled arguments; the exit status says how it ended (the hub says why). With
    ``--agent``: the elastic launcher of a ddp or fsdp job (:func:`run_agent`)."""
    argv = list(argv if argv is not None else sys.argv[1:])
    if argv[0] == "--ready":
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # a Ctrl-C before it is used: end quietly
        return _ready_main(int(argv[1]))
    if argv[0] == "--agent":
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # a stop before _stop_once: end quietly, the driver says why
        return _agent_main(Path(argv[1]))
    path = Path(argv[0])
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
    # this file again, as itself: what the agent pickles (LaunchFailed) is then found by its name
    exit_quickly(importlib.import_module("runner.launch.elastic").main())

"""Warm worker processes for ``runner bench``: started once, they train every repeat of every configuration.

A fresh interpreter per measurement spends seconds importing torch and building the launcher
before a step of a fraction of a millisecond is timed. The pool starts ``n`` processes
(``spawn``) at the beginning of the bench, while the bench process plans and opens its MLflow
runs; each one imports torch and runner's training code once. A repeat of a configuration is
one ``runner.launch.worker.run_worker`` call on processes ``0 .. world_size - 1``: for
a mode of one process per device they take the variables torch's elastic launcher would set
(``runner.launch.worker.torchrun_env``: ``RANK``, ``WORLD_SIZE``, a fresh ``MASTER_PORT`` per repeat, ...) for the
repeat alone, and build a new process group.

Before each repeat a worker restores its thread count (each repeat sets its own), resets the CUDA
allocator peaks and its peak resident set size (``/proc/self/clear_refs``), so the memory figures
are those of that repeat. ``CUDA_VISIBLE_DEVICES`` is fixed for the pool's lifetime, to the
devices of the widest configuration; every configuration uses a prefix ``0 .. n-1`` of them.

When one rank of a repeat fails, the others may wait in a collective until the process group's
timeout: the pool ends them at once and starts fresh processes for later configurations.
"""

from __future__ import annotations

import contextlib
import gc
import multiprocessing
import os
import socket
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING, Any, cast

from runner.errors import DeviceError, Interrupted, RunnerError, SpecError, TrainingError, UsageError
from runner.tools.compare import probe_model_and_data, reason

if TYPE_CHECKING:
    from multiprocessing.context import SpawnProcess

    from runner.devices.resolve import DevicePlan
    from runner.spec.loading import LoadedSpec
    from runner.training import WorkerResult


@dataclass(frozen=True)
class Job:
    """One repeat of one configuration on one rank (picklable); ``ddp`` sets the launcher's variables."""

    loaded: LoadedSpec
    plan: DevicePlan
    rank: int = 0
    world_size: int = 1
    master_port: int = 0
    ddp: bool = False


@dataclass(frozen=True)
class Probe:
    """Build the datasets and the model of ``loaded`` once (:func:`runner.tools.compare.probe_model_and_data`)."""

    loaded: LoadedSpec


@dataclass
class Reply:
    """A rank's answer for one repeat: ``ok``, ``skipped``, ``failed`` or ``interrupted``, with its result and CUDA
    peaks."""

    status: str
    reason: str = ""
    result: WorkerResult | None = None
    cuda_peaks: list[int] = field(default_factory=list)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class WarmPool:
    """Up to ``size`` warm worker processes with ``env`` on top of this one's (the module docstring)."""

    def __init__(self, size: int, env: Mapping[str, str] | None = None) -> None:
        self.size = size
        self.env = dict(env or {})
        self._procs: list[tuple[SpawnProcess, Connection] | None] = [None] * size

    def start(self) -> None:
        """Start every missing worker; returns at once (they import torch in the background)."""
        from runner.devices.inventory import scoped_environ

        ctx = multiprocessing.get_context("spawn")
        with scoped_environ(self.env):  # a spawned child copies the environment when it starts
            for i, slot in enumerate(self._procs):
                if slot is None or not slot[0].is_alive():
                    ours, theirs = ctx.Pipe()
                    proc = ctx.Process(target=serve, args=(theirs,), name=f"runner-bench-{i}", daemon=False)
                    proc.start()
                    theirs.close()
                    self._procs[i] = (proc, ours)

    def run(self, jobs: Sequence[Job]) -> list[Reply]:
        """Run ``jobs[r]`` on worker ``r`` for every rank at once; a failed rank ends the repeat and the others are
        replaced."""
        self.start()
        pending: dict[Connection, int] = {}
        for rank, job in enumerate(jobs):
            slot = self._procs[rank]
            assert slot is not None  # started above
            slot[1].send(job)
            pending[slot[1]] = rank
        replies: list[Reply | None] = [None] * len(jobs)
        try:
            while pending:
                for ready in wait(list(pending)):
                    conn = cast(Connection, ready)
                    rank = pending.pop(conn)
                    reply = replies[rank] = self._receive(rank, conn)
                    if reply.status != "ok":
                        self._stop(sorted(pending.values()))
                        pending.clear()
        except KeyboardInterrupt:
            self.close()
            raise Interrupted() from None
        first_bad = next((r for r in replies if r is not None and r.status != "ok"), None)
        return [r if r is not None else (first_bad or Reply("failed", "no reply")) for r in replies]

    def submit(self, rank: int, message: Probe) -> None:
        """Send ``message`` to worker ``rank`` without waiting; :meth:`collect` fetches the answer."""
        self.start()
        slot = self._procs[rank]
        assert slot is not None  # started above
        slot[1].send(message)

    def collect(self, rank: int) -> Any:
        """Worker ``rank``'s answer (a failed :class:`Reply` if it died); Interrupted on SIGINT."""
        slot = self._procs[rank]
        assert slot is not None
        try:
            return self._receive(rank, slot[1])
        except KeyboardInterrupt:
            self.close()
            raise Interrupted() from None

    def _receive(self, rank: int, conn: Connection) -> Any:
        try:
            reply = conn.recv()
        except (EOFError, OSError):
            slot = self._procs[rank]
            proc = slot[0] if slot else None
            if proc is not None:
                proc.join(timeout=5)
            self._procs[rank] = None
            code = proc.exitcode if proc is not None else None
            return Reply("failed", f"the benchmark process of rank {rank} died (exit code {code})")
        return reply

    def _stop(self, ranks: Sequence[int]) -> None:
        for rank in ranks:
            slot = self._procs[rank]
            if slot is not None:
                slot[0].kill()
                slot[0].join(timeout=10)
                slot[1].close()
                self._procs[rank] = None

    def close(self) -> None:
        """Ask every worker to exit, then end those that do not within a few seconds."""
        for slot in self._procs:
            if slot is not None:
                with contextlib.suppress(OSError):
                    slot[1].send(None)
        for slot in self._procs:
            if slot is not None:
                slot[0].join(timeout=5)
        self._stop(range(self.size))  # what is still alive is killed


# ----------------------------------------------------------------------------- inside a worker


def serve(conn: Connection) -> None:
    """Body of a warm worker: import the training code, then run jobs until told to stop (stdout goes to stderr)."""
    sys.stdout.flush()
    os.dup2(2, 1)
    import torch

    import runner.launch.worker  # warm: torch, strategies, training, loaders
    import runner.training.data  # noqa: F401

    threads = torch.get_num_threads()
    gc.collect()
    gc.freeze()  # the imported modules are permanent: each repeat's gc.collect() then only scans its own objects
    while True:
        try:
            job = conn.recv()
        except (EOFError, KeyboardInterrupt):
            return
        if job is None:
            return
        torch.set_num_threads(threads)
        if isinstance(job, Job):
            conn.send(run_job(job))
            continue
        try:  # a probe's figures, else the exception, for the caller to raise
            answer: Any = probe_model_and_data(job.loaded)
        except Exception as exc:
            answer = exc
        conn.send(answer)


def run_job(job: Job) -> Reply:
    """Train one repeat in this process; failures become replies, and no MLflow run is touched."""
    from runner.devices.inventory import scoped_environ
    from runner.launch.worker import WorkerArgs, run_worker, torchrun_env

    _reset_peaks()
    rank_env = torchrun_env(job.rank, job.world_size, str(job.master_port)) if job.ddp else {}
    try:
        with tempfile.TemporaryDirectory(prefix="runner-bench-") as folder, scoped_environ(rank_env):
            args = WorkerArgs(job.loaded, job.plan, None, folder, resume=False, sync_timing=True)
            result = run_worker(args)
    except (SpecError, DeviceError, UsageError) as exc:
        return Reply("skipped", reason(exc))
    except (Interrupted, KeyboardInterrupt):
        return Reply("interrupted", "interrupted")
    except TrainingError as exc:
        return Reply("failed", reason(exc))
    except (RunnerError, Exception) as exc:
        return Reply("failed", f"{type(exc).__name__}: {reason(exc)}")
    if result is None:
        return Reply("failed", "the worker exited without a result")
    torch: Any = sys.modules.get("torch")
    on_cuda = torch is not None and torch.cuda.is_initialized()
    peaks = [int(torch.cuda.max_memory_allocated(i)) for i in range(torch.cuda.device_count())] if on_cuda else []
    return Reply("ok", result=result, cuda_peaks=peaks)


def _reset_peaks() -> None:
    """Start this repeat's memory peaks afresh: CUDA allocator peaks and the peak RSS (``VmHWM``)."""
    torch: Any = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        for i in range(torch.cuda.device_count()):
            torch.cuda.reset_peak_memory_stats(i)
    with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w", encoding="ascii") as fh:
        fh.write("5")  # Linux: reset the peak resident set size to the current one (proc(5))

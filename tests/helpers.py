"""Shared test helpers: the repository's paths, one builder for spec text (TOML) and spec objects, waiting, a server.

A test states only what its spec changes against one of two bases: ``MINIMAL`` (a two-epoch CPU run on
96 synthetic samples, logging every step, the template of ``conftest.write_spec``) or ``SMALL`` (the
fewest keys a valid spec needs, for tests that never train). ``changes`` name a top-level key or a
table: a table's dict is merged into the base's table, and ``None`` removes a key or a whole table.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from subprocess import Popen
from typing import TYPE_CHECKING, Any

import pytest

from runner.errors import toml_value  # the project's one TOML value writer

if TYPE_CHECKING:
    from runner.spec.loading import LoadedSpec
    from runner.spec.schema import ExperimentSpec

REPO = Path(__file__).resolve().parents[1]
ASSETS = REPO / "tests" / "assets"

# The order tables are written in (others follow in the order given); spec files read the same in any order.
TABLE_ORDER = (
    "model",
    "data",
    "devices",
    "parallel",
    "optim",
    "scheduler",
    "loss",
    "metrics",
    "train",
    "checkpoint",
    "tracking",
    "sweep",
)

MINIMAL: dict[str, Any] = {
    "name": "t",
    "seed": 0,
    "model": {"name": "mlp", "kwargs": {"hidden": [32]}},
    "data": {
        "dataset": "synthetic",
        "num_samples": 96,
        "input_shape": [8],
        "num_classes": 3,
        "batch_size": 16,
        "val_fraction": 0.25,
    },
    "devices": {"accelerator": "cpu"},
    "optim": {"name": "sgd", "lr": 0.1},
    "train": {"epochs": 2, "log_every_n_steps": 1, "progress": "off"},
    "tracking": {"experiment": "tests"},
}

SMALL: dict[str, Any] = {
    "name": "t",
    "model": {"name": "mlp"},
    "data": {"dataset": "synthetic", "batch_size": 8},
    "optim": {"lr": 0.1},
}

DDP_2: dict[str, Any] = {"mode": "ddp", "nproc_per_node": 2}


# A user module for the process-model tests (RUNNER_TEST_PROBE names a folder): ``probes:model`` (an MLP) and
# ``probes:loss`` (cross-entropy) note, once per process, in file ``trains-<pid>``, whether the process that runs
# forward and backward holds mlflow; ``probes:model`` also notes which process built it (``built-<pid>``).
PROBES = """
import os, sys
from pathlib import Path

import torch


def _note(*_):
    mine = Path(os.environ["RUNNER_TEST_PROBE"]) / f"trains-{os.getpid()}"
    if not mine.exists():
        held = any(name == "mlflow" or name.startswith("mlflow.") for name in sys.modules)
        mine.write_text("mlflow" if held else "clean")


def loss(output, target):
    _note()
    return torch.nn.functional.cross_entropy(output, target)


def model(in_features=8, num_classes=3):
    (Path(os.environ["RUNNER_TEST_PROBE"]) / f"built-{os.getpid()}").touch()
    net = torch.nn.Sequential(torch.nn.Linear(in_features, 16), torch.nn.ReLU(), torch.nn.Linear(16, num_classes))
    net.register_forward_pre_hook(_note)
    return net
"""


def readme_example(command: str) -> list[str]:
    """The lines of README.md's fenced block that starts with ``$ command``, without the command."""
    import re

    text = (REPO / "README.md").read_text(encoding="utf-8")
    block = re.search(rf"^\$ {re.escape(command)}\n(.*?)^```", text, flags=re.MULTILINE | re.DOTALL)
    assert block is not None, f"no example of `{command}` in README.md"
    return block.group(1).splitlines()


def memory_spec(folder: Path, **changes: Any) -> LoadedSpec:
    """A small CNN with Adam on synthetic 3x16x16 images (batch 32): every kind of memory is there, for the estimate."""
    from runner.spec.loading import load_spec

    data = {"dataset": "synthetic", "batch_size": 32, "num_samples": 64, "input_shape": [3, 16, 16], "num_classes": 5}
    body = spec_text(
        SMALL, compact=True, model={"name": "cnn"}, data=data, optim={"name": "adam", "lr": 0.01}, **changes
    )
    path = folder / "cnn.toml"
    path.write_text(body, encoding="utf-8")
    return load_spec(path)


def spec_dict(base: Mapping[str, Any] = MINIMAL, **changes: Any) -> dict[str, Any]:
    """``base`` with ``changes``: a dict merges into the table of that name, ``None`` removes the key or table."""
    out: dict[str, Any] = {k: dict(v) if isinstance(v, dict) else v for k, v in base.items()}
    for key, value in changes.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            merged = {**out[key], **value}
            out[key] = {k: v for k, v in merged.items() if v is not None}
        else:
            out[key] = value
    return out


def toml_text(spec: Mapping[str, Any], *, compact: bool = False) -> str:
    """``spec`` as a TOML file: top-level keys first, then one ``[table]`` each in ``TABLE_ORDER``.

    ``compact`` leaves out the blank line between tables (line numbers stay easy to count in a test).
    """
    lines = [f"{k} = {toml_value(v)}" for k, v in spec.items() if not isinstance(v, dict)]
    tables = [k for k in TABLE_ORDER if isinstance(spec.get(k), dict)]
    tables += [k for k, v in spec.items() if isinstance(v, dict) and k not in TABLE_ORDER]
    for name in tables:
        lines += [] if compact else [""]
        lines += [f"[{name}]", *(f"{k} = {toml_value(v)}" for k, v in spec[name].items())]
    return "\n".join(lines) + "\n"


def spec_text(base: Mapping[str, Any] = MINIMAL, *, compact: bool = False, **changes: Any) -> str:
    """The TOML text of ``base`` with ``changes`` (see ``spec_dict``)."""
    return toml_text(spec_dict(base, **changes), compact=compact)


def write_spec_file(path: Path, base: Mapping[str, Any] = MINIMAL, **changes: Any) -> Path:
    """Write ``spec_text(base, **changes)`` to ``path`` and return it."""
    path.write_text(spec_text(base, **changes), encoding="utf-8")
    return path


def spec_object(base: Mapping[str, Any] = SMALL, **changes: Any) -> ExperimentSpec:
    """A validated ``ExperimentSpec`` of ``base`` with ``changes`` (no file: nothing has a line)."""
    from runner.spec.schema import ExperimentSpec

    return ExperimentSpec.model_validate(spec_dict(base, **changes))


def run_in_process(write_spec: Callable[[], Path], *sets: str, store: bool = False) -> Any:
    """``exec_experiment`` of a written spec in this process: the loop's features, not the process model; without
    ``store`` nothing is tracked or checkpointed."""
    from runner.launch.driver import exec_experiment
    from runner.launch.session import ExecOptions
    from runner.spec.loading import load_spec

    tracking = [] if store else ["tracking.enabled=false", "checkpoint.enabled=false"]
    return exec_experiment(load_spec(write_spec(), [*tracking, *sets]), ExecOptions(in_process=True))


def series(result: Any, key: str) -> list[tuple[int, float]]:
    """``(step, value)`` of metric ``key`` in a run result's history."""
    return [(step, m[key]) for step, m in result.history if key in m]


def exec_args(spec: Path, *sets: str) -> list[str]:
    """The arguments of ``runner exec SPEC --set A --set B ...``."""
    return ["exec", str(spec), *(arg for item in sets for arg in ("--set", item))]


def wait_for(condition: Callable[[], bool], what: str, timeout_s: float = 240, proc: Popen | None = None) -> None:
    """Poll ``condition`` every 0.1 s until it holds; fail naming ``what`` at ``timeout_s`` or when ``proc`` ends.

    Raises:
        AssertionError: the time is up, or ``proc`` (the process that should make it true) ended first.
    """
    deadline = time.monotonic() + timeout_s
    while not condition():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the process ended before {what}: {proc.communicate()}")
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def listening_addresses(pid: int) -> set[str]:
    """Local addresses of every TCP socket that process ``pid`` or any process below it listens on."""
    import psutil

    root = psutil.Process(pid)
    found: set[str] = set()
    for proc in [root, *root.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):  # a process that ended meanwhile
            found |= {c.laddr.ip for c in proc.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN}
    return found


def assert_loopback_only(pid: int, what: str) -> None:
    """A server a test starts listens, and listens on 127.0.0.1 (or ::1) only: never on every interface."""
    found = listening_addresses(pid)
    assert found and found <= {"127.0.0.1", "::1"}, f"{what} listens on {sorted(found)}: bind 127.0.0.1 only"


class MlflowServer:
    """A real ``mlflow server`` on 127.0.0.1 (its own process group) that a test may stop and start again.

    It keeps its port and its store (``folder/server.db``, artifacts in ``folder/server-artifacts``) across restarts.
    """

    def __init__(self, folder: Path):
        self.folder, self.port = folder, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: Popen | None = None

    def start(self, timeout_s: float = 180) -> None:
        """Start the server and return once its ``/health`` answers 200."""
        cmd = [
            sys.executable, "-m", "mlflow", "server",
            "--host", "127.0.0.1",
            "--port", str(self.port),
            "--workers", "1",
            "--backend-store-uri", f"sqlite:///{self.folder}/server.db",
            "--artifacts-destination", str(self.folder / "server-artifacts"),
        ]  # fmt: skip
        with open(self.folder / "server.log", "ab") as log:
            env = {
                **os.environ,
                "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
            }  # no job runner: runs and artifacts only
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        wait_for(self._healthy, "the mlflow server to answer", timeout_s=timeout_s)
        assert_loopback_only(self.proc.pid, "the test mlflow server")

    def _healthy(self) -> bool:
        import requests

        assert self.proc is not None and self.proc.poll() is None, (self.folder / "server.log").read_text()[-3000:]
        try:
            return requests.get(self.url + "/health", timeout=1).status_code == 200
        except requests.RequestException:
            return False

    def stop(self) -> None:
        """Stop the whole process group: SIGTERM, then SIGKILL after 20 s."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=20)


def elastic_run(fn: Callable[..., Any], nproc: int, name: str = "test", *args: Any) -> dict[int, Any]:
    """Run ``fn(*args)`` on ``nproc`` spawned local ranks with torch elastic (c10d on a free localhost port, no
    restarts).

    Returns:
        ``fn``'s return value of each rank, by global rank.
    """
    import uuid

    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"{name}-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        max_restarts=0,
        monitor_interval=0.1,
        start_method="spawn",
    )
    return elastic_launch(config, fn)(*args)


class AsyncStore:
    """An ``MlflowClient`` stand-in for asynchronous logging: each ``log_batch(..., synchronous=False)`` is sent to
    the real client on a thread of its own, as MLflow's queue does. ``down`` fails it as a store that does not answer;
    while ``gate`` is set and not released, it waits as a store that hangs."""

    def __init__(self, real: Any):
        import threading

        self.real, self.down, self.calls, self.started = real, False, 0, threading.Event()
        self.gate: Any = None

    def log_batch(self, run_id: str, metrics: Any = (), tags: Any = (), synchronous: bool = True) -> Any:
        import threading
        from concurrent.futures import Future

        from mlflow.utils.async_logging.run_operations import RunOperations

        self.calls += 1
        future: Future[None] = Future()

        def send() -> None:
            self.started.set()
            try:
                if self.gate is not None:
                    assert self.gate.wait(120)
                if self.down:
                    raise ConnectionError("Connection refused")
                self.real.log_batch(run_id, metrics=metrics, tags=tags, synchronous=True)
                future.set_result(None)
            except BaseException as exc:
                future.set_exception(exc)

        threading.Thread(target=send, daemon=True).start()
        return RunOperations([future])


@contextlib.contextmanager
def small_disk(folder: Path, size_kib: int) -> Iterator[Path]:
    """``folder`` as a tmpfs of ``size_kib`` KiB for the block: a real disk that fills up (ENOSPC). Skips the test
    where mounting is not allowed (it needs root, as CI has)."""
    folder.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_kib}k", "tmpfs", str(folder)], capture_output=True, text=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"needs permission to mount a small tmpfs as a full disk: {mounted.stderr.strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)


def fill(folder: Path, leave_kib: int) -> None:
    """Fill ``folder``'s disk with a file until ``leave_kib`` KiB or less are free."""
    free = shutil.disk_usage(folder).free
    (folder / "filler").write_bytes(bytes(max(0, free - leave_kib * 1024)))


def alive(pid: int) -> bool:
    """Whether process ``pid`` still runs; a zombie waiting for its parent counts as gone."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as fh:
        return fh.read().split(")")[-1].split()[0] != "Z"


def refusal(path: Path, table: str, body: str, **changes: Any) -> str:
    """The SpecError text of ``helpers.MINIMAL`` (with ``changes``) written to ``path`` with ``[table]`` and its
    ``body`` appended; fails when the spec loads."""
    import pytest

    from runner.errors import SpecError
    from runner.spec.loading import load_spec

    write_spec_file(path, **changes)
    path.write_text(path.read_text() + f"\n[{table}]\n{body}\n")
    with pytest.raises(SpecError) as caught:
        load_spec(path)
    return str(caught.value)

"""The team setup for real: a PostgreSQL on 127.0.0.1, an ``mlflow server`` on top, ``runner exec`` against it,
and two ``runner sweep`` workers sharing one study in the same PostgreSQL.

PostgreSQL and the server are started once per test session in temporary folders and stopped at
the end. The tests skip, saying why, only where PostgreSQL cannot start.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import optuna
import pytest
import requests
from mlflow.tracking import MlflowClient

from runner.errors import TrackingError
from runner.tracking.uri import check_reachable
from tests.helpers import assert_loopback_only, write_spec_file

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 120.0


def _team_spec(path: Path, uri: str) -> Path:
    """A one-epoch run of ``helpers.MINIMAL`` (default split and optimizer) in the experiment ``team`` at ``uri``."""
    return write_spec_file(
        path,
        name="team",
        model={"kwargs": {"hidden": [16]}},
        data={"val_fraction": None},
        optim={"name": None},
        train={"epochs": 1, "log_every_n_steps": None},
        tracking={"uri": uri, "experiment": "team"},
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait(ready, proc: subprocess.Popen, log: Path, what: str) -> None:
    """Poll ``ready()`` until it is true; fail with the log when ``proc`` dies or the time is up."""
    deadline, pause = time.monotonic() + START_TIMEOUT_S, 0.1
    while not ready():
        if proc.poll() is not None or time.monotonic() > deadline:
            why = f"exited with {proc.returncode}" if proc.poll() is not None else f"not ready in {START_TIMEOUT_S} s"
            raise RuntimeError(f"{what} {why}:\n{log.read_text(errors='replace')[-3000:]}")
        time.sleep(pause)
        pause = min(1.0, pause * 2)


def _stop(proc: subprocess.Popen, sig: int = signal.SIGTERM) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


def _postgres_bin() -> Path | None:
    """The folder of ``initdb`` and ``postgres``: Debian's newest ``/usr/lib/postgresql/N/bin``, else ``PATH``'s."""
    versions = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(Path(p).parts[-3]))
    if versions:
        return Path(versions[-1]).parent
    found = shutil.which("initdb")
    return Path(found).resolve().parent if found else None


@dataclass
class Postgres:
    """A running PostgreSQL: connect as ``postgres`` (trust) to 127.0.0.1:``port``."""

    port: int

    def url(self, database: str) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{database}"


@pytest.fixture(scope="session")
def postgres() -> Iterator[Postgres]:
    """PostgreSQL from Debian's packages in a temporary folder, with databases ``mlflow`` and ``optuna``."""
    bin_dir = _postgres_bin()
    if bin_dir is None:
        pytest.skip("PostgreSQL is not installed (no initdb): apt-get install postgresql")
    as_user = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []  # initdb refuses to run as root
    folder = Path(tempfile.mkdtemp(prefix="runner-pg-"))
    if as_user:
        shutil.chown(folder, "postgres")
    port = _free_port()
    log = folder / "postgres.log"
    init = subprocess.run(
        [*as_user, str(bin_dir / "initdb"), "-D", str(folder / "data"), "-A", "trust", "-U", "postgres", "--no-sync"],
        capture_output=True,
        text=True,
        check=False,
    )
    if init.returncode != 0:
        shutil.rmtree(folder, ignore_errors=True)
        pytest.skip(f"PostgreSQL cannot start: initdb failed: {init.stderr.strip()[-500:]}")
    server = [str(bin_dir / "postgres"), "-D", str(folder / "data"), "-h", "127.0.0.1", "-p", str(port)]
    server += ["-k", str(folder), "-c", "fsync=off"]
    with open(log, "wb") as out:
        proc = subprocess.Popen([*as_user, *server], stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    isready = [str(bin_dir / "pg_isready"), "-q", "-h", "127.0.0.1", "-p", str(port)]

    def ready() -> bool:
        return subprocess.run(isready, check=False).returncode == 0

    try:
        try:
            _wait(ready, proc, log, "postgres")
        except RuntimeError as exc:
            pytest.skip(f"PostgreSQL cannot start: {exc}")
        assert_loopback_only(proc.pid, "the test PostgreSQL")
        for database in ("mlflow", "optuna"):
            created = [str(bin_dir / "createdb"), "-h", "127.0.0.1", "-p", str(port), "-U", "postgres", database]
            subprocess.run(created, check=True, capture_output=True)
        yield Postgres(port)
    finally:
        _stop(proc, signal.SIGINT)  # PostgreSQL's fast shutdown: do not wait for idle client connections
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="session")
def team_server(postgres: Postgres, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``mlflow server`` on 127.0.0.1 with its runs in PostgreSQL and its artifacts in a folder; yields its URL."""
    folder = tmp_path_factory.mktemp("team-server")
    port = _free_port()
    cmd = [
        sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
        "--backend-store-uri", postgres.url("mlflow"), "--artifacts-destination", str(folder / "artifacts"),
    ]  # fmt: skip
    log = folder / "server.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    env["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] = "false"  # no background job runner: runs and artifacts only
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=folder, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        try:
            check_reachable(url, timeout_s=1.0)
            return True
        except TrackingError:
            return False

    try:
        _wait(ready, proc, log, "mlflow server")
        assert_loopback_only(proc.pid, "the team's mlflow server")
        yield url
    finally:
        _stop(proc)


def _runner(*args: str, cwd: Path) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "SLURM_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return subprocess.Popen(
        [sys.executable, "-m", "runner", *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_runner_exec_records_its_run_in_the_team_server(team_server: str, tmp_path: Path) -> None:
    spec = _team_spec(tmp_path / "team.toml", team_server)
    proc = _runner("exec", str(spec), cwd=tmp_path)
    out, err = proc.communicate(timeout=200)
    assert proc.returncode == 0, out + err
    run_id = next(line.split()[2] for line in out.splitlines() if line.startswith("run id: "))
    resp = requests.get(f"{team_server}/api/2.0/mlflow/runs/get", params={"run_id": run_id}, timeout=10)
    resp.raise_for_status()
    run = resp.json()["run"]
    assert run["info"]["status"] == "FINISHED"
    assert {p["key"]: p["value"] for p in run["data"]["params"]}["optim.lr"] == "0.1"
    client = MlflowClient(team_server)
    assert {a.path for a in client.list_artifacts(run_id, "spec")} >= {"spec/team.toml", "spec/resolved.toml"}
    assert len(client.get_metric_history(run_id, "val/accuracy")) == 1


def test_two_sweep_workers_share_one_study_in_postgres(team_server: str, postgres: Postgres, tmp_path: Path) -> None:
    spec = _team_spec(tmp_path / "team.toml", team_server)
    storage = postgres.url("optuna")
    args = ("sweep", str(spec), "--grid", "optim.lr=0.3,0.1", "--grid", "seed=0,1", "--storage", storage, "--json")
    workers = [_runner(*args, cwd=tmp_path) for _ in range(2)]
    outputs = [w.communicate(timeout=250) for w in workers]
    assert [w.returncode for w in workers] == [0, 0], outputs
    reports = [json.loads(out) for out, _ in outputs]
    assert reports[0]["parent_run_id"] == reports[1]["parent_run_id"]
    assert reports[0]["storage"] == storage  # no password to hide here
    ran = [line for _, err in outputs for line in err.splitlines() if line.startswith("[sweep ")]
    assert sorted(int(line.split("] trial ")[1].split()[0]) for line in ran) == list(range(4)), ran
    study = optuna.load_study(study_name=reports[0]["study"], storage=storage)
    assert [t.state.name for t in study.trials] == ["COMPLETE"] * 4
    client = MlflowClient(team_server)
    parent = client.get_run(reports[0]["parent_run_id"])
    children = client.search_runs(
        [parent.info.experiment_id], filter_string=f"tags.mlflow.parentRunId = '{parent.info.run_id}'"
    )
    assert sorted(int(c.data.tags["runner.sweep.trial"]) for c in children) == list(range(4))
    assert all(c.info.status == "FINISHED" for c in children) and parent.info.status == "FINISHED"
    assert parent.data.tags["runner.sweep.storage"] == storage

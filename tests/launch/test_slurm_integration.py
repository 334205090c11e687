"""Slurm end to end: both layouts with srun's variables simulated, a requeued job, and a real single-node Slurm.

The real cluster is Debian's ``slurm-wlm``: one slurmctld and one slurmd on 127.0.0.1 (auth/none,
no munge), started once per test session in a temporary folder and stopped at the end. Its tests
skip, saying why, only where the daemons cannot start.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
from mlflow.tracking import MlflowClient

from runner.cli import main
from tests.helpers import assert_loopback_only

pytestmark = [pytest.mark.integration, pytest.mark.created_store, pytest.mark.timeout(240)]

ROOT = Path(__file__).resolve().parents[2]
DDP = ["--set", 'parallel.mode="ddp"', "--set", "parallel.timeout_s=60", "--set", "train.epochs=1"]
DAEMON_START_S = 60.0


def _runs(store: str) -> tuple[MlflowClient, list]:
    client = MlflowClient(store)
    exp = client.get_experiment_by_name("tests")
    return client, [] if exp is None else client.search_runs([exp.experiment_id])


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env.update(extra)
    return env


def _job_id_with_a_free_port() -> str:
    """A job id whose derived port (15000 + its last four digits) is free on 127.0.0.1 now."""
    for _ in range(200):
        job = random.randint(1000, 9999)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", 15000 + job))
            except OSError:
                continue
        return str(job)
    raise RuntimeError("no free port in 16000-24999")


def _tasks(spec: Path, cwd: Path, envs: list[dict[str, str]], *args: str) -> list[str]:
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "runner", "exec", str(spec), *args],
            env=_env(**env),
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for env in envs
    ]
    outputs = [p.communicate(timeout=200)[0] for p in procs]
    assert [p.returncode for p in procs] == [0] * len(procs), outputs
    return outputs


def _one_finished_run(store: str, world_size: str, job_id: str) -> None:
    client, runs = _runs(store)
    assert len(runs) == 1, [r.info.run_name for r in runs]
    run = runs[0]
    assert run.info.status == "FINISHED"
    assert run.data.tags["runner.world_size"] == world_size and run.data.tags["runner.slurm.job_id"] == job_id
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")]
    assert steps == sorted(set(steps)) and steps, "a step was logged twice: more than one rank logs"


def test_one_task_per_device_gives_one_run(write_spec, store: str, tmp_path: Path) -> None:
    job = _job_id_with_a_free_port()
    step = {"SLURM_JOB_ID": job, "SLURM_STEP_ID": "0", "SLURM_NTASKS": "2", "SLURM_NNODES": "1"}
    step |= {"SLURM_JOB_NODELIST": "localhost", "SLURM_STEP_TASKS_PER_NODE": "2", "SLURM_NODEID": "0"}
    envs = [{**step, "SLURM_PROCID": str(r), "SLURM_LOCALID": str(r)} for r in (0, 1)]
    outputs = _tasks(write_spec(), tmp_path, envs, *DDP, "--set", "parallel.nproc_per_node=2")
    _one_finished_run(store, "2", job)
    assert "status: FINISHED" in outputs[0] and "status:" not in outputs[1]  # rank 0 reports


def test_one_task_per_node_gives_one_run(write_spec, store: str, tmp_path: Path) -> None:
    job = _job_id_with_a_free_port()
    step = {"SLURM_JOB_ID": job, "SLURM_STEP_ID": "0", "SLURM_NTASKS": "2", "SLURM_NNODES": "2"}
    step |= {"SLURM_JOB_NODELIST": "localhost,localhost", "SLURM_STEP_TASKS_PER_NODE": "1(x2)", "SLURM_LOCALID": "0"}
    envs = [{**step, "SLURM_PROCID": str(n), "SLURM_NODEID": str(n)} for n in (0, 1)]
    sets = ["--set", "parallel.nnodes=2", "--set", "parallel.nproc_per_node=1"]
    _tasks(write_spec(), tmp_path, envs, *DDP, *sets)
    _one_finished_run(store, "2", job)


FLAKY = """
import os
import torch


class FailsOnce(torch.nn.Module):
    # Raises at the 7th training step while the file named by RUNNER_TEST_FAIL exists (epoch 2 of 5 steps).
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 3)
        self.steps = 0

    def forward(self, x):
        if self.training:
            self.steps += 1
            if self.steps == 7 and os.path.exists(os.environ.get("RUNNER_TEST_FAIL", "")):
                raise RuntimeError("node lost on purpose")
        return self.lin(x)


def build():
    return FailsOnce()
"""


def test_a_requeued_job_resumes_its_run_from_the_checkpoint(write_spec, store: str, tmp_path: Path, monkeypatch):
    (tmp_path / "flaky_model.py").write_text(FLAKY, encoding="utf-8")
    marker = tmp_path / "fail"
    marker.write_text("", encoding="utf-8")
    spec = write_spec()
    spec.write_text(spec.read_text().replace('name = "mlp"\nkwargs = { hidden = [32] }', 'name = "flaky_model:build"'))
    step = {"SLURM_JOB_ID": "818", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "1", "SLURM_NNODES": "1"}
    step |= {"SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_JOB_NODELIST": "localhost"}
    for key, value in {**step, "RUNNER_TEST_FAIL": str(marker)}.items():
        monkeypatch.setenv(key, value)
    assert main(["exec", str(spec)]) == 1
    client, (first,) = _runs(store)
    assert first.info.status == "FAILED" and first.data.tags["runner.slurm.job_id"] == "818"

    marker.unlink()
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")  # what Slurm sets in a requeued job
    assert main(["exec", str(spec)]) == 0
    client, runs = _runs(store)
    assert [r.info.run_id for r in runs] == [first.info.run_id]  # the same run, not a second one
    run = runs[0]
    assert run.info.status == "FINISHED" and run.data.tags["runner.resume.count"] == "1"
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")]
    assert steps == list(range(1, 11))  # 2 epochs of 5 steps, each step once
    epochs = [m.step for m in client.get_metric_history(run.info.run_id, "epoch")]
    assert epochs == [5, 10]


# --------------------------------------------------------------------------- a real single-node Slurm


@dataclass
class Slurm:
    """A running single-node Slurm: its config file and the environment that reaches it."""

    conf: Path
    env: dict[str, str]
    ports: tuple[int, int]  # slurmctld's, slurmd's
    pids: tuple[int, ...]  # the daemons'

    def srun(self, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["srun", *args], cwd=cwd, env=self.env, capture_output=True, text=True, timeout=200, check=False
        )


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _slurm_conf(folder: Path, ctld: int, node: int) -> str:
    """Root daemons with auth/none: they must listen on loopback only (CommunicationParameters)."""
    host = socket.gethostname().split(".")[0]
    return textwrap.dedent(
        f"""\
        ClusterName=runnertest
        SlurmctldHost={host}(127.0.0.1)
        AuthType=auth/none
        CredType=cred/none
        CommunicationParameters=NoInAddrAny,NoCtldInAddrAny
        SlurmUser=root
        SlurmdUser=root
        SlurmctldPort={ctld}
        SlurmdPort={node}
        StateSaveLocation={folder}/state
        SlurmdSpoolDir={folder}/spool
        SlurmctldPidFile={folder}/slurmctld.pid
        SlurmdPidFile={folder}/slurmd.pid
        SlurmctldLogFile={folder}/slurmctld.log
        SlurmdLogFile={folder}/slurmd.log
        ProctrackType=proctrack/linuxproc
        TaskPlugin=task/none
        SelectType=select/cons_tres
        SelectTypeParameters=CR_Core
        ReturnToService=2
        MpiDefault=none
        SchedulerType=sched/builtin
        JobAcctGatherType=jobacct_gather/none
        AccountingStorageType=accounting_storage/none
        NodeName={host} NodeAddr=127.0.0.1 CPUs={os.cpu_count() or 1} RealMemory=2000 State=UNKNOWN
        PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
        """
    )


def _stop(procs: list[subprocess.Popen]) -> None:
    for proc in reversed(procs):
        if proc.poll() is None:
            proc.terminate()
    for proc in reversed(procs):
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)


@pytest.fixture(scope="session")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Slurm]:
    """slurmctld and slurmd on 127.0.0.1 in a temporary folder, until the test session ends."""
    missing = [tool for tool in ("slurmctld", "slurmd", "srun", "sinfo") if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"Slurm is not installed ({', '.join(missing)} not on PATH): apt-get install slurm-wlm")
    if os.geteuid() != 0:
        pytest.skip("the test cluster runs its daemons as root (SlurmUser=root, auth/none); run the tests as root")
    folder = tmp_path_factory.mktemp("slurm")
    for sub in ("state", "spool"):
        (folder / sub).mkdir()
    conf = folder / "slurm.conf"
    ctld, node = _free_ports(2)
    conf.write_text(_slurm_conf(folder, ctld, node), encoding="utf-8")
    env = _env(SLURM_CONF=str(conf))
    procs: list[subprocess.Popen] = []
    try:
        for cmd in (["slurmctld", "-D", "-c"], ["slurmd", "-D"]):
            with open(folder / f"{cmd[0]}.out", "wb") as out:
                procs.append(subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT))
        _wait_until_idle(env, procs, folder)
        yield Slurm(conf, env, (ctld, node), tuple(p.pid for p in procs))
    finally:
        _stop(procs)


def _wait_until_idle(env: dict[str, str], procs: list[subprocess.Popen], folder: Path) -> None:
    deadline, pause = time.monotonic() + DAEMON_START_S, 0.1
    while True:
        state = subprocess.run(["sinfo", "-h", "-o", "%T"], env=env, capture_output=True, text=True, check=False)
        if state.stdout.strip() == "idle":
            return
        dead = [p.args[0] for p in procs if p.poll() is not None]
        if dead or time.monotonic() > deadline:
            logs = "\n".join(p.read_text(errors="replace")[-1500:] for p in sorted(folder.glob("*.log")))
            _stop(procs)
            why = f"{', '.join(dead)} exited" if dead else f"the node is not idle after {DAEMON_START_S:.0f} s"
            pytest.skip(f"the test Slurm cannot start ({why}): {state.stderr.strip()}\n{logs}")
        time.sleep(pause)
        pause = min(1.0, pause * 2)


def test_the_slurm_daemons_listen_on_loopback_only(slurm: Slurm, tmp_path: Path) -> None:
    """Root daemons with auth/none on every interface would run any host's jobs as root."""
    for pid in slurm.pids:  # every socket they listen on, their configured ports among them
        assert_loopback_only(pid, "a test Slurm daemon")
    assert set(slurm.ports) <= {c.laddr.port for pid in slurm.pids for c in psutil.Process(pid).net_connections("inet")}
    done = slurm.srun("-n", "1", "true", cwd=tmp_path)
    assert done.returncode == 0, done.stderr  # and jobs still run


@pytest.mark.parametrize(("tasks", "layout"), [("2", "per-device"), ("1", "per-node")], ids=["per-device", "per-node"])
def test_srun_on_a_real_slurm_gives_one_run(slurm: Slurm, write_spec, store: str, tmp_path: Path, tasks, layout):
    spec = write_spec()
    done = slurm.srun(
        "-N1", f"-n{tasks}", sys.executable, "-m", "runner", "exec", str(spec), *DDP,
        "--set", "parallel.nproc_per_node=2", cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    client, runs = _runs(store)
    assert len(runs) == 1 and runs[0].info.status == "FINISHED", done.stdout + done.stderr
    run = runs[0]
    assert run.data.tags["runner.world_size"] == "2"
    job = run.data.tags["runner.slurm.job_id"]
    assert job.isdigit() and done.stdout.count("status: FINISHED") == 1
    plan = json.loads(Path(client.download_artifacts(run.info.run_id, "spec/plan.json", str(tmp_path))).read_text())
    assert plan["slurm"]["layout"] == layout and plan["slurm"]["job_id"] == job

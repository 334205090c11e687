"""Slurm without Slurm: reading a job step's variables, node lists, the layout of its tasks, and the plan it gives."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from runner.cli import main
from runner.devices.environment import (
    LauncherEnvironment,
    SlurmJob,
    parse_tasks_per_node,
)
from runner.devices.inventory import Inventory
from runner.errors import SpecError, UsageError
from runner.launch.session import apply_plan_env
from runner.plan import make_plan
from runner.spec.loading import load_spec
from tests.helpers import SMALL, spec_text

NO_GPU = Inventory([], False, "nvidia-smi not found", [])


def step(ntasks: int = 2, nnodes: int = 1, procid: int = 0, nodeid: int = 0, **extra: str) -> dict[str, str]:
    """The variables ``srun`` sets for one task of a job step (job 4321 on hosts ``n[07-08]``)."""
    env = {
        "SLURM_JOB_ID": "4321",
        "SLURM_STEP_ID": "0",
        "SLURM_NTASKS": str(ntasks),
        "SLURM_NNODES": str(nnodes),
        "SLURM_PROCID": str(procid),
        "SLURM_LOCALID": str(procid % max(1, ntasks // nnodes)),
        "SLURM_NODEID": str(nodeid),
        "SLURM_JOB_NODELIST": "n[07-08]" if nnodes > 1 else "n07",
        "SLURM_STEP_TASKS_PER_NODE": f"{ntasks // nnodes}(x{nnodes})",
    }
    env.update(extra)
    return env


def load(tmp_path: Path, mode: str = "ddp", parallel: dict | None = None):
    """``helpers.SMALL`` on CPU without tracking, compact (``[parallel]`` opens at line 9); ddp's keys from ``parallel``."""
    ddp = {"nproc_per_node": 2} if parallel is None else parallel
    table = {"mode": mode, **(ddp if mode == "ddp" else {})}
    text = spec_text(SMALL, compact=True, devices={"accelerator": "cpu"}, parallel=table, tracking={"enabled": False})
    path = tmp_path / "spec.toml"
    path.write_text(text, encoding="utf-8")
    return load_spec(path)


# --------------------------------------------------------------------------- node lists


@pytest.mark.parametrize(
    ("text", "host"),
    [
        ("n07", "n07"),
        ("n[07-09]", "n07"),
        ("gpu[009-011,3],login1", "gpu009"),
        ("rack[1-2]-node[01-02]", "rack1-node01"),
        ("a[1],b", "a1"),
        ("host0 host1", "host0"),
    ],
)
def test_the_first_host_is_the_one_scontrol_lists_first(text: str, host: str) -> None:
    assert SlurmJob(job_id="1", nodelist=text).first_host == host


@pytest.mark.parametrize("text", ["n[07-", "n[1-2]]", "n[a-b]", "n[[1]]", ""])
def test_a_malformed_nodelist_is_an_error_naming_it(text: str) -> None:
    with pytest.raises(ValueError, match="SLURM_JOB_NODELIST"):
        _ = SlurmJob(job_id="1", nodelist=text).first_host


def test_tasks_per_node_lists_expand() -> None:
    assert parse_tasks_per_node("2(x3),1") == (2, 2, 2, 1)
    assert parse_tasks_per_node("4") == (4,) and parse_tasks_per_node("") == ()
    with pytest.raises(ValueError, match="tasks-per-node"):
        parse_tasks_per_node("2x3")


# --------------------------------------------------------------------------- the job and its layout


def test_detect_reads_the_step_and_the_port_comes_from_the_job_id() -> None:
    job = SlurmJob.detect(step(ntasks=4, nnodes=2, procid=3, nodeid=1, SLURM_RESTART_COUNT="2"))
    assert job is not None
    assert (job.job_id, job.ntasks, job.nnodes, job.procid, job.localid, job.nodeid) == ("4321", 4, 2, 3, 1, 1)
    assert job.tasks_per_node == (2, 2) and job.local_tasks == 2 and job.restart_count == 2 and job.in_step
    assert job.port == 15000 + 4321
    assert SlurmJob(job_id="1234567").port == 15000 + 4567
    assert job.first_host == "n07"
    assert SlurmJob.detect({}) is None
    assert not SlurmJob.detect({"SLURM_JOB_ID": "9", "SLURM_NTASKS": "2"}).in_step  # the batch script itself


@pytest.mark.parametrize(
    ("ntasks", "nnodes", "spec_nnodes", "world", "kind"),
    [
        (1, 1, 1, 1, "per-node"),  # one task, mode none: a plain run
        (1, 1, 1, 2, "per-node"),  # srun -n1 of a 2-process ddp spec: the elastic launcher starts both
        (2, 1, 1, 2, "per-device"),  # srun -n2: each task is a worker
        (2, 2, 1, 2, "per-device"),  # one task on each of 2 nodes, a spec for 2 processes on 1 node
        (2, 2, 2, 2, "per-node"),  # nnodes = 2 x 1 process: each node's task launches its worker
        (2, 2, 2, 4, "per-node"),
        (4, 2, 2, 4, "per-device"),
    ],
)
def test_the_layout_follows_the_spec_world_size(ntasks, nnodes, spec_nnodes, world, kind) -> None:
    job = SlurmJob.detect(step(ntasks=ntasks, nnodes=nnodes))
    layout = job.layout(world_size=world, nproc_per_node=world // spec_nnodes, nnodes=spec_nnodes)
    assert layout.kind == kind
    assert layout.world_size == (ntasks if kind == "per-device" else world)


def test_a_contradiction_names_both_numbers() -> None:
    job = SlurmJob.detect(step(ntasks=3, nnodes=1))
    with pytest.raises(ValueError) as info:
        job.layout(world_size=2, nproc_per_node=2, nnodes=1)
    text = str(info.value)
    assert "SLURM_NTASKS=3" in text and "world size is 2" in text and "SLURM_NNODES=1" in text


def test_a_per_device_task_becomes_the_worker_torchrun_would_start(tmp_path: Path, monkeypatch) -> None:
    env = step(ntasks=2, procid=1)
    launcher = LauncherEnvironment.detect(env)
    assert not launcher.external and launcher.slurm is not None
    layout = launcher.slurm.layout(world_size=2, nproc_per_node=2, nnodes=1)
    worker = launcher.as_slurm_worker(layout)
    assert worker.external and (worker.rank, worker.local_rank, worker.world_size) == (1, 1, 2)
    assert not worker.missing
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    apply_plan_env(make_plan(load(tmp_path), env=env, inventory=NO_GPU))  # what the task itself does before it trains
    made = LauncherEnvironment.detect()
    assert made == worker and not made.missing
    assert (os.environ["LOCAL_WORLD_SIZE"], os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]) == (
        "2",
        "n07",
        str(15000 + 4321),
    )
    monkeypatch.setenv("MASTER_ADDR", "10.1.1.1")
    monkeypatch.setenv("MASTER_PORT", "29400")
    apply_plan_env(make_plan(load(tmp_path), env=env, inventory=NO_GPU))
    assert (os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]) == ("10.1.1.1", "29400")  # the user's choice wins


def test_torchruns_variables_come_before_slurms() -> None:
    launcher = LauncherEnvironment.detect({**step(), "RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2"})
    assert launcher.external and launcher.rank == 1 and launcher.slurm is not None


# --------------------------------------------------------------------------- the plan


def test_plan_of_a_per_device_task(tmp_path: Path) -> None:
    plan = make_plan(load(tmp_path), env=step(ntasks=2, procid=1), inventory=NO_GPU)
    assert plan.launch == "external" and plan.slurm is not None and plan.slurm.kind == "per-device"
    assert plan.launcher.rank == 1 and not plan.owns_run
    assert make_plan(load(tmp_path), env=step(ntasks=2, procid=0), inventory=NO_GPU).owns_run
    assert plan.describe()["slurm"]["layout"] == "per-device"


def test_plan_of_a_per_node_task_meets_on_the_first_host(tmp_path: Path) -> None:
    loaded = load(tmp_path, parallel={"nnodes": 2, "nproc_per_node": 2})  # no rdzv_endpoint: Slurm gives it
    plan = make_plan(loaded, env=step(ntasks=2, nnodes=2, procid=1, nodeid=1), inventory=NO_GPU)
    assert plan.launch == "elastic" and plan.slurm.kind == "per-node" and not plan.owns_run
    assert plan.rendezvous is not None
    assert (plan.rendezvous.nnodes, plan.rendezvous.node_rank) == (2, 1)
    assert plan.rendezvous.endpoint == f"n07:{15000 + 4321}"
    assert plan.rendezvous.run_id == "slurm-4321"
    one = make_plan(load(tmp_path), env=step(ntasks=1), inventory=NO_GPU)
    assert one.launch == "elastic" and one.owns_run and one.rendezvous.endpoint is None  # a free local port


def test_several_nodes_without_slurm_need_an_endpoint_at_the_nnodes_line(tmp_path: Path, capsys) -> None:
    loaded = load(tmp_path, parallel={"nnodes": 2, "nproc_per_node": 1})
    with pytest.raises(SpecError) as info:
        make_plan(loaded, env={}, inventory=NO_GPU)
    (issue,) = info.value.issues
    assert issue.key == "parallel.nnodes" and issue.line is None and "rdzv_endpoint" in issue.message  # not placed yet
    assert main(["plan", str(loaded.path)]) == 2  # the command places it in the file, once
    assert f"{loaded.path}:11: parallel.nnodes: nnodes = 2 needs rdzv_endpoint" in capsys.readouterr().err


def test_a_step_that_fits_no_layout_is_a_usage_error(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match=r"SLURM_NTASKS=2 .*world size is 1"):
        make_plan(load(tmp_path, mode="none"), env=step(ntasks=2), inventory=NO_GPU)
    with pytest.raises(UsageError, match=r"SLURM_NTASKS=3"):
        make_plan(load(tmp_path), env=step(ntasks=3), inventory=NO_GPU)


def test_runner_plan_shows_the_layout_and_a_contradiction_exits_2(tmp_path: Path, monkeypatch, capsys) -> None:
    path = load(tmp_path).path
    for key, value in step(ntasks=2, procid=0).items():
        monkeypatch.setenv(key, value)
    assert main(["plan", str(path)]) == 0
    out = capsys.readouterr().out
    assert "slurm          job 4321, one task per device: this task is rank 0 of 2" in out
    monkeypatch.setenv("SLURM_NTASKS", "5")
    assert main(["plan", str(path)]) == 2
    err = capsys.readouterr().err
    assert "SLURM_NTASKS=5" in err and "world size is 2" in err


def test_the_batch_script_itself_runs_the_spec_as_outside_slurm(tmp_path: Path) -> None:
    env = {"SLURM_JOB_ID": "77", "SLURM_NTASKS": "2", "SLURM_PROCID": "0", "SLURM_JOB_NODELIST": "n07"}
    plan = make_plan(load(tmp_path), env=env, inventory=NO_GPU)
    assert plan.slurm.kind == "batch" and plan.launch == "elastic" and plan.owns_run

"""Fault injection through the command line: nothing lost, nothing left running (docs/design.md §12).

Each test starts real processes: several first runs on one new store, DDP workers killed hard, a
driver killed hard, a rank that hangs, a tracking server that goes away in the middle of a run and
comes back, a loss that turns non-finite.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient

from runner.spec.schema_loop import TrainSpec
from runner.tracking.uri import refuse_half_migrated
from runner.training.checkpoint import list_checkpoints
from runner.training.shards import whole_model
from tests.helpers import MlflowServer, alive, wait_for, write_spec_file

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

REPO = Path(__file__).parents[2]

FACTORY = '''
import os
import signal
import time
from pathlib import Path

import torch

if os.environ.get("FAULT_BARRIER"):  # every process waits here until all have come, then they go on at once
    folder = Path(os.environ["FAULT_BARRIER"])
    (folder / str(os.getpid())).touch()
    deadline = time.monotonic() + 120
    while len(list(folder.iterdir())) < int(os.environ["FAULT_BARRIER_N"]) and time.monotonic() < deadline:
        time.sleep(0.005)


class Faulty(torch.nn.Module):
    """A small MLP whose forward can record its pid, sleep, hang or kill its process at a given call."""

    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
        self.calls = 0

    def forward(self, x):
        if self.training:
            self.calls += 1
            rank = os.environ.get("RANK", "0")
            if self.calls == 1 and os.environ.get("FAULT_PIDS"):  # once, by rename: a reader never sees it half written
                staged = Path(os.environ["FAULT_PIDS"], f".rank{rank}")
                staged.write_text(str(os.getpid()))
                staged.rename(staged.with_name(f"rank{rank}"))
            time.sleep(float(os.environ.get("FAULT_STEP_S", "0")))
            if self.calls == int(os.environ.get("FAULT_AT", "-1")) and rank == os.environ.get("FAULT_RANK", "1"):
                if os.environ.get("FAULT") == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                if os.environ.get("FAULT") == "hang":
                    Path(os.environ["FAULT_MARKER"]).touch()
                    time.sleep(3600)
        return self.net(x)


def build():
    return Faulty()
'''

DDP = {"mode": "ddp", "nproc_per_node": 2, "timeout_s": 30}
STEPS_PER_EPOCH = 5  # 72 training samples, global batch 16


def _spec(
    tmp_path: Path, uri: str, parallel: dict | None = None, epochs: int = 1, checkpoint: dict | None = None
) -> Path:
    """``helpers.MINIMAL`` with the faulty model, flushing every 0.5 s, in the experiment ``faults``."""
    (tmp_path / "faulty.py").write_text(FACTORY)
    return write_spec_file(
        tmp_path / "spec.toml",
        name="faults",
        seed=1,
        model={"name": "faulty:build", "kwargs": None},
        parallel=parallel or {"mode": "none"},
        optim={"name": None},
        train={"epochs": epochs},
        checkpoint=checkpoint or {},
        tracking={"uri": uri, "experiment": "faults", "flush_every_s": 0.5},
    )


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FAULT")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    env.update(extra)
    return env


def _runner(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "runner", *args],
        cwd=tmp_path,
        env=env or _env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _finish(proc: subprocess.Popen, timeout_s: float = 240) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=timeout_s)
    return proc.returncode, out, err


def _runs(uri: str) -> list:
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("faults")
    return [] if exp is None else client.search_runs([exp.experiment_id], order_by=["attributes.start_time ASC"])


# ----------------------------------------------------------------------------- item: a new store, used at once


def test_simultaneous_first_runs_on_a_new_store_all_succeed(tmp_path: Path) -> None:
    """Four `runner exec` and two plain MLflow clients (as `mlflow ui` or a notebook) open a new sqlite file at once:
    two alembic migrations of one new file can break it. The clients starting once runner has begun to create the
    store: tests/tracking/test_store.py."""
    uri = f"sqlite:///{tmp_path}/new.db"
    spec = _spec(tmp_path, uri)
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    env = _env(FAULT_BARRIER=str(barrier), FAULT_BARRIER_N="4")  # the model factory's import is the start line
    procs = [_runner(tmp_path, "exec", str(spec), "--run-name", f"r{i}", env=env) for i in range(4)]
    opener = f"from mlflow.tracking import MlflowClient; MlflowClient({uri!r}).search_experiments()"
    others = [subprocess.Popen([sys.executable, "-c", opener], env=_env()) for _ in range(2)]
    results = [_finish(p) for p in procs]
    for other in others:  # one may fail: MLflow's clients racing each other are not runner's to order
        other.wait(timeout=300)
    for code, _, err in results:
        assert code == 0, err
        assert "alembic" not in err and "Traceback" not in err
    runs = _runs(uri)
    assert sorted(r.info.run_name for r in runs) == ["r0", "r1", "r2", "r3"]
    assert {r.info.status for r in runs} == {"FINISHED"}
    refuse_half_migrated(tmp_path / "new.db")  # raises on a store left between two schema versions


# ----------------------------------------------------------------------------- item: a worker killed hard


def test_a_worker_killed_hard_is_reported_with_its_signal(tmp_path: Path, ready_store: str) -> None:
    uri = ready_store
    spec = _spec(tmp_path, uri, DDP, epochs=2)
    code, _, err = _finish(_runner(tmp_path, "exec", str(spec), env=_env(FAULT="kill", FAULT_AT="3")))
    assert code == 1
    assert "rank 1 was killed by signal 9 (SIGKILL, exit code -9)" in err and "<NONE>" not in err
    (run,) = _runs(uri)
    assert run.info.status == "FAILED" and "signal 9 (SIGKILL" in run.data.tags["runner.error"]


def _training(tmp_path: Path, uri: str, parallel: dict, step_s: str) -> tuple[str, subprocess.Popen, Path]:
    """A 100-epoch run whose training processes write their pids to ``pids/rank<N>``, once every one trains."""
    spec = _spec(tmp_path, uri, parallel, epochs=100)
    pids = tmp_path / "pids"
    pids.mkdir()
    driver = _runner(tmp_path, "exec", str(spec), env=_env(FAULT_PIDS=str(pids), FAULT_STEP_S=step_s))
    ranks = parallel.get("nproc_per_node", 1)
    wait_for(lambda: len(list(pids.glob("rank*"))) == ranks, "every training process to train", proc=driver)
    return uri, driver, pids


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as fh:
        return int(fh.read().split(")")[-1].split()[1])


def test_the_elastic_launcher_killed_hard_fails_the_run_naming_it_and_its_workers_stop(
    tmp_path: Path, ready_store: str
) -> None:
    uri, driver, pids = _training(tmp_path, ready_store, DDP, "0.1")
    workers = [int((pids / f"rank{r}").read_text()) for r in (0, 1)]
    agent = _parent(workers[0])  # a worker forks from the launcher
    assert "runner.launch.elastic" in Path(f"/proc/{agent}/cmdline").read_text() and _parent(agent) == driver.pid
    os.kill(agent, signal.SIGKILL)
    code, _, err = _finish(driver)
    assert code == 1, err
    assert "the elastic launcher was killed by signal 9 (SIGKILL" in err, err
    wait_for(lambda: not any(alive(p) for p in workers), "the workers to stop with their launcher", timeout_s=60)
    (run,) = _runs(uri)
    assert run.info.status == "FAILED" and "elastic launcher" in run.data.tags["runner.error"]


# ----------------------------------------------------------------------------- item: an abort after the work


def test_a_worker_aborting_at_exit_after_its_work_leaves_the_run_finished_and_noted(
    tmp_path: Path, ready_store: str
) -> None:
    uri = ready_store
    spec = _spec(tmp_path, uri, {**DDP, "timeout_s": 300})  # a busy machine must not make it a hang
    code, _, err = _finish(_runner(tmp_path, "exec", str(spec), env=_env(RUNNER_TEST_ABORT_AT_EXIT="1")), 600)
    assert code == 0, err
    assert "runner: note: rank 1 was killed by signal 6 (SIGABRT, exit code -6) after it finished its work" in err
    (run,) = _runs(uri)
    assert run.info.status == "FINISHED" and "runner.error" not in run.data.tags
    assert run.data.metrics["val/accuracy"] >= 0


# ----------------------------------------------------------------------------- item: the driver killed hard


@pytest.mark.parametrize("parallel", [DDP, {"mode": "none"}], ids=["ddp-2", "none"])
def test_workers_die_with_a_killed_driver_and_the_orphaned_run_ends_killed(
    tmp_path: Path, ready_store: str, parallel: dict
) -> None:
    uri, driver, pids = _training(tmp_path, ready_store, parallel, "0.1")
    spec, ranks = tmp_path / "spec.toml", range(parallel.get("nproc_per_node", 1))
    (run,) = _runs(uri)
    run_id = run.info.run_id
    code, _, err = _finish(_runner(tmp_path, "exec", str(spec), "--resume", run_id))
    assert code == 2 and f"the run is owned by pid {driver.pid} on host" in err  # a live owner keeps its run

    workers = [int((pids / f"rank{r}").read_text()) for r in ranks]
    assert driver.pid not in workers  # the driver trains nothing (docs/design.md §6)
    driver.send_signal(signal.SIGKILL)
    driver.communicate()
    # 30 s, well before a surviving worker would end its 100 epochs (no elapsed-time assert: a loaded machine)
    wait_for(lambda: not any(alive(p) for p in workers), "the workers to die with their driver", timeout_s=30)
    assert MlflowClient(uri).get_run(run_id).info.status == "RUNNING"  # nobody could end it

    code, out, err = _finish(_runner(tmp_path, "status", run_id, "--tracking-uri", uri))
    assert code == 0, err
    assert (
        f"{run_id}  KILLED   its owner (pid {driver.pid}" in out and f"continue it with: runner resume {run_id}" in out
    )
    assert MlflowClient(uri).get_run(run_id).info.status == "KILLED"


@pytest.mark.parametrize(("rank", "sig"), [(0, signal.SIGTERM), (1, signal.SIGINT)], ids=["term-rank0", "int-rank1"])
def test_a_stop_signal_to_one_rank_ends_the_run_killed_naming_the_signal_and_rank(
    tmp_path: Path, ready_store: str, rank: int, sig: signal.Signals
) -> None:
    """It ended FAILED with exit 1, named signal 2 for a SIGTERM, and blamed rank 1 when rank 0 got it."""
    uri, driver, pids = _training(tmp_path, ready_store, DDP, "0.05")
    os.kill(int((pids / f"rank{rank}").read_text()), sig)
    code, _, err = _finish(driver)
    (run,) = _runs(uri)
    assert code == 130, err
    assert f"is KILLED ({sig.name} at rank {rank}); a checkpoint was written at the stop" in err, err
    assert MlflowClient(uri).get_run(run.info.run_id).info.status == "KILLED"


# ----------------------------------------------------------------------------- item: a hung rank


def test_a_hung_rank_is_killed_after_a_short_grace_and_named(tmp_path: Path, ready_store: str) -> None:
    uri = ready_store
    # A timeout long enough that a loaded machine's slow start is not taken for the hang; no elapsed-time assert:
    # the grace's own message says that runner, not torch's 30 s wait after its SIGTERM, ended the rank.
    spec = _spec(tmp_path, uri, {**DDP, "timeout_s": 20, "hang_grace_s": 2}, epochs=2)
    marker = tmp_path / "hanging"
    proc = _runner(tmp_path, "exec", str(spec), env=_env(FAULT="hang", FAULT_AT="3", FAULT_MARKER=str(marker)))
    wait_for(marker.exists, "rank 1 to hang", proc=proc)
    code, _, err = _finish(proc)
    assert code == 1
    assert "rank 1 hung at faulty.py:" in err and "parallel.timeout_s = 20 s" in err
    assert "made no progress for 2 s after SIGTERM" in err
    assert "Traceback" not in err
    (run,) = _runs(uri)
    assert run.info.status == "FAILED" and "rank 1 hung" in run.data.tags["runner.error"]


# ----------------------------------------------------------------------------- item: a tracking outage


@pytest.fixture
def server(tmp_path: Path):
    """A server of this test's own: the outage test stops it and starts it again."""
    srv = MlflowServer(tmp_path)
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


def _steps(uri: str, run_id: str, key: str) -> list[int]:
    return sorted(m.step for m in MlflowClient(uri).get_metric_history(run_id, key))


def test_an_outage_neither_stalls_training_nor_loses_or_repeats_a_metric(tmp_path: Path, server: MlflowServer) -> None:
    epochs = 12
    spec = _spec(tmp_path, server.url, epochs=epochs, checkpoint={"every_n_steps": 2, "keep_last": 50, "dir": "ck"})
    env = _env(FAULT_STEP_S="0.15", MLFLOW_HTTP_REQUEST_MAX_RETRIES="0", MLFLOW_HTTP_REQUEST_TIMEOUT="5")
    proc = _runner(tmp_path, "exec", str(spec), env=env)
    wait_for(lambda: bool(_runs(server.url)), "the run", proc=proc)
    run_id = _runs(server.url)[0].info.run_id
    wait_for(lambda: len(_steps(server.url, run_id, "train/loss")) >= 6, "metrics in MLflow", proc=proc)
    folder = tmp_path / "ck" / run_id

    server.stop()
    before = len(list_checkpoints(folder))
    # training goes on: checkpoints keep coming while the server is away, and metrics wait in the spool
    wait_for(lambda: len(list_checkpoints(folder)) >= before + 3, "checkpoints during the outage", 60, proc)
    assert (folder / "metrics-spool.jsonl").is_file()
    proc.send_signal(signal.SIGKILL)  # and the run dies before the server is back
    proc.communicate()
    server.start()

    quick = _env(MLFLOW_HTTP_REQUEST_MAX_RETRIES="0", MLFLOW_HTTP_REQUEST_TIMEOUT="5")  # no slow steps: no outage now
    code, out, err = _finish(_runner(tmp_path, "exec", str(spec), "--resume", run_id, env=quick))
    assert code == 0, out + err
    assert "which is gone: marked KILLED" in err and "resuming from step-" in err  # notes go to stderr
    total = epochs * STEPS_PER_EPOCH
    assert _steps(server.url, run_id, "train/loss") == list(range(1, total + 1))
    assert _steps(server.url, run_id, "lr") == list(range(1, total + 1))
    assert _steps(server.url, run_id, "val/accuracy") == list(range(STEPS_PER_EPOCH, total + 1, STEPS_PER_EPOCH))
    assert MlflowClient(server.url).get_run(run_id).info.status == "FINISHED"
    assert not (folder / "metrics-spool.jsonl").exists()


def test_a_store_down_at_the_end_of_a_run_does_not_hold_the_command_in_retries(
    tmp_path: Path, server: MlflowServer
) -> None:
    # MLflow's own HTTP retries (the defaults: 7, backing off to 2 minutes) held `runner exec` for 4 minutes after
    # training ended, asking the stopped server for the run's end figures, though the spool held everything.
    spec = _spec(tmp_path, server.url, epochs=4, checkpoint={"dir": "ck"})
    proc = _runner(tmp_path, "exec", str(spec), env=_env(FAULT_STEP_S="0.2"))
    wait_for(lambda: bool(_runs(server.url)), "the run", proc=proc)
    run_id = _runs(server.url)[0].info.run_id
    wait_for(lambda: bool(_steps(server.url, run_id, "train/loss")), "metrics in MLflow", proc=proc)
    server.stop()
    code, out, err = _finish(proc, timeout_s=150)  # the retries alone took 240 s
    assert code == 0, out + err
    assert "status: FINISHED (the tracking store did not answer:" in out and f"runner status {run_id}" in out
    assert "Traceback" not in err
    server.start()
    sent = subprocess.run(
        [sys.executable, "-m", "runner", "status", run_id, "--tracking-uri", server.url],
        cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert sent.returncode == 0, sent.stdout + sent.stderr
    assert MlflowClient(server.url).get_run(run_id).info.status == "FINISHED"
    assert _steps(server.url, run_id, "train/loss") == list(range(1, 4 * STEPS_PER_EPOCH + 1))


# ----------------------------------------------------------------------------- item: a non-finite loss


@pytest.mark.skipif("on_nonfinite" not in TrainSpec.model_fields, reason="train.on_nonfinite is not on this branch")
def test_a_non_finite_loss_stops_the_run_failed_without_a_nan_checkpoint(tmp_path: Path, ready_store: str) -> None:
    uri = ready_store
    spec = _spec(tmp_path, uri, epochs=3, checkpoint={"every_n_steps": 1})
    spec.write_text(spec.read_text().replace("lr = 0.1", "lr = 1e30"))
    code, _, err = _finish(_runner(tmp_path, "exec", str(spec)))
    assert code == 1 and "step" in err and "Traceback" not in err
    (run,) = _runs(uri)
    assert run.info.status == "FAILED"
    for path in list_checkpoints(Path(tmp_path, "checkpoints", run.info.run_id)):
        for name, tensor in whole_model(path).items():
            assert torch.isfinite(tensor).all(), f"{path.name}: {name} holds non-finite values"


# ----------------------------------------------------------------------------- item: compile without a C++ compiler


def test_compile_without_a_cpp_compiler_names_torchs_error_not_a_silent_exit(tmp_path: Path, ready_store: str) -> None:
    # torch's InductorError did not unpickle in the driver (which imports no torch): the run failed as "exited with
    # code 1 without a Python error"
    spec = _spec(tmp_path, ready_store)
    env = _env(CXX=str(tmp_path / "no-such-compiler"))
    code, _, err = _finish(_runner(tmp_path, "exec", str(spec), "--set", "train.compile=true", env=env))
    assert code == 1, err
    assert "InductorError: InvalidCxxCompiler: No working C++ compiler found" in err, err
    assert "without a Python error" not in err and "Traceback" not in err
    (run,) = _runs(ready_store)
    assert run.info.status == "FAILED" and "InvalidCxxCompiler" in run.data.tags["runner.error"]

"""Interruption, checkpoints and resume: a stopped run continues into the same MLflow run and ends equal."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from mlflow.tracking import MlflowClient

from runner.cli import main
from runner.launch.worker import STOPPING
from runner.training.checkpoint import list_checkpoints, load_latest
from runner.training.shards import whole_model
from tests.helpers import ASSETS, wait_for, write_spec_file

pytestmark = [pytest.mark.integration, pytest.mark.created_store, pytest.mark.timeout(300)]

REPO = Path(__file__).parents[2]

DDP = {"mode": "ddp", "nproc_per_node": 2, "timeout_s": 60}
STEPS_PER_EPOCH = 5  # 72 training samples, global batch 16
KEYS = ("train/loss", "train/epoch_loss", "train/accuracy", "val/loss", "val/accuracy", "lr")


def _write(
    tmp_path: Path,
    store: str,
    parallel: dict | None = None,
    checkpoint: dict | None = None,
    name: str = "spec.toml",
    **changes: Any,
) -> Path:
    """Three epochs of ``helpers.MINIMAL`` with the probe model, momentum, a step schedule and 5 checkpoints kept;
    ``changes`` replace tables."""
    shutil.copyfile(ASSETS / "probe_factory.py", tmp_path / "probe_factory.py")
    tables = {
        "scheduler": {"name": "step", "kwargs": {"step_size": 1, "gamma": 0.5}},
        "train": {"epochs": 3, "log_every_n_steps": 2},
        **changes,
    }
    return write_spec_file(
        tmp_path / name,
        name="resume",
        seed=3,
        model={"name": "probe_factory:build", "kwargs": {"in_features": 8, "num_classes": 3}},
        parallel=parallel or {"mode": "none"},
        optim={"momentum": 0.9},
        checkpoint={"keep_last": 5, **(checkpoint or {})},
        tracking={"uri": store, "experiment": "resume"},
        **tables,
    )


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PROBE_")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    env.update(extra)
    return env


def _runner(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "runner", "exec", *args],
        cwd=tmp_path,
        env=_env(**env),
        capture_output=True,
        text=True,
        timeout=240,
    )


def _runs(store: str) -> list:
    client = MlflowClient(store)
    exp = client.get_experiment_by_name("resume")
    return client.search_runs([exp.experiment_id], order_by=["attributes.start_time ASC"])


def _histories(store: str, run_id: str) -> dict[str, list[tuple[int, float]]]:
    client = MlflowClient(store)
    return {k: [(m.step, m.value) for m in client.get_metric_history(run_id, k)] for k in KEYS}


def _final_model(store: str, run_id: str) -> dict[str, torch.Tensor]:
    found = load_latest(Path(store[len("sqlite:///") :]).parent / "checkpoints" / run_id)
    assert found is not None
    return whole_model(found.path)


def _start_until_marked(
    tmp_path: Path, spec: Path, at: int, what: str, timeout_s: float = 120, output: Any = subprocess.PIPE, **env: str
) -> subprocess.Popen:
    """Start ``runner exec spec`` and return once rank 0's probe has marked training call ``at`` (within ``timeout_s``).

    ``output`` takes stdout and stderr together (a pipe, or an open file a test can poll).
    """
    marker = tmp_path / "marker"
    proc = subprocess.Popen(
        [sys.executable, "-m", "runner", "exec", str(spec)],
        cwd=tmp_path,
        stdout=output,
        stderr=subprocess.STDOUT,
        text=True,
        env=_env(PROBE_MARKER=str(marker), PROBE_AT=str(at), **env),
    )
    wait_for(marker.exists, what, timeout_s=timeout_s, proc=proc)
    return proc


ELASTIC, EVERY_2 = {**DDP, "max_restarts": 1}, {"every_n_steps": 2}


def _finished_run(factory: pytest.TempPathFactory, created: Path, *spec: dict) -> Path:
    """A folder with one finished run of ``_write``'s spec, its store given by a relative URI, so that a copy of
    the folder is a store of its own: the tests that start from the same finished run share it."""
    folder = factory.mktemp("finished")
    shutil.copyfile(created, folder / "mlflow.db")
    done = _runner(folder, str(_write(folder, "sqlite:///mlflow.db", *spec)))
    assert done.returncode == 0, done.stderr
    return folder


@pytest.fixture(scope="module")
def _finished_none(tmp_path_factory: pytest.TempPathFactory, _created_store: Path) -> Path:
    return _finished_run(tmp_path_factory, _created_store)


@pytest.fixture(scope="module")
def _finished_ddp(tmp_path_factory: pytest.TempPathFactory, _created_store: Path) -> Path:
    return _finished_run(tmp_path_factory, _created_store, ELASTIC, EVERY_2)


# Watched: a plateau schedule and early stopping that never see an improvement after the first evaluation (the lr
# halves after each later epoch; training stops after epoch 4 of 6), the first epoch's checkpoint kept as the best,
# and validation on the weights' moving average. A resume that lost any of their records would log another lr or
# val/loss, stop elsewhere or keep other checkpoints.
WATCHED = {
    "scheduler": {
        "name": "ReduceLROnPlateau",
        "monitor": "val/loss",
        "kwargs": {"mode": "max", "patience": 0, "factor": 0.5, "threshold": 1e9, "threshold_mode": "abs"},
    },
    "early_stopping": {"metric": "val/loss", "patience": 3, "min_delta": 1e9},
    "train": {"epochs": 6, "log_every_n_steps": 2, "ema_decay": 0.9},
}
WATCHED_CHECKPOINT = {"monitor": "val/loss", "goal": "max", "keep_best": 1, "keep_last": 1}


@pytest.fixture(scope="module")
def _finished_watched(tmp_path_factory: pytest.TempPathFactory, _created_store: Path) -> Path:
    folder = tmp_path_factory.mktemp("watched")
    shutil.copyfile(_created_store, folder / "mlflow.db")
    spec = _write(folder, "sqlite:///mlflow.db", DDP, WATCHED_CHECKPOINT, **WATCHED)
    done = _runner(folder, str(spec))
    assert done.returncode == 0, done.stderr
    return folder


def _copy(folder: Path, tmp_path: Path) -> tuple[Path, str]:
    """``(spec, store)`` of this test's own copy of a finished run's folder."""
    shutil.copytree(folder, tmp_path, dirs_exist_ok=True)
    return tmp_path / "spec.toml", f"sqlite:///{tmp_path / 'mlflow.db'}"


@pytest.fixture
def finished(_finished_none: Path, tmp_path: Path) -> tuple[Path, str]:
    return _copy(_finished_none, tmp_path)


@pytest.fixture
def finished_ddp(_finished_ddp: Path, tmp_path: Path) -> tuple[Path, str]:
    return _copy(_finished_ddp, tmp_path)


def _interrupt(tmp_path: Path, spec: Path) -> subprocess.Popen:
    proc = _start_until_marked(tmp_path, spec, STEPS_PER_EPOCH + 1, "the run to reach epoch 2")
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=120)
    return proc


def test_interrupted_then_resumed_equals_uninterrupted(tmp_path: Path, finished_ddp: tuple[Path, str]) -> None:
    # A ddp job: its ranks stop together and resume equal. The same on one device, resumed by the printed
    # command, is test_reproduce_integration.py::test_the_interrupt_message_is_runner_resume_and_works_as_printed.
    spec, store = finished_ddp
    proc = _interrupt(tmp_path, spec)
    assert proc.returncode == 130
    full, stopped = _runs(store)
    assert stopped.info.status == "KILLED"
    stopped_steps = [s for s, _ in _histories(store, stopped.info.run_id)["train/loss"]]
    assert stopped_steps and stopped_steps[-1] < 3 * STEPS_PER_EPOCH

    resumed = _runner(tmp_path, str(spec), "--resume", "last")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "resuming from step-" in resumed.stderr  # a note, before training
    runs = _runs(store)
    assert len(runs) == 2, "resume must continue the same run, not start a new one"
    again = MlflowClient(store).get_run(stopped.info.run_id)
    assert again.info.status == "FINISHED"
    expected, got = _histories(store, full.info.run_id), _histories(store, stopped.info.run_id)
    for key in KEYS:
        steps = [s for s, _ in got[key]]
        assert steps == sorted(set(steps)), f"{key}: duplicated steps {steps}"
        assert got[key] == expected[key], key
    a, b = _final_model(store, full.info.run_id), _final_model(store, stopped.info.run_id)
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_a_watched_run_resumed_equals_the_uninterrupted_one(tmp_path: Path, _finished_watched: Path) -> None:
    spec, store = _copy(_finished_watched, tmp_path)
    proc = _interrupt(tmp_path, spec)
    assert proc.returncode == 130
    full, stopped = _runs(store)
    resumed = _runner(tmp_path, str(spec), "--resume", "last")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "early stopping: val/loss did not improve" in resumed.stderr
    expected, got = _histories(store, full.info.run_id), _histories(store, stopped.info.run_id)
    assert [step for step, _ in expected["val/loss"]] == [5, 10, 15, 20]  # stopped after epoch 4 of 6
    assert [value for step, value in expected["lr"] if step in (2, 6, 12, 16)] == pytest.approx([0.1, 0.1, 0.05, 0.025])
    assert got == expected
    client = MlflowClient(store)
    for key in ("runner.stopped_early", "runner.best_checkpoint"):
        assert client.get_run(stopped.info.run_id).data.tags[key] == client.get_run(full.info.run_id).data.tags[key]
    assert client.get_run(full.info.run_id).data.tags["runner.stopped_early"] == "step 20"
    folders = [Path(store[len("sqlite:///") :]).parent / "checkpoints" / run.info.run_id for run in (full, stopped)]
    assert [[p.name for p in list_checkpoints(f)] for f in folders] == [["step-00000005", "step-00000020"]] * 2
    for key in ("model", "ema"):
        a, b = (whole_model(f / "step-00000020", key) for f in folders)
        assert all(torch.equal(a[name], b[name]) for name in a), key


def test_truncated_latest_checkpoint_falls_back_and_says_so(tmp_path: Path, finished: tuple[Path, str]) -> None:
    spec, store = finished
    (run,) = _runs(store)
    folder = Path(store[len("sqlite:///") :]).parent / "checkpoints" / run.info.run_id
    files = list_checkpoints(folder)
    assert [f.name for f in files][-2:] == ["step-00000010", "step-00000015"]
    shard = files[-1] / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:1000])
    before = _histories(store, run.info.run_id)
    resumed = _runner(tmp_path, str(spec), "--resume", run.info.run_id)
    assert resumed.returncode == 0, resumed.stderr
    assert "step-00000015: damaged: the SHA-256 of step-00000015/__0_0.distcp differs" in resumed.stderr
    assert resumed.stderr.count("skipped") == 1, resumed.stderr  # said once, by the worker that loads it
    assert "resuming from step-00000010" in resumed.stderr
    after = _histories(store, run.info.run_id)
    assert after == before  # epoch 3 recomputed to the same values, no step logged twice
    assert MlflowClient(store).get_run(run.info.run_id).info.status == "FINISHED"


def test_resume_with_every_checkpoint_damaged_in_place_exits_1_and_uses_none(
    tmp_path: Path, finished: tuple[Path, str]
) -> None:
    spec, store = finished
    (run,) = _runs(store)
    client = MlflowClient(store)
    client.set_terminated(run.info.run_id, "KILLED")
    folder = Path(store[len("sqlite:///") :]).parent / "checkpoints" / run.info.run_id
    for path in list_checkpoints(folder):  # 64 bytes in the middle zeroed: DCP alone reads them
        shard = path / "__0_0.distcp"
        data = bytearray(shard.read_bytes())
        data[len(data) // 2 : len(data) // 2 + 64] = bytes(64)
        shard.write_bytes(bytes(data))
    resumed = _runner(tmp_path, str(spec), "--resume", run.info.run_id)
    assert resumed.returncode == 1, resumed.stderr
    assert "every one is damaged, so none is used" in resumed.stderr and "Traceback" not in resumed.stderr
    assert "step-00000010: damaged" in resumed.stderr and "step-00000015: damaged" in resumed.stderr
    assert "runner reproduce" in resumed.stderr
    assert client.get_run(run.info.run_id).info.status == "KILLED"


def test_of_two_resumes_started_together_exactly_one_runs(tmp_path: Path, finished: tuple[Path, str]) -> None:
    # Both used to run: each saw no live owner in the run's tags before either recorded itself, and every metric
    # from the resume step on was stored twice. The claim is one atomic lock now: the other exits 2 naming the owner.
    spec, store = finished
    (run,) = _runs(store)
    run_id = run.info.run_id
    MlflowClient(store).set_terminated(run_id, "KILLED")
    folder = Path(store[len("sqlite:///") :]).parent / "checkpoints" / run_id
    shutil.rmtree(folder / "step-00000015")  # the newest left is step 10: epoch 3 is trained again
    (folder / "step-00000015.sha256").unlink()
    before = _histories(store, run_id)
    # The build takes 8 s: before the claim was one step, both drivers were then between their check of the owner
    # and the record of theirs, so both ran. Training takes 0.3 s a step, so the first is still running when the
    # second comes.
    env = _env(PROBE_BUILD_SLEEP="8", PROBE_MARKER=str(tmp_path / "marker"), PROBE_AT="1", PROBE_SLEEP="0.3")
    command = [sys.executable, "-m", "runner", "exec", str(spec), "--resume", run_id]
    both = [subprocess.Popen(command, cwd=tmp_path, env=env, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outcomes = sorted((proc.wait(timeout=240), proc.communicate()[1]) for proc in both)
    assert [code for code, _ in outcomes] == [0, 2], outcomes
    refused = outcomes[1][1]
    assert "the run is owned by pid " in refused or "already FINISHED" in refused, refused  # or it came too late
    assert "Traceback" not in refused
    after = _histories(store, run_id)
    for key in KEYS:
        steps = [step for step, _ in after[key]]
        assert steps == sorted(set(steps)), f"{key}: steps logged twice {steps}"
    assert after == before  # epoch 3 recomputed once, to the same values
    client = MlflowClient(store)
    assert client.get_run(run_id).info.status == "FINISHED"
    assert client.get_run(run_id).data.tags["runner.resume.count"] == "1"


def test_resume_with_edited_spec_exits_2_listing_keys(
    tmp_path: Path, finished: tuple[Path, str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    spec, store = finished
    (run,) = _runs(store)
    monkeypatch.chdir(tmp_path)  # the refusals in this process: they start no training, so no new process is needed

    def refused(*args: str) -> str:
        assert main(["exec", str(spec), "--resume", run.info.run_id, *args]) == 2
        return capsys.readouterr().err

    edited = refused("--set", "optim.lr=0.2", "--set", "seed=4")
    assert "optim.lr" in edited and "seed" in edited and "Traceback" not in edited
    assert "already FINISHED" in refused()
    more_epochs = ("--resume", run.info.run_id, "--set", "train.epochs=4", "--allow-spec-change")
    assert "did you mean train.epochs" in refused(*more_epochs[2:], "train.epoch")
    allowed = _runner(tmp_path, str(spec), *more_epochs, "train.epochs")
    assert allowed.returncode == 0, allowed.stderr
    again = MlflowClient(store).get_run(run.info.run_id)
    assert json.loads(again.data.tags["runner.resume.spec_change"]) == {"train.epochs": [3, 4]}
    steps = [s for s, _ in _histories(store, run.info.run_id)["val/accuracy"]]
    assert steps == [5, 10, 15, 20]


def test_elastic_restart_resumes_from_checkpoint_in_the_same_run(
    tmp_path: Path, finished_ddp: tuple[Path, str]
) -> None:
    spec, store = finished_ddp
    crashed = _runner(tmp_path, str(spec), PROBE_MARKER=str(tmp_path / "crashed"), PROBE_AT="8", PROBE_CRASH="1")
    assert crashed.returncode == 0, crashed.stdout + crashed.stderr
    assert (tmp_path / "crashed").exists(), "the worker never crashed: the test tests nothing"
    full, restarted = _runs(store)
    assert restarted.info.status == "FINISHED"
    got = _histories(store, restarted.info.run_id)
    assert got == _histories(store, full.info.run_id)
    a, b = _final_model(store, full.info.run_id), _final_model(store, restarted.info.run_id)
    for key in a:
        assert torch.equal(a[key], b[key]), key


@pytest.mark.timeout(600)
def test_second_ctrl_c_exits_at_once(tmp_path: Path, store: str) -> None:
    """No timing but the product's own: signals less than 1 s apart count as one Ctrl-C (runner.launch.worker)."""
    spec = _write(tmp_path, store)
    log = tmp_path / "output.log"
    with log.open("w") as output:
        proc = _start_until_marked(tmp_path, spec, 2, "the run's second step", output=output, PROBE_SLEEP="900")
    try:
        proc.send_signal(signal.SIGINT)  # first: finish the step (which now takes 900 s), then stop
        wait_for(lambda: STOPPING in log.read_text(), "the first Ctrl-C to be taken", proc=proc)
        taken = time.monotonic()  # the handler ran before this: 1 s from now is more than 1 s from it
        wait_for(lambda: time.monotonic() > taken + 1.0, "a second to pass")
        proc.send_signal(signal.SIGINT)  # second: stop now, without finishing the step
        proc.wait(timeout=300)  # well before the 900 s step would end
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, log.read_text()
    (run,) = _runs(store)
    assert run.info.status == "KILLED"


def test_sigterm_under_fsdp_leaves_shards_ends_killed_and_resumes_on_one_process_equal(
    tmp_path: Path, finished: tuple[Path, str]
) -> None:
    # The preemption path under fsdp: each rank writes its shards at the stop; one process continues from them.
    # The checkpoints before it are saved in the background (checkpoint.async_save); the stop's is not.
    _, store = finished  # a finished none run of the same spec: the reference
    fsdp = _write(tmp_path, store, {**DDP, "mode": "fsdp"}, {**EVERY_2, "async_save": True}, name="fsdp.toml")
    proc = _interrupt(tmp_path, fsdp)
    assert proc.returncode == 130, proc.stdout
    reference, stopped = _runs(store)
    assert stopped.info.status == "KILLED"
    run_id = stopped.info.run_id
    saved = list_checkpoints(tmp_path / "checkpoints" / run_id)
    assert len(saved) >= 2 and all(path.is_dir() for path in saved)  # no file with the whole state
    for path in saved:  # the background saves before the stop are complete, as the stop's own is
        assert sorted(p.name for p in path.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"]
    assert not list((tmp_path / "checkpoints" / run_id).glob(".*.partial"))
    meta = load_latest(saved[-1].parent).payload  # meta.pt holds no weights
    assert "model" not in meta and "optimizer" not in meta and meta["state"]["global_step"] > 0

    resumed = _runner(tmp_path, str(fsdp), "--resume", run_id, "--nproc-per-node", "1")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert MlflowClient(store).get_run(run_id).info.status == "FINISHED"
    expected, got = _histories(store, reference.info.run_id), _histories(store, run_id)
    for key in ("train/loss", "val/loss"):
        assert [s for s, _ in got[key]] == [s for s, _ in expected[key]], key
        for (step, a), (_, b) in zip(got[key], expected[key], strict=True):
            assert a == pytest.approx(b, abs=1e-5), f"{key} at step {step}"

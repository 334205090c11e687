"""The process model (docs/design.md, "Process model"): MLflow lives in the driver alone, the run is created after the
build, and checks that need no build (a resume whose owner lives, the checkpoint folder) come before any process starts.

That no process that runs backward holds mlflow is checked on the agreement runs (with ``helpers.PROBES``): none, ddp-2
and torchrun in tests/launch/test_ddp_integration.py, fsdp-2 in tests/strategies/test_fsdp_integration.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from mlflow.entities import ViewType
from mlflow.tracking import MlflowClient

from runner.cli import main
from runner.launch.resume import Owner
from tests.helpers import PROBES, spec_dict, toml_text

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

MODES = {
    "none": {},
    "ddp-2": {"mode": "ddp", "nproc_per_node": 2},
    "fsdp-2": {"mode": "fsdp", "nproc_per_node": 2},
}


def _spec(tmp_path: Path, store: str, parallel: dict, **changes) -> Path:
    (tmp_path / "probes.py").write_text(PROBES, encoding="utf-8")
    body = spec_dict(
        tracking={"uri": store},
        loss={"name": "probes:loss"},
        model={"name": "probes:model", "kwargs": {"in_features": 8, "num_classes": 3}},
        parallel=parallel or None,
        train={"epochs": 1, "log_every_n_steps": 1, "progress": "off"},
        **changes,
    )
    path = tmp_path / "spec.toml"
    path.write_text(toml_text(body), encoding="utf-8")
    return path


def _runs(store: str) -> list:
    client = MlflowClient(store)
    experiment = client.get_experiment_by_name("tests")
    if experiment is None:
        return []
    return client.search_runs([experiment.experiment_id], run_view_type=ViewType.ALL)


@pytest.mark.parametrize("mode", ["none", "ddp-2"])
def test_a_spec_error_found_while_building_leaves_no_run_at_all(mode, tmp_path: Path, store: str, capsys):
    spec = _spec(tmp_path, store, MODES[mode], data={"target": "label"})  # synthetic samples are (x, y) pairs
    assert main(["exec", str(spec)]) == 2
    err = capsys.readouterr().err
    assert "data.target" in err and f"{spec}:" in err and "Traceback" not in err
    assert _runs(store) == []  # not even a deleted one


def test_a_resume_whose_owner_lives_is_refused_before_any_training_process_starts(
    tmp_path: Path, store: str, capsys, monkeypatch
):
    probe = tmp_path / "probe"
    probe.mkdir()
    monkeypatch.setenv("RUNNER_TEST_PROBE", str(probe))
    spec = _spec(tmp_path, store, MODES["ddp-2"])
    client = MlflowClient(store)
    eid = client.create_experiment("tests")
    run_id = client.create_run(eid, tags=Owner.this_process().tags(), run_name="live").info.run_id
    assert main(["exec", str(spec), "--resume", run_id]) == 2
    err = capsys.readouterr().err
    assert run_id in err and "still RUNNING" in err
    assert list(probe.iterdir()) == []  # no training process built a model


def test_driver_check_failing_under_ddp_starts_no_worker_and_leaves_no_run(
    write_spec, store: str, tmp_path: Path, capsys
):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder\n", encoding="utf-8")
    spec = write_spec(f'[checkpoint]\ndir = "{blocker}/checkpoints"\n')
    args = ["exec", str(spec), "--set", 'parallel.mode="ddp"', "--set", "parallel.nproc_per_node=2"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "checkpoint.dir" in err and f"{spec}:" in err and "Traceback" not in err
    assert _runs(store) == []


BREAKS = """
import torch


class Stops(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(8, 3)
        self.stopped = False

    def forward(self, x):
        if not self.stopped:
            self.stopped = True
            breakpoint()
        return self.net(x)


def build():
    return Stops()
"""


def test_a_breakpoint_in_the_users_model_gives_a_prompt_under_none(tmp_path: Path, store: str):
    import os
    import subprocess
    import sys

    (tmp_path / "stops.py").write_text(BREAKS, encoding="utf-8")
    body = spec_dict(tracking={"uri": store}, model={"name": "stops:build", "kwargs": None}, train={"epochs": 1})
    spec = tmp_path / "spec.toml"
    spec.write_text(toml_text(body), encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONBREAKPOINT"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[2]), env.get("PYTHONPATH", "")])
    proc = subprocess.Popen(
        [sys.executable, "-m", "runner", "exec", str(spec)],
        cwd=tmp_path,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    out, err = proc.communicate("p 6 * 7\nc\n", timeout=280)  # typed at the prompt of the training process
    assert proc.returncode == 0, err
    assert "(Pdb) 42\n" in out and "status: FINISHED" in out


@pytest.mark.parametrize("mode", ["none", "ddp-2"])
def test_the_driver_imports_neither_torch_nor_trains(mode, tmp_path: Path, store: str):
    import json
    import os
    import subprocess
    import sys

    spec = _spec(tmp_path, store, MODES[mode])
    probe = tmp_path / "probe"
    probe.mkdir()
    code = (
        "import json, sys; from runner.cli import main; rc = main(['exec', sys.argv[1]]); "
        "print(json.dumps([rc, 'torch' in sys.modules, 'mlflow' in sys.modules]))"
    )
    env = {**os.environ, "RUNNER_TEST_PROBE": str(probe)}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[2]), env.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, "-c", code, str(spec)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=280
    )
    rc, torch_in_driver, mlflow_in_driver = json.loads(done.stdout.strip().splitlines()[-1])
    assert rc == 0, done.stderr
    assert not torch_in_driver and mlflow_in_driver  # the driver records the run; its child trained
    assert [p.read_text() for p in probe.glob("trains-*")] == ["clean"] * MODES[mode].get("nproc_per_node", 1)


def test_the_training_child_is_the_process_started_before_the_spec_was_read(tmp_path: Path, store: str, monkeypatch):
    import signal
    import subprocess

    from runner.launch import elastic

    started: list[subprocess.Popen] = []
    real = subprocess.Popen

    def recorded(command, **kwargs):
        proc = real(command, **kwargs)
        started.extend([proc] if "--ready" in command else [])
        return proc

    monkeypatch.setattr(elastic.subprocess, "Popen", recorded)
    monkeypatch.setenv("RUNNER_TEST_PROBE", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    assert main(["exec", str(_spec(tmp_path, store, {}))]) == 0
    assert started[0].returncode == 0 and _runs(store)[0].info.status == "FINISHED"  # it trained, then ended
    assert [p.name for p in tmp_path.glob("trains-*")] == [f"trains-{started[0].pid}"]
    assert main(["exec", str(tmp_path / "missing.toml")]) == 2
    assert started[1].returncode == -signal.SIGKILL  # not needed: ended at once

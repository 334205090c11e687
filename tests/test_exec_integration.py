"""``runner exec`` end to end on CPU: real digits data, MLflow records, statuses and exit codes."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from runner.cli import main
from runner.tracking.runs import TrackedRun
from tests.helpers import exec_args, spec_text

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def digits(store: str, seed: int = 0, epochs: int = 1) -> str:
    """``helpers.MINIMAL`` on scikit-learn's digits (batch 64, momentum 0.9), logging lines every 5 steps."""
    return spec_text(
        name="digits",
        seed=seed,
        model={"kwargs": {"hidden": [64]}},
        data={
            "dataset": "sklearn.digits",
            "num_samples": None,
            "input_shape": None,
            "num_classes": None,
            "batch_size": 64,
            "val_fraction": 0.2,
        },
        optim={"momentum": 0.9},
        train={"epochs": epochs, "log_every_n_steps": 5, "progress": "lines"},
        tracking={"uri": store, "experiment": "digits-test"},
    )


def _runs(store: str, experiment: str = "digits-test"):
    client = MlflowClient(store)
    exp = client.get_experiment_by_name(experiment)
    return client, (
        [] if exp is None else client.search_runs([exp.experiment_id], order_by=["attributes.start_time ASC"])
    )


def _history(client: MlflowClient, run_id: str, key: str) -> list[tuple[int, float]]:
    return [(m.step, m.value) for m in client.get_metric_history(run_id, key)]


def test_digits_mlp_learns_and_records_a_complete_run(write_spec, store: str, capsys) -> None:
    spec = write_spec(text=digits(store, epochs=4))
    assert main(["exec", str(spec)]) == 0
    out = capsys.readouterr().out
    client, runs = _runs(store)
    assert len(runs) == 1
    run = runs[0]
    assert run.info.run_id in out and "mlflow ui --backend-store-uri" in out
    assert run.info.status == "FINISHED"
    assert run.data.params["optim.lr"] == "0.1"
    assert run.data.params["data.batch_size"] == "64"
    assert run.data.params["model.kwargs.hidden"] == "[64]"
    assert run.data.tags["runner.spec.sha256"]
    assert run.data.tags["runner.devices"] == "cpu" and run.data.tags["runner.accelerator"] == "cpu"
    assert run.data.tags["runner.world_size"] == "1"
    assert run.data.metrics["val/accuracy"] > 0.9
    assert 100 < run.data.metrics["memory/peak_rss_mib/rank0"] < 10_000  # the training process's peak, on CPU
    # the second step's FLOPs (batch 64 through Linear(64, 64): forward, weight gradient; Linear(64, 10): forward,
    # input and weight gradients), the achieved TFLOP/s, and no MFU: a CPU's peak is not known
    assert run.data.metrics["perf/flops_per_step"] == 2 * 64 * 64 * 64 * 2 + 2 * 64 * 64 * 10 * 3
    assert 0 < run.data.metrics["perf/tflops_per_s/rank0"] < 100
    assert not [k for k in run.data.metrics if k.startswith("perf/mfu")]
    assert run.data.tags["runner.mfu"] == "no MFU: peak fp32 FLOP/s of cpu unknown; set devices.peak_tflops"
    assert "FLOPs per step; no MFU: peak fp32 FLOP/s of cpu unknown" in out
    cuda = run.data.tags["runner.cuda_version"]  # the torch build's, said so on a CPU run
    assert cuda == "none" or cuda.endswith(" (torch build; no GPU used)"), cuda
    busy = run.data.tags["runner.host_busy"]  # how busy the host was, beside the speed figures
    state = {"true": "busy", "false": "quiet"}[busy]
    assert run.data.tags["runner.host_load"].startswith(f"{state}: load ")  # a column value; the sentence below
    assert f"#### runner\n**host load**: {state}: 1-min load" in run.data.tags["mlflow.note.content"]
    long_tags = {k: v for k, v in run.data.tags.items() if k.startswith("runner.") and ("\n" in v or len(v) > 80)}
    assert long_tags.keys() <= {"runner.spec.path", "runner.checkpoint_dir"}, long_tags  # the UI's chips cut the rest
    assert ("host: busy: 1-min load" in out) == (busy == "true")
    for key in ("train/loss", "val/loss", "val/accuracy", "train/accuracy", "lr", "samples_per_s", "epoch_time_s"):
        history = _history(client, run.info.run_id, key)
        assert history, key
        steps = [s for s, _ in history]
        assert all(isinstance(s, int) for s in steps)
        assert steps == sorted(set(steps)), f"{key} steps not strictly increasing: {steps}"
    # 1437 training samples / 64 = 23 steps per epoch (last one partial), 4 epochs
    assert _history(client, run.info.run_id, "val/accuracy")[-1][0] == 4 * 23
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id, "spec")}
    assert "spec/resolved.toml" in artifacts and "spec/spec.toml" in artifacts
    # start-up: from this process's start (pytest's, here) to the end of the first step, logged once and printed
    (startup,) = _history(client, run.info.run_id, "time_to_first_step_s")
    assert startup[0] == 1 and startup[1] > 0
    assert f"start-up: {startup[1]:.1f} s to the end of the first step" in out


def test_unreachable_tracking_server_fails_before_training(write_spec, tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    spec = write_spec(text=digits(f"http://127.0.0.1:{port}"))
    assert main(["exec", str(spec)]) == 2
    assert not (tmp_path / "checkpoints").exists()
    assert not (tmp_path / "mlflow.db").exists()


FACTORY = """
import torch


class Exploding(torch.nn.Module):
    def __init__(self, at_call: int = 3):
        super().__init__()
        self.lin = torch.nn.Linear(8, 3)
        self.calls = 0
        self.at_call = at_call

    def forward(self, x):
        self.calls += 1
        if self.calls == self.at_call:
            raise RuntimeError("exploded on purpose")
        return self.lin(x)


def build(at_call: int = 3):
    return Exploding(at_call)
"""


def test_failing_model_marks_run_failed_and_leaves_no_active_run(write_spec, store: str, tmp_path: Path) -> None:
    import mlflow

    (tmp_path / "boom_factory.py").write_text(FACTORY)
    spec = write_spec()
    for _ in range(2):
        assert main(["exec", str(spec), "--set", 'model.name="boom_factory:build"', "--set", "model.kwargs={}"]) == 1
        assert mlflow.active_run() is None
    _client, runs = _runs(store, "tests")
    assert [r.info.status for r in runs] == ["FAILED", "FAILED"]
    assert "exploded on purpose" in runs[0].data.tags["runner.error"]


def test_bad_override_exits_2_without_a_run(write_spec, store: str) -> None:
    spec = write_spec()
    assert main(["exec", str(spec), "--set", "optim.lr=-1"]) == 2
    assert _runs(store, "tests")[1] == []


def test_unknown_model_exits_2_without_a_run(write_spec, store: str, capsys) -> None:
    spec = write_spec()
    assert main(["exec", str(spec), "--set", 'model.name="torchvision.resnet19"']) == 2
    assert "resnet18" in capsys.readouterr().err
    assert _runs(store, "tests")[1] == []


@pytest.mark.parametrize(
    "override, key",
    [("model.kwargs={bogus=1}", "model.kwargs"), ("optim.kwargs={nesterov_typo=true}", "optim.kwargs")],
)
def test_kwargs_that_do_not_build_exit_2_and_leave_no_run(
    write_spec, store: str, capsys, override: str, key: str
) -> None:
    spec = write_spec()
    assert main(["exec", str(spec), "--set", override]) == 2
    err = capsys.readouterr().err
    assert f"{spec}" in err and key in err and "Traceback" not in err
    assert _runs(store, "tests")[1] == []


def test_kwargs_that_do_not_build_under_ddp_exit_2_and_leave_no_run(write_spec, store: str, capsys) -> None:
    spec = write_spec()
    sets = ['parallel.mode="ddp"', "parallel.nproc_per_node=2", "optim.kwargs={nesterov_typo=true}"]
    args = ["exec", str(spec)]
    for item in sets:
        args += ["--set", item]
    assert main(args) == 2
    assert "optim.kwargs" in capsys.readouterr().err
    assert _runs(store, "tests")[1] == []


def test_interrupt_message_says_how_to_resume(tmp_path, monkeypatch) -> None:
    from runner.errors import Interrupted
    from runner.launch.resume import resume_command

    hint = Interrupted(15, run_id="abc").hint()
    assert hint.endswith("Continue it with: runner resume abc")  # the spec and its --set values are in the run
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    here = f"sqlite:///{tmp_path}/mlflow.db"  # the tests run in tmp_path: ./mlflow.db is the default store
    assert resume_command(TrackedRun(here, "abc")) == "runner resume abc"
    assert (
        resume_command(TrackedRun("sqlite:////elsewhere/m.db", "abc"))
        == "runner resume abc --tracking-uri sqlite:////elsewhere/m.db"
    )
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:////elsewhere/m.db")
    assert resume_command(TrackedRun("sqlite:////elsewhere/m.db", "abc")) == "runner resume abc"


def test_an_active_fluent_run_is_an_error_unless_nested(write_spec, store: str) -> None:
    import mlflow

    from runner.errors import TrackingError
    from runner.launch.driver import exec_experiment
    from runner.launch.session import ExecOptions
    from runner.spec.loading import load_spec

    loaded = load_spec(write_spec(), ["train.epochs=1"])
    mlflow.set_tracking_uri(store)
    with mlflow.start_run() as outer:
        with pytest.raises(TrackingError, match="active"):
            exec_experiment(loaded)
        result = exec_experiment(loaded, ExecOptions(nested=True))
    child = MlflowClient(store).get_run(result.run_id)
    assert child.info.status == "FINISHED"
    assert child.data.tags.get("mlflow.parentRunId") == outer.info.run_id


def test_a_default_spec_trains_without_importing_torchmetrics_torchvision_or_matplotlib(write_spec, store: str) -> None:
    """The default accuracy is counted in the loop's sums: a default spec pays for no metric library's imports."""
    import subprocess
    import sys

    spec = write_spec(text=digits(store, epochs=1))
    probe = (
        "import sys; from runner.cli import main; code = main(['exec', sys.argv[1], '--set', 'train.max_steps=2']); "
        "print(sorted(m for m in ('torchmetrics', 'torchvision', 'matplotlib') if m in sys.modules)); sys.exit(code)"
    )
    done = subprocess.run([sys.executable, "-c", probe, str(spec)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"
    _, (run,) = _runs(store)
    assert run.data.metrics["val/accuracy"] > 0 and "train/accuracy" in run.data.metrics


def test_the_first_example_learns_well_and_agrees_under_ddp(store: str, capsys) -> None:
    """README's first command: val/accuracy >= 0.96, and its ddp-2 twin within 1e-4 in val/loss (docs/design.md §3)."""
    experiments = Path(__file__).parents[1] / "experiments"
    uri = f'tracking.uri="{store}"'
    assert main(exec_args(experiments / "digits_mlp.toml", uri)) == 0
    assert main(exec_args(experiments / "digits_mlp_ddp.toml", uri)) == 0
    assert "val/accuracy           0.97" in capsys.readouterr().out
    _, (single, ddp) = _runs(store, "digits")
    assert single.data.metrics["val/accuracy"] >= 0.96
    assert ddp.data.params["parallel.mode"] == "ddp" and ddp.data.params["parallel.nproc_per_node"] == "2"
    assert abs(single.data.metrics["val/loss"] - ddp.data.metrics["val/loss"]) < 1e-4

"""Notes about the spec reach the user before training, once; the shipped main spec has none on a CPU machine."""

from __future__ import annotations

from pathlib import Path

import pytest

from runner.devices.inventory import Inventory
from runner.launch import driver
from runner.launch.channel import Built
from runner.launch.session import ExecOptions
from runner.plan import make_plan
from runner.spec.loading import load_spec
from runner.training import WorkerResult

REPO = Path(__file__).parents[1]
NO_GPU = Inventory([], False, "no GPU", [])


def test_the_main_spec_has_no_note_on_a_cpu_machine() -> None:
    plan = make_plan(load_spec(REPO / "experiments" / "digits_mlp.toml"), env={}, inventory=NO_GPU)
    assert plan.devices.accelerator == "cpu" and plan.devices.notes == []


def test_spec_notes_print_before_training_and_not_again_in_the_summary(
    write_spec, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    text = write_spec().read_text().replace('accelerator = "cpu"', 'accelerator = "cpu"\nids = [0]')
    path = write_spec(text=text.replace("[tracking]", "[tracking]\nenabled = false"), name="ids.toml")
    seen_before_training: list[str] = []

    def fake_training(plan, args, hangs, options, session):
        session.handle(Built(None, []))  # rank 0 reports its build: the driver prints the notes then
        seen_before_training.append(capsys.readouterr().err)
        worker = WorkerResult(rank=0, metrics={"val/loss": 0.5})
        return [worker]

    monkeypatch.setattr(driver, "_launch", fake_training)
    result = driver.exec_experiment(load_spec(path))
    assert seen_before_training == ["runner: note: devices.ids = [0] is ignored: the run is on cpu\n"]
    assert result.notes == ["devices.ids = [0] is ignored: the run is on cpu"]
    assert "note" not in result.summary() and result.summary().startswith("status: FINISHED")


def test_trials_of_a_sweep_or_bench_leave_their_notes_to_the_tool(
    write_spec, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    text = write_spec().read_text().replace('accelerator = "cpu"', 'accelerator = "cpu"\nids = [0]')
    path = write_spec(text=text.replace("[tracking]", "[tracking]\nenabled = false"), name="ids.toml")
    worker = WorkerResult(rank=0)

    def fake_training(plan, args, hangs, options, session):
        session.handle(Built(None, []))
        return [worker]

    monkeypatch.setattr(driver, "_launch", fake_training)
    result = driver.exec_experiment(load_spec(path), ExecOptions(parent_run_id="p" * 32))
    assert capsys.readouterr().err == ""  # the trial prints no note: its tool reports
    assert "note: devices.ids = [0] is ignored: the run is on cpu" in result.summary()


@pytest.mark.created_store
def test_the_printed_link_of_a_new_run_names_its_experiment_without_asking_the_store_again(
    write_spec, store: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The driver created the run, so it knows the experiment: no store call after training for the link."""
    from mlflow.tracking import MlflowClient

    from runner.tracking import runs

    def built_and_done(plan, args, hangs, options, session):
        session.handle(Built(None, []))
        return [WorkerResult(rank=0, metrics={"val/loss": 0.5})]

    def asked(run: runs.TrackedRun) -> str:
        raise AssertionError("the store was asked for the experiment of the run the driver created")

    monkeypatch.setattr(driver, "_launch", built_and_done)
    monkeypatch.setattr(runs.TrackedRun, "experiment_id", asked)
    result = driver.exec_experiment(load_spec(write_spec()))
    assert result.run_id is not None
    assert result.experiment_id == MlflowClient(store).get_run(result.run_id).info.experiment_id != ""
    assert f"#/experiments/{result.experiment_id}/runs/{result.run_id}" in result.summary()


DROPOUT_MODEL = """
from torch import nn


def build(in_features, num_classes, p=0.25):
    return nn.Sequential(nn.Linear(in_features, 16), nn.Dropout(p), nn.Linear(16, num_classes))
"""


@pytest.mark.parametrize("p", [0.25, 0.0])
def test_a_factory_models_dropout_is_named_before_training_under_mode_none_and_recorded(
    write_spec, store: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], p: float
) -> None:
    from mlflow.tracking import MlflowClient

    from runner.cli import main

    (tmp_path / "dropout_net.py").write_text(DROPOUT_MODEL, encoding="utf-8")
    model = f'model={{name="dropout_net:build", kwargs={{in_features=8, num_classes=3, p={p}}}}}'
    assert main(["exec", str(write_spec()), "--set", model, "--set", "train.epochs=1"]) == 0
    said = "Dropout: under dp, ddp or fsdp each rank draws its own random numbers, so results differ from mode none"
    err = capsys.readouterr().err
    run = MlflowClient(store).search_runs([MlflowClient(store).get_experiment_by_name("tests").experiment_id])[0]
    if p == 0.0:  # a dropout that draws nothing is no cause
        assert said not in err and said not in run.data.tags.get("mlflow.note.content", "")
        return
    assert said in err and "runner parity proves the rest agrees" in err
    assert said in run.data.tags["mlflow.note.content"]


def test_random_transforms_are_named_like_dropout_and_deterministic_ones_are_not() -> None:
    from torch import nn

    from runner.launch.prebuild import difference_notes
    from tests.helpers import spec_object

    def notes(*transforms: object) -> list[str]:
        spec = spec_object(data={"dataset": "sklearn.digits", "batch_size": 32, "transforms": list(transforms)})
        return difference_notes(nn.Linear(64, 10), spec)

    flip = {"name": "RandomHorizontalFlip", "kwargs": {"p": 0.5}}
    assert notes("Normalize", flip, "my_augment:Blur")[0].startswith(
        "data.transforms RandomHorizontalFlip, data.transforms my_augment:Blur: under dp, ddp or fsdp each rank draws"
    )
    assert notes({"name": "Normalize", "kwargs": {"mean": [0.5], "std": [0.5]}}, "Resize") == []


def test_runner_plan_names_a_factory_models_dropout_where_it_estimates_memory(
    write_spec, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The estimate calls the factory on fake tensors anyway; --no-memory calls no user code, and says nothing."""
    from runner.cli import main

    (tmp_path / "dropout_net.py").write_text(DROPOUT_MODEL, encoding="utf-8")
    model = 'model={name="dropout_net:build", kwargs={in_features=8, num_classes=3}}'
    said = "Dropout: under dp, ddp or fsdp each rank draws its own random numbers"
    assert main(["plan", str(write_spec()), "--set", model]) == 0
    assert said in capsys.readouterr().out
    assert main(["plan", str(write_spec()), "--set", model, "--no-memory"]) == 0
    assert said not in capsys.readouterr().out

"""[[callbacks]]: the user's hooks at training's milestones, logging metrics, figures, images and files to the run."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from runner.cli import main
from runner.launch.driver import exec_experiment
from runner.launch.session import ExecOptions
from runner.spec.loading import load_spec
from runner.training.callbacks import Callbacks
from tests.helpers import refusal

pytestmark = pytest.mark.timeout(180)

RECORDER = """
import numpy as np
from matplotlib.figure import Figure

CALLS = []


class Recorder:
    def __init__(self, tag="x"):
        self.tag = tag

    def on_train_start(self, ctx):
        CALLS.append(("start", ctx.step, ctx.epoch, ctx.rank))

    def on_validation_end(self, ctx, metrics):
        CALLS.append(("validated", ctx.step, ctx.epoch, sorted(metrics)))
        ctx.log_metrics({"val/twice_loss": 2 * metrics["val/loss"]})

    def on_epoch_end(self, ctx):
        CALLS.append(("epoch", ctx.step, ctx.epoch, "train/epoch_loss" in ctx.metrics))

    def on_train_end(self, ctx):
        CALLS.append(("end", ctx.step, ctx.epoch, type(ctx.model).__name__))
        figure = Figure()
        figure.add_subplot().plot([0, 1], [1, 0])
        ctx.log_figure(figure, "a curve")
        ctx.log_image(np.linspace(0, 1, 12).reshape(3, 4), "ramp")
        note = ctx.folder / "note.txt"
        note.write_text(self.tag)
        ctx.log_artifact(note, "notes")


def broken():
    return Broken()


class Broken:
    def on_epoch_end(self, ctx):
        return 1 / 0


def hookless():
    return object()
"""


@pytest.fixture
def callback_spec(write_spec, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    (tmp_path / "user_callbacks.py").write_text(RECORDER, encoding="utf-8")
    monkeypatch.delitem(sys.modules, "user_callbacks", raising=False)  # this test's file, imported afresh

    def write(name: str, kwargs: str = "{}") -> Path:
        return write_spec(f'[[callbacks]]\nname = "user_callbacks:{name}"\nkwargs = {kwargs}\n')

    return write


def test_hooks_run_at_their_milestones_and_log_to_the_run(callback_spec, store: str) -> None:
    path = callback_spec("Recorder", '{ tag = "hello" }')
    result = exec_experiment(load_spec(path), ExecOptions(in_process=True))
    module = sys.modules["user_callbacks"]  # imported by the run, from the spec's folder
    assert module.CALLS == [
        ("start", 0, 0, 0),
        ("validated", 5, 0, ["val/accuracy", "val/loss"]),
        ("epoch", 5, 0, True),
        ("validated", 10, 1, ["val/accuracy", "val/loss"]),
        ("epoch", 10, 1, True),
        ("end", 10, 2, "Sequential"),
    ]
    client = MlflowClient(store)
    twice = [(m.step, m.value) for m in client.get_metric_history(result.run_id, "val/twice_loss")]
    losses = [(step, 2 * m["val/loss"]) for step, m in result.history if "val/loss" in m]
    assert [step for step, _ in twice] == [step for step, _ in losses]
    assert [value for _, value in twice] == pytest.approx([value for _, value in losses])
    files = {a.path for folder in ("figures", "images", "notes") for a in client.list_artifacts(result.run_id, folder)}
    assert files == {"figures/a_curve.png", "images/ramp.png", "notes/note.txt"}


def test_an_error_in_a_callback_fails_the_run_naming_the_users_file_and_line(
    callback_spec, store: str, capsys: pytest.CaptureFixture[str]
) -> None:
    path = callback_spec("broken")
    assert main(["exec", str(path)]) == 1
    err = capsys.readouterr().err
    assert "callbacks[0].name: your code raised ZeroDivisionError: division by zero" in err, err
    assert f"{path.parent / 'user_callbacks.py'}:" in err and "Traceback" not in err
    client = MlflowClient(store)
    (run,) = client.search_runs([client.get_experiment_by_name("tests").experiment_id])
    assert run.info.status == "FAILED"


@pytest.mark.parametrize(
    ("name", "kwargs", "says"),
    [
        (
            "hookless",
            "{}",
            "callbacks[0].name: 'user_callbacks:hookless' returned a object with none of on_train_start",
        ),
        ("Recorder", "{ tga = 1 }", "callbacks[0].kwargs: 'user_callbacks:Recorder': got an unexpected keyword"),
        ("Missing", "{}", "callbacks[0].name"),
    ],
)
def test_a_callback_that_does_not_build_exits_2_before_any_run(
    callback_spec, store: str, capsys, name: str, kwargs: str, says: str
) -> None:
    path = callback_spec(name, kwargs)
    assert main(["exec", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"{path}:" in err and says in err and "Traceback" not in err, err
    experiment = MlflowClient(store).get_experiment_by_name("tests")
    assert experiment is None or not MlflowClient(store).search_runs([experiment.experiment_id])


def test_a_name_that_is_no_import_path_is_refused_at_its_line(tmp_path: Path) -> None:
    path = tmp_path / "s.toml"
    text = refusal(path, "[callbacks]", 'name = "plots"')
    assert f"{path}:" in text and "callbacks[0].name" in text and "is not an import path" in text, text


def test_callbacks_run_on_rank_0_unless_they_ask_for_every_rank() -> None:
    class Quiet:
        def on_train_end(self, ctx): ...

    class Everywhere(Quiet):
        every_rank = True

    built = [("callbacks[0].name", Quiet()), ("callbacks[1].name", Everywhere())]
    assert [key for key, _ in Callbacks(built, rank=0).built] == ["callbacks[0].name", "callbacks[1].name"]
    assert [key for key, _ in Callbacks(built, rank=1).built] == ["callbacks[1].name"]

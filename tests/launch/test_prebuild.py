"""Parts are built (or their arguments checked) before the MLflow run exists: a bad value exits 2 and leaves no run."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import pytest
import torch

from runner.cli import main
from runner.errors import SpecError
from runner.launch.prebuild import check_call, check_parts
from runner.spec.loading import load_spec, relocate_issues
from runner.spec.messages import value_problem


def _issue(path: Path, overrides: tuple[str, ...] = ()):
    """The one issue ``check_parts`` finds (its key alone), placed in the file as a run's start places it."""
    loaded = load_spec(path, overrides)
    with pytest.raises(SpecError) as info:
        check_parts(loaded, world_size=1)
    (found,) = info.value.issues
    assert found.file is None and found.line is None  # placed once, where the run starts (exec_experiment)
    (issue,) = relocate_issues(info.value, loaded).issues
    return issue


def _line(path: Path, text: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if line.startswith(text))


@pytest.mark.integration  # starts several processes: the driver's training child
def test_a_scheduler_kwarg_of_the_wrong_type_is_found_before_training(write_spec, tmp_path: Path, capsys) -> None:
    path = write_spec('[scheduler]\nname = "step"\nkwargs = { step_size = "ten" }\n')
    issue = _issue(path)
    assert (issue.file, issue.line, issue.key) == (
        path,
        _line(path, "kwargs = { step_size"),
        "scheduler.kwargs.step_size",
    )
    assert 'got "ten"; expected a whole number' in issue.message and "StepLR(optimizer: Optimizer, step_size: int" in (
        issue.message
    )
    assert main(["exec", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"{path}:{issue.line}: scheduler.kwargs.step_size" in err and "Traceback" not in err
    assert not (tmp_path / "mlflow.db").exists()  # no run, not even a store


def test_a_schedule_that_fails_only_when_stepped_is_found(write_spec) -> None:
    path = write_spec('[scheduler]\nname = "onecycle"\nkwargs = { total_steps = 3 }\n')
    issue = _issue(path)  # 5 steps per epoch x 2 epochs = 10 calls, 3 allowed
    assert issue.key == "scheduler.kwargs" and "OneCycleLR fails when stepped" in issue.message
    assert "Tried to step 4 times" in issue.message


def test_a_one_cycle_schedule_is_not_blamed_when_the_run_length_is_unknown() -> None:
    """A dataset not built before the run (a factory) left the length unknown: OneCycleLR was sized to 1 step."""
    from runner.launch.prebuild import _optimizer_and_scheduler
    from tests.helpers import spec_object

    spec = spec_object(scheduler={"name": "onecycle", "kwargs": {"pct_start": 0.2}})
    _optimizer_and_scheduler(spec, Path("."), None, None)  # no SpecError: "Tried to step 2 times ... total steps is 1"


@pytest.mark.parametrize("gamma", ["-3", "-0.5"])
def test_a_schedule_that_drives_the_learning_rate_negative_or_non_finite_is_found(write_spec, gamma: str) -> None:
    path = write_spec(f'[scheduler]\nname = "step"\nkwargs = {{ step_size = 2, gamma = {gamma} }}\n')
    issue = _issue(path)
    assert issue.key == "scheduler.kwargs" and "StepLR fails when stepped" in issue.message
    assert "the learning rate of parameter group 0 became" in issue.message and "finite and >= 0" in issue.message


def test_a_learning_rate_gone_negative_while_training_stops_it() -> None:
    """A schedule the dry run could not step (built only in the worker) is stopped at the step it goes wrong."""
    import torch

    from runner.errors import TrainingError
    from runner.training.sums import check_lr

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=-3.0)
    check_lr(optimizer, scheduler)
    optimizer.step()
    scheduler.step()
    with pytest.raises(TrainingError, match=r"StepLR after 1 step\(s\): the learning rate .* became -0.3"):
        check_lr(optimizer, scheduler)


def test_a_scheduler_kwarg_given_with_set_is_blamed_on_set(write_spec) -> None:
    path = write_spec('[scheduler]\nname = "step"\nkwargs = { step_size = 1 }\n')
    issue = _issue(path, ("scheduler.kwargs.gamma=true",))
    assert (issue.file, issue.line, issue.key) == (path, None, "scheduler.kwargs.gamma")
    assert (
        "got true; expected a number" in issue.message and "(from --set scheduler.kwargs.gamma=true)" in issue.message
    )


def test_optimizer_and_model_kwargs_are_built(write_spec) -> None:
    path = write_spec()
    issue = _issue(path, ("optim.kwargs={ nesterov = 1 }",))
    assert issue.key == "optim.kwargs" and "nesterov" in issue.message
    issue = _issue(path, ("model.kwargs={ hidden = [32], depth = 2 }",))
    assert issue.key == "model.kwargs" and "depth" in issue.message


def test_an_unknown_model_is_reported_with_file_and_line(write_spec, capsys) -> None:
    path = write_spec()
    path.write_text(path.read_text().replace('name = "mlp"', 'name = "mlpp"'))
    assert main(["exec", str(path)]) == 2
    err = capsys.readouterr().err
    line = _line(path, 'name = "mlpp"')
    assert f"{path}:{line}: model.name: unknown model 'mlpp'" in err
    assert 'did you mean "mlp"?' in err


def test_a_dataset_factory_is_checked_by_signature_and_type_without_being_called(write_spec, tmp_path: Path) -> None:
    (tmp_path / "slow_data.py").write_text(
        "def build(num: int = 4, scale: float = 1.0):\n    raise SystemExit('the dataset factory was called')\n"
    )
    path = write_spec()
    text = path.read_text().replace('dataset = "synthetic"', 'dataset = "slow_data:build"\nkwargs = { num = "4" }')
    path.write_text(text)
    issue = _issue(path)
    assert (issue.key, issue.line) == ("data.kwargs.num", _line(path, "kwargs = { num"))
    expected = 'got "4"; expected a whole number (remove the quotes: write 4) (signature: build(num: int = 4, scale'
    assert expected in issue.message
    path.write_text(text.replace('num = "4"', "size = 4"))
    assert "unexpected keyword argument 'size'" in _issue(path).message
    path.write_text(text.replace('num = "4"', "num = 4, scale = 2"))
    check_parts(load_spec(path), world_size=1)  # right kwargs: nothing raised, nothing called


def test_a_batch_that_leaves_no_step_is_found_before_the_run(write_spec) -> None:
    path = write_spec()
    issue = _issue(path, ("data.batch_size=128", "data.drop_last=true"))
    assert issue.key == "data.batch_size" and "leaves no training step" in issue.message


def test_a_good_spec_passes_and_builds_a_builtin_model_on_meta(write_spec, monkeypatch) -> None:
    import runner.training.models as models

    devices: list[str] = []
    real = models.build_mlp

    def spy(*args, **kwargs):
        module = real(*args, **kwargs)
        devices.append(next(module.parameters()).device.type)
        return module

    monkeypatch.setattr(models, "build_mlp", spy)
    check_parts(load_spec(write_spec()), world_size=1)
    assert devices == ["meta"]


def test_a_model_factory_is_checked_by_signature_and_type_without_being_called(write_spec, tmp_path: Path) -> None:
    (tmp_path / "huge.py").write_text(
        "def build(width: int = 8):\n    raise SystemExit('the model factory was called')\n"
    )
    path = write_spec()
    text = path.read_text().replace('name = "mlp"\nkwargs = { hidden = [32] }', 'name = "huge:build"')
    path.write_text(text)
    check_parts(load_spec(path), world_size=1)  # right kwargs: nothing raised, nothing called
    path.write_text(text.replace('name = "huge:build"', 'name = "huge:build"\nkwargs = { width = "8" }'))
    issue = _issue(path)
    assert issue.key == "model.kwargs.width" and "expected a whole number" in issue.message


@pytest.mark.parametrize(
    ("value", "annotation", "problem"),
    [
        (1, int, None),
        (True, int, "got true; expected a whole number (a boolean is not a number)"),
        (1, float, None),
        ("1", float, 'got "1"; expected a number (remove the quotes: write 1)'),
        ([1, 2], list[int], None),
        ([1, "a"], list[int], '[1]: got "a"; expected a whole number'),
        (0.5, float | list[float], None),
        ([0.5], float | list[float], None),
        (None, int | None, None),
        ("cos", Literal["cos", "linear"], None),
        ("sin", Literal["cos", "linear"], 'got "sin"; expected "cos" or "linear"'),
        ("x", Path, None),  # what TOML cannot write (a Path, a tuple, a class) is left to the call
        ([3, 3], int | tuple[int, int], None),
        (object(), torch.nn.Module, None),
    ],
)
def test_a_toml_value_against_an_annotation(value, annotation, problem: str | None) -> None:
    assert value_problem(value, annotation) == problem


def test_describe_and_bind() -> None:
    assert value_problem("x", int | None) == 'got "x"; expected a whole number'

    def f(a: int, *, b: str = "x") -> None: ...

    with pytest.raises(
        SpecError, match=r"got 1; expected a string \(quote it: \"1\"\) \(signature: f\(a: int, b: str = 'x'\)\)"
    ):
        check_call(f, (1,), {"b": 1}, "k")
    with pytest.raises(SpecError, match="unexpected keyword argument 'c'"):
        check_call(f, (1,), {"c": 1}, "k")


def test_an_unusable_checkpoint_dir_exits_2_before_the_run(write_spec, tmp_path: Path, capsys) -> None:
    path = write_spec('[checkpoint]\ndir = "/proc/runner-x"\n')
    assert main(["exec", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"{path}:{_line(path, 'dir = ')}: checkpoint.dir: " in err and "/proc" in err and "Traceback" not in err
    assert not (tmp_path / "mlflow.db").exists()


def test_a_file_in_the_way_of_checkpoint_dir_is_named_and_nothing_is_left_behind(write_spec, tmp_path: Path) -> None:
    from runner.launch.prebuild import check_checkpoint_folder
    from runner.plan import make_plan

    (tmp_path / "taken").write_text("a file")
    path = write_spec('[checkpoint]\ndir = "taken/ckpt"\n')
    with pytest.raises(SpecError, match=r"checkpoint.dir: dir = .* is a file, not a folder"):
        check_checkpoint_folder(make_plan(load_spec(path)))
    before = sorted(p.name for p in tmp_path.iterdir())
    check_checkpoint_folder(make_plan(load_spec(path, ('checkpoint.dir="fine/ckpt"',))))
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # the probe folder is gone, nothing was created
    check_checkpoint_folder(make_plan(load_spec(path, ("checkpoint.enabled=false",))))  # no checkpoints: not checked


@pytest.mark.integration  # starts several processes: the driver's training child
@pytest.mark.parametrize(
    ("table", "words"),
    [
        ('[loss]\nname = "cross_entropy"\nkwargs = { label_smoothing = 2.0 }\n', "label_smoothing"),
        ('[loss]\nname = "smooth_l1"\nkwargs = { beta = -1.0 }\n', "beta"),
    ],
    ids=["label_smoothing", "beta"],
)
def test_a_loss_kwarg_torch_checks_only_in_forward_is_found_before_the_run(
    write_spec, tmp_path: Path, capsys, table: str, words: str
) -> None:
    path = write_spec(table)
    assert main(["exec", str(path)]) == 2
    err = capsys.readouterr().err
    line = _line(path, "[loss]") + 2  # the table's kwargs line
    assert f"{path}:{line}: loss.kwargs" in err and words in err and "Traceback" not in err
    assert not (tmp_path / "mlflow.db").exists()  # no run, not even a store


def test_loss_kwargs_a_run_accepts_pass_the_stand_in_batch(write_spec) -> None:
    from runner.training.losses import check_objectives

    for table in (
        '[loss]\nname = "cross_entropy"\nkwargs = { label_smoothing = 0.1, weight = [1.0, 2.0, 1.0, 1.0] }\n',
        '[loss]\nname = "nll"\n',
        '[loss]\nname = "bce_with_logits"\nkwargs = { pos_weight = [2.0, 1.0] }\n',
        '[loss]\nname = "mse"\n',
    ):
        path = write_spec(table)
        check_objectives(load_spec(path).spec, path.parent)  # nothing raised


def test_a_store_folder_that_cannot_be_written_is_named_before_the_checkpoint_folder(
    write_spec, tmp_path: Path, monkeypatch, capsys
) -> None:
    import os
    import tempfile

    import runner.spec.reading
    import runner.tracking.uri

    spec = write_spec()  # the store and the default checkpoints/ both in tmp_path
    real_access, real_mkdtemp = os.access, tempfile.mkdtemp

    def access(path, mode, **kwargs) -> bool:  # a read-only tmp_path, as a user other than root sees it
        return False if Path(path) == tmp_path and mode & os.W_OK else real_access(path, mode, **kwargs)

    def mkdtemp(*args, dir=None, **kwargs) -> str:
        if dir is not None and Path(dir) == tmp_path:
            raise PermissionError(13, "Permission denied")
        return real_mkdtemp(*args, dir=dir, **kwargs)

    monkeypatch.setattr(runner.tracking.uri.os, "access", access)
    monkeypatch.setattr(runner.spec.reading.tempfile, "mkdtemp", mkdtemp)
    assert main(["exec", str(spec)]) == 2
    err = capsys.readouterr().err
    assert f"folder {tmp_path} is not writable (sqlite writes a journal" in err
    assert "set checkpoint.dir" not in err and not (tmp_path / "mlflow.db").exists()


_CNN_BN = ('model.name="cnn"', "model.kwargs={ width = 4, batch_norm = true }", "data.input_shape=[1, 6, 6]")


@pytest.mark.parametrize(
    ("sets", "note"),
    [
        ((*_CNN_BN, 'parallel.mode="ddp"'), "BatchNorm2d without parallel.sync_batchnorm: under ddp each device"),
        ((*_CNN_BN, 'parallel.mode="ddp"', "parallel.sync_batchnorm=true", 'devices.accelerator="auto"'), None),
        ((*_CNN_BN, 'parallel.mode="none"'), None),
        (('parallel.mode="ddp"', "model.kwargs={ hidden = [8], dropout = 0.5 }"), "Dropout: under ddp each rank"),
        (('parallel.mode="ddp"', "model.kwargs={ hidden = [8], dropout = 0.0 }"), None),
    ],
)
def test_known_mode_differences_are_noted_before_training(write_spec, sets, note) -> None:
    from runner.launch.prebuild import known_differences

    loaded = load_spec(write_spec(), sets)
    notes, _ = check_parts(loaded, world_size=2)
    assert notes == known_differences(loaded)
    assert [n for n in notes if note is not None and n.startswith(note)] == notes


def test_plan_prints_the_known_difference(write_spec, capsys) -> None:
    assert main(["plan", str(write_spec()), *[f"--set={s}" for s in (*_CNN_BN, 'parallel.mode="ddp"')]]) == 0
    assert "note           BatchNorm2d without parallel.sync_batchnorm: under ddp" in capsys.readouterr().out

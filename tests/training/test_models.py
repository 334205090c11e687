"""Tests for runner.training.models: torchvision builders, built-ins, factories and spec errors."""

from __future__ import annotations

import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from torch import nn

from runner.errors import SpecError
from runner.spec.schema import ModelSpec
from runner.training.models import build_model, check_model_name

ASSETS = Path(__file__).parents[1] / "assets"


def model(name: str, **kwargs) -> ModelSpec:
    return ModelSpec(name=name, kwargs=kwargs)


def only_issue(err: pytest.ExceptionInfo) -> object:
    assert len(err.value.issues) == 1
    issue = err.value.issues[0]
    assert issue.file is None and issue.line is None
    return issue


def test_torchvision_resnet18_builds_and_runs():
    torch.manual_seed(0)
    net = build_model(model("torchvision.resnet18", num_classes=10), None)
    net.eval()
    with torch.no_grad():
        out = net(torch.randn(2, 3, 32, 32))
    assert out.shape == (2, 10)


def test_torchvision_num_classes_comes_from_the_dataset_when_absent():
    net = build_model(model("torchvision.resnet18"), None, input_shape=(3, 32, 32), num_classes=7)
    assert net.fc.out_features == 7
    net = build_model(model("torchvision.models.resnet18", num_classes=4), None, num_classes=7)
    assert net.fc.out_features == 4  # the user's value wins


def test_mlp_infers_sizes_and_has_no_batch_statistics_layers():
    net = build_model(model("mlp"), None, input_shape=(1, 8, 8), num_classes=10)
    assert net(torch.randn(5, 1, 8, 8)).shape == (5, 10)
    linears = [m for m in net.modules() if isinstance(m, nn.Linear)]
    assert [m.in_features for m in linears] == [64, 128, 64]
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in net.modules())
    custom = build_model(model("mlp", in_features=6, hidden=[4], num_classes=3, dropout=0.5), None)
    assert custom(torch.randn(2, 6)).shape == (2, 3)
    assert any(isinstance(m, nn.Dropout) for m in custom.modules())


def test_mlp_without_in_features_or_dataset_hint_is_a_spec_error():
    with pytest.raises(SpecError) as err:
        build_model(model("mlp"), None)
    assert only_issue(err).key == "model.kwargs"
    assert "in_features" in str(err.value)


def test_cnn_shapes_and_optional_batch_norm():
    net = build_model(model("cnn", width=4), None, input_shape=(3, 16, 16), num_classes=5)
    assert net(torch.randn(2, 3, 16, 16)).shape == (2, 5)
    assert not any(isinstance(m, nn.BatchNorm2d) for m in net.modules())
    bn = build_model(model("cnn", width=4, batch_norm=True, in_channels=1), None)
    assert any(isinstance(m, nn.BatchNorm2d) for m in bn.modules())
    assert bn(torch.randn(2, 1, 8, 8)).shape == (2, 10)


def test_cnn_on_flat_samples_is_a_spec_error():
    with pytest.raises(SpecError) as err:
        build_model(model("cnn"), None, input_shape=(64,), num_classes=10)
    assert only_issue(err).key == "model.name"


@pytest.mark.parametrize("name", ["mlp", "cnn", "torchvision.resnet18"])
def test_models_are_deterministic_given_the_torch_seed(name):
    def params(seed: int) -> list[torch.Tensor]:
        torch.manual_seed(seed)
        return [
            p.detach().clone()
            for p in build_model(model(name), None, input_shape=(3, 8, 8), num_classes=4).parameters()
        ]

    a, b, c = params(1), params(1), params(2)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=False))
    assert not all(torch.equal(x, y) for x, y in zip(a, c, strict=False))


def test_factory_from_the_spec_folder():
    net = build_model(model("factories:build_model", in_features=8, num_classes=3), ASSETS)
    assert net(torch.randn(4, 8)).shape == (4, 3)
    check_model_name("factories:build_model", ASSETS)


def test_factory_errors_name_model_name(tmp_path):
    with pytest.raises(SpecError) as err:
        build_model(model("no_such_module_xyz:build"), tmp_path)
    assert only_issue(err).key == "model.name"
    assert "no_such_module_xyz" in str(err.value) and str(tmp_path) in str(err.value)

    with pytest.raises(SpecError) as err:
        build_model(model("factories:build_modle"), ASSETS)
    assert only_issue(err).key == "model.name"
    assert 'did you mean "build_model"' in str(err.value)

    with pytest.raises(SpecError, match="not a torch.nn.Module"):
        build_model(model("factories:not_a_model"), ASSETS)
    with pytest.raises(SpecError, match="not a callable"):
        check_model_name("factories:NOT_CALLABLE", ASSETS)
    with pytest.raises(SpecError, match="import path"):
        check_model_name("factories:", ASSETS)

    (tmp_path / "broken_factory_mod.py").write_text("raise RuntimeError('boom at import')\n")
    with pytest.raises(SpecError, match="boom at import") as err:
        check_model_name("broken_factory_mod:f", tmp_path)
    assert only_issue(err).key == "model.name"


def test_check_model_name_never_calls_the_factory(tmp_path):
    (tmp_path / "explosive_factory_mod.py").write_text("def make():\n    raise RuntimeError('called')\n")
    check_model_name("explosive_factory_mod:make", tmp_path)
    from runner.errors import UserCodeError

    with pytest.raises(UserCodeError, match="RuntimeError: called"):
        build_model(model("explosive_factory_mod:make"), tmp_path)


@pytest.mark.parametrize(
    ("name", "suggestion"),
    [
        ("mpl", '"mlp"'),
        ("MLP", '"mlp"'),
        ("resnet18", '"torchvision.resnet18"'),
        ("torchvision.resnet19", '"torchvision.resnet18"'),
        ("torchvision.models.resnt50", '"torchvision.resnet50"'),
    ],
)
def test_unknown_names_get_a_did_you_mean(name, suggestion):
    for call in (lambda: check_model_name(name), lambda: build_model(model(name), None)):
        with pytest.raises(SpecError) as err:
            call()
        issue = only_issue(err)
        assert issue.key == "model.name"
        assert suggestion in issue.message and name in issue.message


def test_bad_kwargs_name_model_kwargs_and_the_signature():
    with pytest.raises(SpecError) as err:
        build_model(model("mlp", hiden=[3]), None, input_shape=(4,))
    issue = only_issue(err)
    assert issue.key == "model.kwargs"
    assert "hiden" in issue.message and "signature" in issue.message and "hidden" in issue.message

    with pytest.raises(SpecError) as err:
        build_model(model("torchvision.resnet18", wrong_arg=1), None)
    assert only_issue(err).key == "model.kwargs"
    assert "wrong_arg" in str(err.value)

    with pytest.raises(SpecError) as err:
        build_model(model("mlp", in_features=4, dropout=2.0), None)
    assert only_issue(err).key == "model.kwargs"

    with pytest.raises(SpecError) as err:
        build_model(model("factories:build_model", bogus=1), ASSETS)
    assert only_issue(err).key == "model.kwargs"


def test_check_model_name_for_builtins_does_not_import_torch():
    code = "import sys, runner.training.models as m; m.check_model_name('mlp'); m.check_model_name('cnn'); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


BUGGY = """\
import torch.nn.functional as F
from torch.utils.data import TensorDataset


def build(hidden=4):
    return _make(hidden)


def _make(hidden):
    raise RuntimeError("my own bug")


def dataset():
    return [][1]


def loss(prediction, target):
    return F.cross_entropy(prediction, target[:, 5])
"""


def _line_of(text: str, fragment: str) -> int:
    return next(i for i, line in enumerate(text.splitlines(), 1) if fragment in line)


def test_an_error_in_the_users_code_names_their_file_line_and_the_spec_key(tmp_path):
    import sys

    from runner.errors import UserCodeError, user_code_error
    from runner.spec.loading import spec_from_dict
    from runner.training.batches import BatchIO
    from runner.training.data import build_datasets
    from runner.training.losses import build_loss

    (tmp_path / "buggy_user_mod.py").write_text(BUGGY)
    sys.modules.pop("buggy_user_mod", None)
    path = tmp_path / "buggy_user_mod.py"
    with pytest.raises(UserCodeError) as err:  # a factory that raises: the user's bug, not "rejected the kwargs"
        build_model(model("buggy_user_mod:build", hidden=3), tmp_path)
    text = str(err.value)
    assert text.startswith("model.name: your code raised RuntimeError: my own bug")
    assert f"{path}:{_line_of(BUGGY, 'my own bug')}, in _make" in text and "rejected" not in text
    assert "buggy_user_mod.py:6 in build: return _make(hidden)" in text and "runner/" not in text
    assert err.value.exit_code == 1

    spec = {
        "name": "t",
        "model": {"name": "mlp"},
        "optim": {"lr": 0.1},
        "data": {"dataset": "synthetic", "batch_size": 2},
    }
    data = spec_from_dict({**spec, "data": {"dataset": "buggy_user_mod:dataset", "batch_size": 2}})
    with pytest.raises(UserCodeError, match=r"^data.dataset: your code raised IndexError") as err:
        build_datasets(data, tmp_path)
    assert f"{path}:{_line_of(BUGGY, 'return [][1]')}" in str(err.value)

    io = BatchIO(None, None, model_loss=False)
    fn = build_loss(spec_from_dict({**spec, "loss": {"name": "buggy_user_mod:loss"}}).loss, tmp_path)
    batch = io.prepare(
        (torch.randn(2, 3), torch.zeros(2, 3, dtype=torch.long)), torch.device("cpu"), torch.device("cpu")
    )
    try:
        fn(torch.randn(2, 3), batch, io)
    except IndexError as exc:
        located = user_code_error(exc)
    assert located is not None
    assert str(located).startswith("loss.name: your code raised IndexError")
    assert f"{path}:{_line_of(BUGGY, 'target[:, 5]')}, in loss" in str(located)


@pytest.mark.parametrize(("attr", "says"), [("biuld", 'did you mean "build"?'), ("xyz", "defines ")])
def test_a_missing_factory_names_a_fix(tmp_path: Path, attr: str, says: str) -> None:
    from runner.training.models import resolve_factory

    (tmp_path / "mine_models.py").write_text("def build():\n    return None\n\nWIDTH = 3\n")
    with pytest.raises(SpecError) as info:
        resolve_factory(f"mine_models:{attr}", tmp_path, "model.name")
    text = str(info.value)
    assert f"has no attribute {attr!r}" in text and says in text, text
    if attr == "xyz":
        assert "mine_models.py defines build" in text and "WIDTH" not in text


def test_a_broken_torchvision_is_a_spec_error_with_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    """It passed `runner validate` (which reads a list of names) and crashed `exec` with a 42-line traceback."""
    for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "torchvision", None)  # `import torchvision` now fails, as a broken build does
    with pytest.raises(SpecError) as info:
        build_model(ModelSpec(name="torchvision.resnet18"), None, input_shape=(3, 32, 32), num_classes=10)
    text = str(info.value)
    assert (
        text.startswith("model.name: torchvision cannot be imported (ModuleNotFoundError") and "built for torch" in text
    )


EXITING_FACTORY = """
import os
import sys


def build(how="os"):
    if how == "os":
        os._exit(3)
    sys.exit(3)
"""


def test_a_factory_that_calls_sys_exit_is_named_with_its_line(tmp_path: Path) -> None:
    from runner.errors import UserCodeError

    (tmp_path / "exiting.py").write_text(EXITING_FACTORY)
    with pytest.raises(UserCodeError) as caught:
        build_model(ModelSpec(name="exiting:build", kwargs={"how": "sys"}), tmp_path)
    assert str(caught.value).startswith(
        f"model.name: 'exiting:build' called sys.exit(3) at {tmp_path / 'exiting.py'}:9: "
    )


@pytest.mark.integration  # a process of its own: under the old code os._exit ended it
def test_runner_plan_names_a_factory_that_calls_os_exit_instead_of_exiting_with_its_code(tmp_path: Path) -> None:
    import os

    from tests.helpers import REPO, write_spec_file

    (tmp_path / "exiting.py").write_text(EXITING_FACTORY)
    spec = write_spec_file(tmp_path / "spec.toml", model={"name": "exiting:build", "kwargs": None})
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "-m", "runner", "plan", str(spec)], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr  # it exited 3 and said nothing
    said = f"memory         not estimated: UserCodeError: model.name: 'exiting:build' called os._exit(3) at {tmp_path}"
    assert said in done.stdout and "Traceback" not in done.stderr


def test_model_kwargs_take_what_the_data_knows_and_refuse_what_it_does_not() -> None:
    from torch.utils.data import Subset, TensorDataset

    from runner.training.models import resolve_data_refs

    class Tokens(TensorDataset):
        vocab_size = 18_328

    train = Subset(Tokens(torch.zeros(4, 3)), [0, 1])
    info = types.SimpleNamespace(num_classes=10, input_shape=(1, 28, 28))
    kwargs = {"ntoken": "${data.vocab_size}", "classes": "${data.num_classes}", "shape": "${data.input_shape}"}
    resolved = resolve_data_refs({**kwargs, "hidden": 64, "text": "${not a ref"}, info, train)
    assert resolved == {"ntoken": 18_328, "classes": 10, "shape": [1, 28, 28], "hidden": 64, "text": "${not a ref"}
    with pytest.raises(SpecError) as caught:
        resolve_data_refs({"ntoken": "${data.vocab}"}, info, train)
    assert caught.value.issues[0].key == "model.kwargs.ntoken" and "attributes of Tokens" in str(caught.value)


def test_a_factory_gets_the_datas_facts_and_the_logged_model_is_built_alike(write_spec, tmp_path: Path) -> None:
    from runner.launch.driver import exec_experiment
    from runner.launch.session import ExecOptions
    from runner.spec.loading import load_spec

    (tmp_path / "sized.py").write_text(
        "from torch import nn\n\n\ndef build(width, classes):\n"
        "    assert width == 8 and classes == 3, (width, classes)  # the synthetic data's facts\n"
        "    return nn.Linear(width, classes)\n",
        encoding="utf-8",
    )
    model = 'model={name="sized:build", kwargs={width=8, classes="${data.num_classes}"}}'
    loaded = load_spec(write_spec(), [model, "tracking.log_model=true"])
    result = exec_experiment(loaded, ExecOptions(in_process=True))  # the driver builds the logged model too
    assert result.status == "FINISHED" and 0 <= result.metrics["val/accuracy"] <= 1

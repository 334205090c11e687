"""[optim]: any torch.optim class by name or a factory by import path, and parameter groups matched by name."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from runner.cli import main
from runner.errors import SpecError
from runner.training.losses import build_optimizer
from tests.helpers import refusal, spec_object


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 8)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 2)


def _optim(**optim):
    return spec_object(optim={"lr": 0.1, **optim}).optim


@pytest.mark.parametrize(
    ("name", "cls"),
    [
        ("adadelta", torch.optim.Adadelta),
        ("RMSprop", torch.optim.RMSprop),
        ("NAdam", torch.optim.NAdam),
        ("sgd", torch.optim.SGD),
    ],
)
def test_any_torch_optim_class_is_named_case_insensitively(name: str, cls: type) -> None:
    optimizer = build_optimizer(_optim(name=name, lr=1.0), Net().named_parameters())
    assert type(optimizer) is cls and optimizer.param_groups[0]["lr"] == 1.0


def test_the_mnist_examples_adadelta_takes_no_momentum_and_its_own_defaults() -> None:
    optimizer = build_optimizer(_optim(name="Adadelta", lr=1.0), Net().named_parameters())
    group = optimizer.param_groups[0]
    assert group["rho"] == 0.9 and group["weight_decay"] == 0.0 and "momentum" not in group


def test_a_factory_by_import_path_is_called_with_the_params_and_options(tmp_path: Path) -> None:
    (tmp_path / "my_optim.py").write_text(
        "import torch\n\ndef make(params, lr, weight_decay=0.0, scale=1.0):\n"
        "    return torch.optim.SGD(params, lr=lr * scale, weight_decay=weight_decay)\n"
    )
    optimizer = build_optimizer(_optim(name="my_optim:make", kwargs={"scale": 2.0}), Net().named_parameters(), tmp_path)
    assert isinstance(optimizer, torch.optim.SGD) and optimizer.param_groups[0]["lr"] == 0.2


def test_parameter_groups_take_their_options_by_name_and_the_rest_keep_the_base_ones() -> None:
    model = Net()
    optim = _optim(
        name="adamw",
        weight_decay=0.01,
        groups=[
            {"match": "bias|norm", "weight_decay": 0.0},
            {"match": "^head", "lr": 0.01, "kwargs": {"betas": [0.8, 0.9]}},
        ],
    )
    optimizer = build_optimizer(optim, model.named_parameters())
    rest, no_decay, head = optimizer.param_groups
    assert [id(p) for p in rest["params"]] == [id(model.body.weight)]
    assert rest["weight_decay"] == 0.01 and rest["lr"] == 0.1
    assert {id(p) for p in no_decay["params"]} == {
        id(model.body.bias),
        id(model.norm.weight),
        id(model.norm.bias),
        id(model.head.bias),
    }
    assert no_decay["weight_decay"] == 0.0
    assert [id(p) for p in head["params"]] == [id(model.head.weight)]  # head.bias matched the first group first
    assert head["lr"] == 0.01 and head["betas"] == (0.8, 0.9)


def test_a_group_that_selects_nothing_is_a_spec_error_naming_its_key() -> None:
    with pytest.raises(SpecError) as caught:
        build_optimizer(_optim(groups=[{"match": "backbone"}]), Net().named_parameters())
    issue = caught.value.issues[0]
    assert issue.key == "optim.groups[0].match" and "'backbone' selects no parameter" in issue.message
    assert "body.weight" in issue.message


def test_an_unknown_optimizer_names_the_close_ones() -> None:
    with pytest.raises(SpecError) as caught:
        build_optimizer(_optim(name="adadeltaa"), Net().named_parameters())
    issue = caught.value.issues[0]
    assert issue.key == "optim.name" and "'adadeltaa' is no optimizer class of torch.optim" in issue.message
    assert '"Adadelta"' in issue.message


@pytest.mark.parametrize(
    ("optim", "key", "says"),
    [
        ('name = "lbfgs"\nlr = 1.0', "optim.name", "needs a closure that evaluates the loss again in every step"),
        ('name = "adam"\nlr = 0.1\nmomentum = 0.9', "optim", "momentum applies to sgd and rmsprop only, not 'adam'"),
        (
            'name = "sgd"\nlr = 0.1\n[[optim.groups]]\nmatch = "(bias"',
            "optim.groups[0]",
            "match '(bias' is no regular expression",
        ),
        (
            'name = "sgd"\nlr = 0.1\n[[optim.groups]]\nmatch = "bias"\nkwargs = { lr = 0.5 }',
            "optim.groups[0]",
            "kwargs repeats lr",
        ),
        ('name = "not a name"\nlr = 0.1', "optim.name", "is no class name of torch.optim"),
    ],
)
def test_bad_optimizer_keys_are_refused_at_their_line_before_torch(
    tmp_path: Path, optim: str, key: str, says: str
) -> None:
    path = tmp_path / "s.toml"
    text = refusal(path, "optim", optim, optim=None)
    assert f"{path}:" in text and f"{key}" in text and says in text, text


def test_exec_with_an_unknown_optimizer_exits_2_before_any_run(write_spec, store: str, capsys) -> None:
    from mlflow.tracking import MlflowClient

    spec = write_spec()
    assert main(["exec", str(spec), "--set", 'optim.name="Adadeltaa"']) == 2
    err = capsys.readouterr().err
    assert "optim.name: 'Adadeltaa' is no optimizer class of torch.optim" in err and "Traceback" not in err
    assert MlflowClient(store).search_experiments() == [] or not MlflowClient(store).search_runs(
        [e.experiment_id for e in MlflowClient(store).search_experiments()]
    )

"""[scheduler]: any torch.optim.lr_scheduler class by name or a factory by import path, and a linear warm-up."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from runner.errors import SpecError
from runner.training.losses import build_scheduler, scheduler_interval
from tests.helpers import refusal, spec_object


def _optimizer(lr: float = 1.0) -> torch.optim.Optimizer:
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)


def _scheduler(**scheduler):
    return spec_object(scheduler=scheduler).scheduler


def _lrs(scheduler, optimizer, calls: int) -> list[float]:
    seen = []
    for _ in range(calls):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return seen


@pytest.mark.parametrize("name", ["StepLR", "steplr", "step"])
def test_the_mnist_examples_steplr_is_named_as_torch_names_it(name: str) -> None:
    optimizer = _optimizer()
    scheduler = build_scheduler(_scheduler(name=name, kwargs={"step_size": 1, "gamma": 0.7}), optimizer, 10, 3)
    assert isinstance(scheduler, torch.optim.lr_scheduler.StepLR)
    assert _lrs(scheduler, optimizer, 3) == pytest.approx([1.0, 0.7, 0.49])


def test_any_class_of_lr_scheduler_builds_and_cosine_takes_the_runs_length() -> None:
    optimizer = _optimizer()
    polynomial = build_scheduler(_scheduler(name="PolynomialLR", kwargs={"total_iters": 4}), optimizer, 10, 4)
    assert isinstance(polynomial, torch.optim.lr_scheduler.PolynomialLR)
    cosine = build_scheduler(_scheduler(name="CosineAnnealingLR", interval="step"), _optimizer(), 10, 2)
    assert isinstance(cosine, torch.optim.lr_scheduler.CosineAnnealingLR) and cosine.T_max == 10
    assert scheduler_interval(_scheduler(name="OneCycleLR")) == "step"


def test_a_warm_up_ramps_linearly_to_the_lr_then_the_schedule_runs_its_full_length() -> None:
    optimizer = _optimizer(lr=1.0)
    spec = _scheduler(name="cosine", interval="step", warmup_steps=3)
    scheduler = build_scheduler(spec, optimizer, 13, 1)
    assert isinstance(scheduler, torch.optim.lr_scheduler.SequentialLR)
    lrs = _lrs(scheduler, optimizer, 13)
    assert lrs[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])  # lr / (warmup + 1) on, then the schedule's start
    assert lrs[4] < 1.0 and lrs[-1] == pytest.approx(0.5 * (1 + torch.cos(torch.tensor(9 / 10 * torch.pi)).item()))


def test_a_factory_by_import_path_gets_the_optimizer_and_kwargs(tmp_path: Path) -> None:
    (tmp_path / "my_schedule.py").write_text(
        "import torch\n\ndef halve_every(optimizer, n):\n"
        "    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=n, gamma=0.5)\n"
    )
    optimizer = _optimizer()
    scheduler = build_scheduler(_scheduler(name="my_schedule:halve_every", kwargs={"n": 2}), optimizer, 6, 6, tmp_path)
    assert _lrs(scheduler, optimizer, 5) == pytest.approx([1.0, 1.0, 0.5, 0.5, 0.25])


def test_an_unknown_scheduler_names_the_close_ones() -> None:
    with pytest.raises(SpecError) as caught:
        build_scheduler(_scheduler(name="StepLRR"), _optimizer(), 10, 3)
    issue = caught.value.issues[0]
    assert issue.key == "scheduler.name" and "'StepLRR' is no scheduler class" in issue.message
    assert '"StepLR"' in issue.message


@pytest.mark.parametrize(
    ("scheduler", "says"),
    [
        ('name = "ReduceLROnPlateau"', "monitor is missing: ReduceLROnPlateau steps on a metric, e.g. monitor"),
        ('name = "StepLR"\nmonitor = "val/loss"', "monitor is read by ReduceLROnPlateau only; StepLR ignores"),
        (
            'name = "ReduceLROnPlateau"\nmonitor = "val/loss"\ninterval = "step"',
            'ReduceLROnPlateau steps after each evaluation: keep interval = "epoch"',
        ),
        ('name = "ReduceLROnPlateau"\nmonitor = "val/los"', '"val/los" is not logged at the end of an epoch'),
        ('name = "LambdaLR"', "cannot be built from a spec: it takes a Python function"),
        ('name = "cosine"\nwarmup_steps = 5', 'warmup_steps = 5 counts optimizer steps: set interval = "step"'),
        ('name = "not a name"', "is no class name of torch.optim.lr_scheduler"),
    ],
)
def test_bad_scheduler_keys_are_refused_at_their_line_before_torch(tmp_path: Path, scheduler: str, says: str) -> None:
    path = tmp_path / "s.toml"
    text = refusal(path, "scheduler", scheduler)
    assert f"{path}:" in text and "scheduler" in text and says in text, text

"""The progress display: samples/s, a visible validation phase, plain lines off a terminal, silence off rank 0."""

from __future__ import annotations

import io
import re
import time
import types

import pytest
import torch
from torch import nn

from runner.devices.inventory import Inventory
from runner.devices.resolve import resolve_devices
from runner.spec.schema import ExperimentSpec
from runner.strategies.base import Precision, SingleDevice
from runner.tracking.trackers import NullTracker
from runner.training import sums as progress_module
from runner.training.data import build_datasets
from runner.training.loop import LoopParts, fit
from runner.training.losses import build_loss
from runner.training.metrics import build_metric_plan
from runner.training.sampling import build_loaders
from runner.training.setup import count_total_steps
from runner.training.sums import Progress

SPEC = {
    "name": "progress",
    "model": {"name": "mlp"},
    "data": {"dataset": "synthetic", "num_samples": 64, "input_shape": [4], "num_classes": 2, "batch_size": 16},
    "devices": {"accelerator": "cpu"},
    "optim": {"lr": 0.1},
    "train": {"epochs": 2, "progress": "bar"},
}


class Screen(io.StringIO):
    """What a terminal shows: carriage returns rewrite the line (tqdm redraws its bar so)."""

    def isatty(self) -> bool:
        return True

    def frames(self) -> list[str]:
        return [f for f in re.split(r"[\r\n]", self.getvalue()) if f.strip()]


def on_screen(monkeypatch: pytest.MonkeyPatch) -> Screen:
    """Point standard error at a terminal screen (inside the test: pytest's capture resets it between phases)."""
    out = Screen()
    monkeypatch.setattr(progress_module.sys, "stderr", out)
    return out


def test_samples_per_s_counts_training_time_only(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = iter([0.0, 2.0, 3.0, 4.0])  # start, phase start, phase end, read
    monkeypatch.setattr(progress_module.time, "perf_counter", lambda: next(clock))
    shown = Progress("off", 10)
    shown.update(1, samples=64)
    with shown.phase("validating"):
        pass
    assert shown.samples_per_s == pytest.approx(64 / 3.0)  # 4 s, of which 1 s validating


def test_samples_per_s_is_the_epochs_rate(monkeypatch: pytest.MonkeyPatch) -> None:
    """One definition for the progress line and metric ``samples_per_s``: this epoch's samples over its seconds."""
    clock = iter([0.0, 10.0, 12.0, 12.0])  # start, epoch 2 starts, read epoch_seconds, read the rate
    monkeypatch.setattr(progress_module.time, "perf_counter", lambda: next(clock))
    shown = Progress("off", 10)
    shown.update(5, samples=1000)  # epoch 1, at whatever rate
    shown.start_epoch()
    shown.update(1, samples=64)
    assert shown.epoch_seconds == 2.0 and shown.samples_per_s == pytest.approx(32.0)


def test_bar_shows_samples_per_s_and_the_validation_phase(monkeypatch: pytest.MonkeyPatch) -> None:
    screen = on_screen(monkeypatch)
    bar = Progress("bar", 4)
    bar.update(1, samples=32)
    bar.show(epoch=0, loss=0.5)
    bar.update(1, samples=32)
    with bar.phase("validating"):
        during = screen.frames()[-1]
    after = screen.frames()[-1]
    bar.close()
    assert during.startswith("validating") and "2/4" in during
    assert re.search(r"samples/s=[0-9.e+]+", during) and "loss=0.5" in during
    assert after.startswith("train")


def test_lines_off_a_terminal_name_the_phase_and_the_rate(capsys) -> None:
    lines = Progress("lines", 2, every_s=0.0)
    lines.update(1, samples=16)
    time.sleep(0.001)
    lines.show(loss=1.25)
    with lines.phase("validating"):
        pass
    err = capsys.readouterr().err.splitlines()
    assert re.fullmatch(r"step 1/2 loss=1\.25 samples/s=[0-9.e+]+", err[0]), err
    assert err[1] == "step 1/2 validating"


def test_a_log_steps_values_shown_a_step_later_are_labelled_with_their_own_step(capsys) -> None:
    # under ddp step 45's loss is reduced while step 46 trains: it was printed as "step 46/..."
    lines = Progress("lines", 50, every_s=0.0, initial=44)
    lines.update(1, samples=16)
    lines.update(1, samples=16)
    lines.show(45, loss=0.5)
    assert capsys.readouterr().err.startswith("step 45/50 loss=0.5 ")


def test_the_first_line_shows_at_once_on_a_machine_just_booted_and_the_next_waits(capsys, monkeypatch) -> None:
    clock = iter([1.0, 2.0, 12.5])  # monotonic seconds since boot: the machine came up a second ago
    fake = types.SimpleNamespace(monotonic=lambda: next(clock), perf_counter=time.perf_counter)
    monkeypatch.setattr(progress_module, "time", fake)
    lines = Progress("lines", 10, every_s=10.0)
    for step in (1, 2, 3):
        lines.update(1, samples=16)
        lines.show(n=step)
    err = capsys.readouterr().err.splitlines()
    assert [line.split(" samples/s")[0] for line in err] == ["step 1/10 n=1", "step 3/10 n=3"]


def test_other_ranks_and_off_print_nothing(capsys) -> None:
    for quiet in (Progress("bar", 3, enabled=False), Progress("off", 3)):
        quiet.update(1, samples=8)
        quiet.show(loss=1.0)
        with quiet.phase("validating"):
            pass
        quiet.close()
    assert capsys.readouterr().err == ""


def _fitted(spec: ExperimentSpec) -> LoopParts:
    """``fit`` a linear model on ``spec``'s synthetic data, on the CPU; its parts."""
    strategy = SingleDevice(resolve_devices(spec, {}, Inventory([], False)))
    bundle = build_datasets(spec, None)
    loaders = build_loaders(spec, bundle, 0, 1)
    model = nn.Linear(4, 2)
    parts = LoopParts(
        model=model,
        raw_model=model,
        train_set=bundle.train,
        strategy=strategy,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        scheduler=None,
        scheduler_interval="epoch",
        loss=build_loss(spec.loss, None),
        metrics=build_metric_plan(spec, bundle.info, None),
        loaders=loaders,
        tracker=NullTracker(),
        total_steps=count_total_steps(loaders.steps_per_epoch, spec.train),
        precision=Precision("no", strategy.device),
    )
    fit(parts, spec.train)
    return parts


def test_fit_shows_its_samples_per_s_and_each_evaluation(monkeypatch: pytest.MonkeyPatch) -> None:
    screen = on_screen(monkeypatch)
    phases: list[str] = []
    real_phase = Progress.phase

    def spy(self: Progress, name: str):
        phases.append(f"{name}@{self.done}")
        return real_phase(self, name)

    monkeypatch.setattr(Progress, "phase", spy)
    spec = ExperimentSpec.model_validate(SPEC)
    parts = _fitted(spec)
    per_epoch = parts.loaders.steps_per_epoch
    assert phases == [f"validating@{per_epoch * (e + 1)}" for e in range(spec.train.epochs)]
    frames = screen.frames()
    assert any(f.startswith("validating") for f in frames)
    assert any("samples/s=" in f for f in frames if f.startswith("train"))


def test_the_last_progress_line_shows_the_last_epoch_not_one_past_it(capsys) -> None:
    train = {"epochs": 2, "progress": "lines", "log_every_n_steps": 3}  # 8 steps: step 8 is logged after the loop
    spec = ExperimentSpec.model_validate({**SPEC, "train": train})
    _fitted(spec)
    lines = capsys.readouterr().err.splitlines()
    shown = [int(m) for line in lines for m in re.findall(r"epoch=(\d+)", line)]
    assert lines[-1].startswith("step 8/8 epoch=1 loss="), lines
    assert max(shown) == 1, lines

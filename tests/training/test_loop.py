"""The training loop as a maintainer learns it: ``fit`` on one device, with a tracker that records every call.

Data: 96 synthetic samples, a quarter held out, so 72 training samples in global batches
of 16: five optimizer steps per epoch (16, 16, 16, 16, 8), fifteen in three epochs.
"""

from __future__ import annotations

import copy
import math
import socket
from collections.abc import Callable, Mapping
from typing import Any

import pytest
import torch
from torch import nn

from runner.devices.environment import LauncherEnvironment
from runner.devices.inventory import Inventory
from runner.devices.resolve import resolve_devices
from runner.errors import Interrupted, TrainingError
from runner.spec.names import MetricsSpec
from runner.spec.schema import ExperimentSpec
from runner.strategies.base import Precision, SingleDevice, Strategy
from runner.strategies.distributed import DDPStrategy
from runner.training.data import build_datasets
from runner.training.loop import LoopParts, TrainState, fit
from runner.training.losses import build_loss
from runner.training.metrics import build_metric_plan
from runner.training.sampling import build_loaders
from runner.training.setup import count_total_steps
from tests.helpers import MINIMAL, spec_object

STEPS_PER_EPOCH = 5
EPOCHS = 3
TIMING = ("epoch_time_s", "samples_per_s")


class RecordingTracker:
    """A ``Tracker`` that keeps every ``log_metrics`` call as ``(step, metrics)``."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, dict[str, float]]] = []

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        self.calls.append((step, dict(metrics)))

    def log_artifact(self, path: Any, artifact_path: str | None = None) -> None:
        raise AssertionError("the loop logs no artifacts")

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        raise AssertionError("the loop sets no tags")

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass

    def send(self, message: Any) -> None:
        raise AssertionError("the loop sends the driver nothing")

    def recorded(self) -> int:
        return 0  # numbers no values: a checkpoint records 0

    def steps_of(self, key: str) -> list[int]:
        return [step for step, metrics in self.calls if key in metrics]

    def values_of(self, key: str) -> list[float]:
        return [metrics[key] for _, metrics in self.calls if key in metrics]


def make_spec(**train: Any) -> ExperimentSpec:
    """``helpers.MINIMAL`` without tracking, logging every 2 steps, a checkpoint every 4; ``train`` changes [train]."""
    return spec_object(
        MINIMAL,
        name="loop",
        model={"kwargs": None},
        optim={"name": None},
        train={"epochs": EPOCHS, "log_every_n_steps": 2, **train},
        checkpoint={"every_n_steps": 4},
        tracking=None,
    )


def make_parts(
    spec: ExperimentSpec,
    tracker: RecordingTracker,
    *,
    strategy: Strategy | None = None,
    on_checkpoint: Callable[[TrainState, str], None] | None = None,
) -> LoopParts:
    """Everything ``fit`` needs, built by hand: the loop builds nothing itself."""
    strategy = strategy or SingleDevice(resolve_devices(spec, {}, Inventory([], False)))
    bundle = build_datasets(spec, None)
    loaders = build_loaders(spec, bundle, strategy.rank, strategy.world_size)
    torch.manual_seed(spec.seed)
    model = strategy.wrap(nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 3)))
    return LoopParts(
        model=model,
        raw_model=model,
        train_set=bundle.train,
        strategy=strategy,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        scheduler=None,
        scheduler_interval="epoch",
        loss=build_loss(spec.loss, None),  # summed: the loop divides by the global batch
        metrics=build_metric_plan(spec, bundle.info, None),  # without [metrics]: accuracy
        loaders=loaders,
        tracker=tracker,
        total_steps=count_total_steps(loaders.steps_per_epoch, spec.train),  # computed once, by the setup
        precision=Precision(spec.train.amp, strategy.device),
        on_checkpoint=on_checkpoint,
    )


def request_stop_in_step(parts: LoopParts, step: int) -> LoopParts:
    """Raise the stop flag during optimizer step ``step`` (as a signal arriving then would)."""
    taken = [0]

    def count(*_: Any) -> None:
        taken[0] += 1

    parts.optimizer.register_step_post_hook(count)
    parts.should_stop = lambda: taken[0] >= step
    return parts


class Saves:
    """Records what ``on_checkpoint`` is called with: ``(global_step, epoch, batch_in_epoch, reason)``."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int, int, str]] = []
        self.states: list[TrainState] = []

    def __call__(self, state: TrainState, reason: str) -> None:
        self.calls.append((state.global_step, state.epoch, state.batch_in_epoch, reason))
        self.states.append(copy.deepcopy(state))


def without_timing(history: list[tuple[int, dict[str, float]]]) -> list[tuple[int, dict[str, float]]]:
    return [(step, {k: v for k, v in m.items() if k not in TIMING}) for step, m in history]


def test_fit_logs_step_and_epoch_metrics_and_the_loss_falls() -> None:
    spec = make_spec()
    tracker, state = RecordingTracker(), TrainState()
    result = fit(make_parts(spec, tracker), spec.train, state)

    # train/loss, lr and train/step_accuracy every log_every_n_steps = 2 optimizer steps and at the last...
    assert tracker.steps_of("train/loss") == [2, 4, 6, 8, 10, 12, 14, 15]
    # ...and the epoch metrics, with evaluation, at the last step of every epoch.
    assert tracker.steps_of("train/epoch_loss") == [5, 10, 15]
    names = {frozenset(metrics) for _, metrics in tracker.calls}
    assert names == {
        frozenset({"train/loss", "lr", "train/step_accuracy"}),
        frozenset({"train/epoch_loss", "train/accuracy", "epoch", *TIMING, "val/loss", "val/accuracy"}),
    }
    assert tracker.values_of("epoch") == [0.0, 1.0, 2.0]
    assert tracker.values_of("lr") == [0.1] * 8
    assert all(v > 0 for v in tracker.values_of("samples_per_s"))
    assert all(0.0 <= v <= 1.0 for v in tracker.values_of("val/accuracy"))

    losses, epoch_losses = tracker.values_of("train/loss"), tracker.values_of("train/epoch_loss")
    assert losses[-1] < losses[0]
    assert epoch_losses[-1] < epoch_losses[0]
    assert tracker.values_of("val/loss")[-1] < tracker.values_of("val/loss")[0]

    # The result holds what was logged, the final state and one time per optimizer step.
    assert result.history == tracker.calls
    assert result.metrics["val/loss"] == tracker.values_of("val/loss")[-1]
    assert (state.epoch, state.global_step, state.batch_in_epoch, result.global_step) == (EPOCHS, 15, 0, 15)
    assert len(result.step_times_s) == len(result.data_wait_s) == 15
    assert all(0.0 <= wait <= step for wait, step in zip(result.data_wait_s, result.step_times_s, strict=True))


def test_max_steps_ends_mid_epoch_and_still_evaluates() -> None:
    spec = make_spec(max_steps=7)
    tracker, state = RecordingTracker(), TrainState()
    result = fit(make_parts(spec, tracker), spec.train, state)
    assert tracker.steps_of("train/loss") == [2, 4, 6, 7]
    assert tracker.steps_of("train/epoch_loss") == [5, 7] and tracker.steps_of("val/loss") == [5, 7]
    assert (state.epoch, state.global_step, state.batch_in_epoch, result.global_step) == (1, 7, 2, 7)


def test_a_run_shorter_than_log_every_n_steps_logs_train_loss_and_lr_at_its_last_step() -> None:
    """3 steps with ``log_every_n_steps = 5`` used to log no ``train/loss`` at all."""
    spec = make_spec(max_steps=3, log_every_n_steps=5)
    tracker = RecordingTracker()
    fit(make_parts(spec, tracker), spec.train)
    assert tracker.steps_of("train/loss") == tracker.steps_of("lr") == [3]
    assert math.isfinite(tracker.values_of("train/loss")[0]) and tracker.values_of("lr") == [0.1]


def test_a_last_step_already_logged_is_not_logged_twice() -> None:
    spec = make_spec(max_steps=4)
    tracker = RecordingTracker()
    fit(make_parts(spec, tracker), spec.train)
    assert tracker.steps_of("train/loss") == [2, 4]


def test_checkpoints_at_step_and_epoch_boundaries_carry_the_running_sums() -> None:
    spec = make_spec()
    saves = Saves()
    fit(make_parts(spec, RecordingTracker(), on_checkpoint=saves), spec.train, checkpoint_spec=spec.checkpoint)
    assert saves.calls == [
        (4, 0, 4, "step"),
        (5, 1, 0, "epoch"),
        (8, 1, 3, "step"),
        (10, 2, 0, "epoch"),
        (12, 2, 2, "step"),
        (15, 3, 0, "epoch"),
    ]
    step_4, epoch_1 = saves.states[0], saves.states[1]
    assert step_4.epoch_sums is not None and step_4.epoch_sums[2] == 4 * 16  # samples of the epoch so far
    assert epoch_1.epoch_sums is None  # between epochs there is no epoch in progress
    assert step_4.window_sums is not None and step_4.window_sums[2] == 0  # train/loss was just logged at step 4
    assert epoch_1.window_sums is not None and epoch_1.window_sums[2] == 8  # step 5 (8 samples) since then


def test_a_stop_request_on_one_device_stops_after_that_step() -> None:
    spec = make_spec()
    tracker, saves = RecordingTracker(), Saves()
    parts = request_stop_in_step(make_parts(spec, tracker, on_checkpoint=saves), 3)
    with pytest.raises(Interrupted):
        fit(parts, spec.train)
    assert saves.calls == [(3, 0, 3, "signal")]  # checkpoint first, then Interrupted
    assert tracker.steps_of("train/loss") == [2]


def stop_and_save(spec: ExperimentSpec, step: int) -> tuple[RecordingTracker, dict[str, Any]]:
    """``fit`` stopped by a request in ``step``: what it logged, and copies of the state, model and optimizer it saved."""
    saved: dict[str, Any] = {}
    before = RecordingTracker()
    parts = request_stop_in_step(make_parts(spec, before), step)

    def on_checkpoint(state: TrainState, reason: str) -> None:
        saved.update(state=copy.deepcopy(state), model=copy.deepcopy(parts.model.state_dict()))
        saved["optimizer"] = copy.deepcopy(parts.optimizer.state_dict())

    parts.on_checkpoint = on_checkpoint
    with pytest.raises(Interrupted):
        fit(parts, spec.train)
    return before, saved


def resume_saved(spec: ExperimentSpec, saved: dict[str, Any]) -> RecordingTracker:
    """``fit`` on new parts restored from ``saved`` (see ``stop_and_save``); returns what it logged."""
    after = RecordingTracker()
    resumed = make_parts(spec, after)
    resumed.model.load_state_dict(saved["model"])
    resumed.optimizer.load_state_dict(saved["optimizer"])
    fit(resumed, spec.train, state=saved["state"])
    return after


def test_an_interrupted_fit_resumed_from_its_checkpoint_logs_what_an_uninterrupted_one_does() -> None:
    spec = make_spec()
    full = RecordingTracker()
    fit(make_parts(spec, full), spec.train)

    before, saved = stop_and_save(spec, 7)
    assert saved["state"].global_step == 7 and saved["state"].epoch_sums is not None
    after = resume_saved(spec, saved)
    assert without_timing(before.calls + after.calls) == without_timing(full.calls)


@pytest.fixture
def ddp_one(monkeypatch: pytest.MonkeyPatch) -> Any:
    """A set-up DDP strategy in a one-process gloo group (the stop decision of ddp, settled at log steps)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}
    for key, value in {**env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(key, value)
    spec = make_spec()
    spec = spec.model_copy(update={"parallel": spec.parallel.model_copy(update={"mode": "ddp", "timeout_s": 60.0})})
    strategy = DDPStrategy(resolve_devices(spec, {}, Inventory([], False)), spec.parallel, LauncherEnvironment.detect())
    strategy.setup()
    yield strategy
    strategy.teardown()


def test_under_ddp_a_stop_request_takes_effect_at_the_next_log_step(ddp_one: DDPStrategy) -> None:
    spec = make_spec()
    tracker, saves = RecordingTracker(), Saves()
    parts = request_stop_in_step(make_parts(spec, tracker, strategy=ddp_one, on_checkpoint=saves), 3)
    with pytest.raises(Interrupted):
        fit(parts, spec.train)
    assert saves.calls == [(4, 0, 4, "signal")]
    assert tracker.steps_of("train/loss") == [2, 4]


def test_under_ddp_a_stop_request_in_an_epochs_last_step_stops_before_its_evaluation(ddp_one: DDPStrategy) -> None:
    spec = make_spec()
    tracker, saves = RecordingTracker(), Saves()
    parts = request_stop_in_step(make_parts(spec, tracker, strategy=ddp_one, on_checkpoint=saves), STEPS_PER_EPOCH)
    with pytest.raises(Interrupted):
        fit(parts, spec.train)
    assert saves.calls == [(5, 0, 5, "signal")]  # settled at the end of the epoch's steps
    assert tracker.steps_of("train/epoch_loss") == []


# --------------------------------------------------------------------------- [metrics] and train.on_nonfinite


def test_train_metrics_resumed_mid_epoch_log_what_an_uninterrupted_fit_does() -> None:
    """Train metric states go into the checkpoint's state, so a resumed epoch's train/<metric> covers all of it."""
    spec = make_spec().model_copy(
        update={"metrics": MetricsSpec(train=["accuracy", "f1", "auroc"], val=["accuracy", "f1"])}
    )
    full = RecordingTracker()
    fit(make_parts(spec, full), spec.train)
    assert {"train/f1", "train/auroc", "train/step_auroc", "val/f1"} <= {k for _, m in full.calls for k in m}

    before, saved = stop_and_save(spec, 7)
    assert set(saved["state"].metric_states["epoch"]) == {"accuracy", "f1", "auroc"}
    after = resume_saved(spec, saved)
    assert without_timing(before.calls + after.calls) == without_timing(full.calls)


def test_the_counted_default_train_accuracy_equals_torchmetrics_accuracy() -> None:
    spec = make_spec()
    counted, measured = RecordingTracker(), RecordingTracker()
    fit(make_parts(spec, counted), spec.train)
    with_table = spec.model_copy(update={"metrics": MetricsSpec(train=["accuracy"], val=["accuracy"])})
    fit(make_parts(with_table, measured), with_table.train)
    for key in ("train/accuracy", "train/step_accuracy", "val/accuracy"):
        assert counted.steps_of(key) == measured.steps_of(key) and counted.steps_of(key)
        assert counted.values_of(key) == pytest.approx(measured.values_of(key), abs=1e-6), key


def poison_forward(parts: LoopParts, at_call: int) -> LoopParts:
    """Make the model's training forward pass return NaN from its ``at_call``-th call on (a diverging run)."""
    calls = [0]

    def hook(module: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
        if module.training:
            calls[0] += 1
            if calls[0] >= at_call:
                return out * float("nan")
        return out

    parts.model.register_forward_hook(hook)
    return parts


def test_a_non_finite_loss_stops_the_fit_naming_the_step_and_saves_nothing_after_it() -> None:
    spec = make_spec()
    saves, tracker = Saves(), RecordingTracker()
    parts = poison_forward(make_parts(spec, tracker, on_checkpoint=saves), at_call=3)
    with pytest.raises(TrainingError, match=r'on_nonfinite = "stop": the loss was not finite at step 3 .*optim.lr'):
        fit(parts, spec.train, checkpoint_spec=spec.checkpoint)
    assert saves.calls == []  # the first checkpoint (step 4) would hold NaN weights: never written
    assert tracker.steps_of("train/loss") == [2]  # the log of step 4 found the flag: nothing non-finite logged


def test_warn_goes_on_logging_but_never_checkpoints_non_finite_weights(capsys) -> None:
    spec = make_spec(on_nonfinite="warn")
    saves, tracker = Saves(), RecordingTracker()
    parts = poison_forward(make_parts(spec, tracker, on_checkpoint=saves), at_call=6)  # step 6, in epoch 1
    result = fit(parts, spec.train, checkpoint_spec=spec.checkpoint)
    assert result.global_step == 15
    assert [c[0] for c in saves.calls] == [4, 5]  # steps 8, 10, 12, 15 hold NaN weights: not written
    assert math.isnan(tracker.values_of("train/loss")[-1])
    err = capsys.readouterr().err
    assert err.count("the loss was not finite at step 6") == 1 and "no checkpoint at step 8" in err


def test_ignore_checks_nothing() -> None:
    spec = make_spec(on_nonfinite="ignore")
    saves = Saves()
    fit(
        poison_forward(make_parts(spec, RecordingTracker(), on_checkpoint=saves), 6),
        spec.train,
        checkpoint_spec=spec.checkpoint,
    )
    assert [c[0] for c in saves.calls] == [4, 5, 8, 10, 12, 15]


# --------------------------------------------------------------------------- steady state


def test_between_log_steps_a_step_makes_no_collective_and_reads_nothing_back(
    ddp_one: DDPStrategy, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every torch.distributed call and every host read of a tensor, by optimizer step, over a whole ddp fit."""
    import torch.distributed as dist

    spec = make_spec(log_every_n_steps=3)  # 5 steps per epoch, 15 in all; a checkpoint every 4
    parts = make_parts(spec, RecordingTracker(), strategy=ddp_one, on_checkpoint=Saves())
    step = [0]

    def count(*_: Any) -> None:
        step[0] += 1

    parts.optimizer.register_step_post_hook(count)
    calls: list[tuple[int, str]] = []
    for name in ("all_reduce", "all_gather_object", "broadcast_object_list", "barrier", "all_gather"):
        real = getattr(dist, name)

        def recording(*args: Any, _real: Any = real, _name: str = name, **kwargs: Any) -> Any:
            calls.append((step[0], _name))
            return _real(*args, **kwargs)

        monkeypatch.setattr(dist, name, recording)
    reads: list[int] = []
    for name in ("item", "tolist", "__float__", "__bool__"):  # host reads of a tensor (a sync on a GPU)
        real = getattr(torch.Tensor, name)

        def read(self: torch.Tensor, *args: Any, _real: Any = real) -> Any:
            reads.append(step[0])
            return _real(self, *args)

        monkeypatch.setattr(torch.Tensor, name, read)

    fit(parts, spec.train, checkpoint_spec=spec.checkpoint)
    due = {s for s in range(1, 16) if s % 3 == 0 or s % 4 == 0 or s % STEPS_PER_EPOCH == 0}
    assert {s for s, _ in calls} == due, calls  # collectives only at a log step, a checkpoint or an epoch's end
    assert set(reads) <= due | {0}, sorted(set(reads) - due)
    log_only = [3, 6, 9]  # neither a checkpoint nor an epoch's end: the stop requests ride in the sums' reduction
    assert [[name for s, name in calls if s == step] for step in log_only] == [["all_reduce"]] * 3, calls


def test_the_first_step_logs_the_time_since_the_command_started_once_and_only_when_asked() -> None:
    import time

    spec = make_spec()
    tracker = RecordingTracker()
    parts = make_parts(spec, tracker)
    parts.started_at = time.time() - 100.0  # the command started 100 s ago
    result = fit(parts, spec.train, checkpoint_spec=None)
    assert tracker.steps_of("time_to_first_step_s") == [1]
    (logged,) = tracker.values_of("time_to_first_step_s")
    assert result.startup_s == logged and 100.0 <= logged < 100.0 + 600.0
    assert all("time_to_first_step_s" not in m for _, m in result.history)  # a timing, kept out of the history

    resumed = RecordingTracker()
    again = make_parts(spec, resumed)
    again.started_at = time.time()
    fit(again, spec.train, TrainState(epoch=1, global_step=STEPS_PER_EPOCH))
    assert resumed.steps_of("time_to_first_step_s") == [STEPS_PER_EPOCH + 1]  # the first step this process takes

    untimed = RecordingTracker()
    assert fit(make_parts(spec, untimed), spec.train, checkpoint_spec=None).startup_s is None
    assert untimed.steps_of("time_to_first_step_s") == []

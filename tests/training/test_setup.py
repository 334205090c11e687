"""The named setup steps of one rank: build the parts, make the checkpointer, restore, finish."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from runner.devices.inventory import Inventory
from runner.devices.resolve import resolve_devices
from runner.spec.loading import load_spec
from runner.strategies.base import SingleDevice
from runner.training import WorkerResult
from runner.training.checkpoint import list_checkpoints, read_checkpoint
from runner.training.loop import TrainState
from runner.training.setup import (
    Checkpointer,
    build_parts,
    count_total_steps,
    describe_settings,
    finish,
    restore,
)

REPO = Path(__file__).parents[2]


class FlushCounter:
    """A tracker that counts flushes (the checkpointer flushes after every save)."""

    def __init__(self) -> None:
        self.flushes = 0

    def log_metrics(self, metrics: object, step: int) -> None: ...
    def log_artifact(self, path: object, artifact_path: str | None = None) -> None: ...
    def set_tags(self, tags: object) -> None: ...
    def close(self) -> None: ...
    def send(self, message: object) -> None: ...

    def recorded(self) -> int:
        return 0

    def flush(self) -> None:
        self.flushes += 1


@pytest.fixture
def loaded(write_spec):
    return load_spec(write_spec(), ["train.max_steps=7", 'scheduler={name="step", kwargs={step_size=1}}'])


def _strategy(loaded) -> SingleDevice:
    return SingleDevice(resolve_devices(loaded.spec, {}, Inventory([], False)))


def test_total_steps_is_epochs_of_steps_capped_by_max_steps(write_spec) -> None:
    train = load_spec(write_spec(), ["train.epochs=3"]).spec.train
    assert count_total_steps(5, train) == 15
    assert count_total_steps(5, train.model_copy(update={"max_steps": 7})) == 7
    assert count_total_steps(5, train.model_copy(update={"max_steps": 100})) == 15


def test_build_parts_sizes_the_run_once(loaded) -> None:
    parts = build_parts(loaded.spec, loaded.path.parent, _strategy(loaded))
    # 96 samples, 25 % held out: 72 / batch 16 -> 5 steps per epoch, 2 epochs, capped at 7.
    assert parts.loaders.steps_per_epoch == 5 and parts.total_steps == 7
    assert parts.model is parts.raw_model  # one device: no wrapper
    assert parts.scheduler is not None and parts.scheduler_interval == "epoch"
    assert parts.precision.dtype is None
    assert parts.example_input().shape == (1, 8)


def test_checkpointer_saves_and_restore_loads_it_back(loaded, tmp_path: Path) -> None:
    strategy = _strategy(loaded)
    parts = build_parts(loaded.spec, loaded.path.parent, strategy)
    tracker = FlushCounter()
    folder = tmp_path / "ck"
    save = Checkpointer(parts, strategy, folder, loaded, run_id="r1", writer=True, tracker=tracker)
    with torch.no_grad():
        next(parts.raw_model.parameters()).add_(1.0)  # differs from a freshly built model
    state = TrainState(epoch=1, global_step=6, batch_in_epoch=1, epoch_sums=[1.0, 2.0, 16.0, 1.0])
    save(state, "step")
    (path,) = list_checkpoints(folder)
    payload = read_checkpoint(path)
    assert path.name == "step-00000006" and tracker.flushes == 1
    assert payload["scaler"] is None and payload["run_id"] == "r1" and payload["spec_sha256"] == loaded.sha256
    assert payload["state"]["epoch_sums"] == [1.0, 2.0, 16.0, 1.0]

    again = build_parts(loaded.spec, loaded.path.parent, strategy)
    restored = restore(again, strategy, folder, resume=True, restarted=False)
    assert restored.state == state and restored.resumed_from == str(path) and restored.notes == []
    for (name, a), (_, b) in zip(
        parts.raw_model.state_dict().items(), again.raw_model.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name


def test_a_rank_that_does_not_write_saves_nothing(loaded, tmp_path: Path) -> None:
    strategy = _strategy(loaded)
    parts = build_parts(loaded.spec, loaded.path.parent, strategy)
    tracker = FlushCounter()
    Checkpointer(parts, strategy, tmp_path, loaded, run_id=None, writer=False, tracker=tracker)(TrainState(), "signal")
    assert list_checkpoints(tmp_path) == [] and tracker.flushes == 0


def test_restore_without_a_checkpoint(loaded, tmp_path: Path) -> None:
    strategy = _strategy(loaded)
    parts = build_parts(loaded.spec, loaded.path.parent, strategy)
    asked = restore(parts, strategy, tmp_path, resume=True, restarted=False)
    assert asked.state == TrainState() and asked.resumed_from is None
    assert asked.notes == [f"no checkpoint in {tmp_path}: starting from step 0"]
    restarted = restore(parts, strategy, tmp_path, resume=False, restarted=True)
    assert restarted.state == TrainState() and restarted.notes == []  # an elastic restart before any checkpoint


def test_deterministic_settings_are_listed_in_order() -> None:
    assert describe_settings({}) == ""
    info = {"torch.use_deterministic_algorithms": "True", "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    expected = "torch.use_deterministic_algorithms=True, CUBLAS_WORKSPACE_CONFIG=:4096:8"
    assert describe_settings(info) == expected


def test_a_background_save_under_mode_none_is_in_place_once_waited_for(write_spec, tmp_path: Path) -> None:
    """checkpoint.async_save applies in every mode: without a process group DCP saves from a thread."""
    loaded = load_spec(write_spec(), ["train.max_steps=7", "checkpoint.async_save=true"])
    strategy = _strategy(loaded)
    parts = build_parts(loaded.spec, loaded.path.parent, strategy)
    folder = tmp_path / "ck"
    save = Checkpointer(parts, strategy, folder, loaded, run_id="r1", writer=True, tracker=FlushCounter())
    assert save.background
    save(TrainState(epoch=1, global_step=3), "step")
    assert save.pending is not None  # written by DCP's thread while training would go on
    save.wait()
    (path,) = list_checkpoints(folder)
    assert path.name == "step-00000003" and read_checkpoint(path)["state"]["global_step"] == 3
    save(TrainState(epoch=1, global_step=4), "signal")  # a stop's checkpoint is written before the call returns
    assert save.pending is None and [p.name for p in list_checkpoints(folder)][-1] == "step-00000004"


def test_finish_collects_the_worker_result(loaded) -> None:
    fitted = WorkerResult(0, {"val/loss": 0.5}, 7, [(7, {"val/loss": 0.5})], step_times_s=[0.1] * 7)
    result = finish(fitted, _strategy(loaded), ["a note"])
    assert (result.rank, result.global_step, result.metrics) == (0, 7, {"val/loss": 0.5})
    assert result.history == fitted.history and result.notes == ["a note"] and result.device == "cpu"
    assert result.peak_memory_bytes > 0  # this process's peak resident set size


def test_training_and_the_strategies_import_neither_mlflow_nor_tracking_nor_fsdp() -> None:
    # fsdp and torch.distributed.checkpoint cost each ddp worker about a second of start-up: fsdp imports them late
    code = (
        "import sys, runner.training.setup, runner.launch.worker, runner.strategies.distributed; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'mlflow' or m.startswith('runner.tracking')"
        " or m.startswith(('torch.distributed.fsdp', 'torch.distributed.checkpoint'))))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True, timeout=120
    )
    assert out.stdout.strip() == "[]"


def test_float64_parts_train_the_model_its_batches_and_its_loss_in_float64(loaded) -> None:
    parts = build_parts(loaded.spec, loaded.path.parent, _strategy(loaded), dtype="float64")
    assert {p.dtype for p in parts.model.parameters()} == {torch.float64}
    batch = parts.io.prepare(next(iter(parts.loaders.train)), torch.device("cpu"), torch.device("cpu"))
    assert batch.inputs.dtype == torch.float64 and batch.target.dtype == torch.int64
    assert parts.loss(parts.io.forward(parts.model, batch), batch, parts.io).dtype == torch.float64


def test_nudged_parts_start_one_ulp_above_the_same_seed(loaded) -> None:
    plain = build_parts(loaded.spec, loaded.path.parent, _strategy(loaded))
    nudged = build_parts(loaded.spec, loaded.path.parent, _strategy(loaded), nudge=True)
    for a, b in zip(plain.model.parameters(), nudged.model.parameters(), strict=True):
        assert torch.equal(torch.nextafter(a, torch.full_like(a, torch.inf)), b)

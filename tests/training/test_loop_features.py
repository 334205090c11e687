"""The training loop's features through the library API: accumulation, AMP, clipping, schedules, max_steps."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from runner.launch.driver import exec_experiment
from runner.launch.session import ExecOptions
from runner.spec.loading import load_spec
from tests.helpers import run_in_process, series

pytestmark = pytest.mark.timeout(120)


def test_gradient_accumulation_keeps_the_global_batch_semantics(write_spec) -> None:
    plain = run_in_process(write_spec)
    accumulated = run_in_process(write_spec, "train.grad_accum_steps=2")
    a, b = series(plain, "train/loss"), series(accumulated, "train/loss")
    assert [s for s, _ in a] == [s for s, _ in b] and len(a) == 10
    for (_, x), (_, y) in zip(a, b, strict=False):
        assert x == pytest.approx(y, abs=1e-5)


def test_other_seed_other_curve(write_spec) -> None:
    a = series(run_in_process(write_spec), "train/loss")
    b = series(run_in_process(write_spec, "seed=1"), "train/loss")
    assert a != b


def test_max_steps_stops_mid_epoch_and_still_evaluates(write_spec) -> None:
    result = run_in_process(write_spec, "train.max_steps=3", "train.epochs=5")
    assert [s for s, _ in series(result, "train/loss")] == [1, 2, 3]
    assert series(result, "val/accuracy")[-1][0] == 3


def test_bf16_autocast_on_cpu_trains(write_spec) -> None:
    result = run_in_process(write_spec, 'train.amp="bf16"', "train.epochs=3")
    losses = [v for _, v in series(result, "train/loss")]
    assert all(math.isfinite(v) for v in losses)
    assert losses[-1] < losses[0]


def test_step_scheduler_changes_the_logged_lr(write_spec) -> None:
    result = run_in_process(write_spec, 'scheduler={name="step", kwargs={step_size=1, gamma=0.5}}')
    lrs = dict(series(result, "lr"))
    assert lrs[1] == pytest.approx(0.1) and lrs[6] == pytest.approx(0.05)


def test_onecycle_steps_every_optimizer_step(write_spec) -> None:
    result = run_in_process(write_spec, 'scheduler={name="onecycle"}')
    lrs = [v for _, v in series(result, "lr")]
    assert all(a != b for a, b in itertools.pairwise(lrs))  # a new lr after every step
    peak = lrs.index(max(lrs))
    assert 0 < peak < len(lrs) - 1 and max(lrs) == pytest.approx(0.1)


def test_tiny_clip_norm_slows_learning(write_spec) -> None:
    free = run_in_process(write_spec, "train.epochs=3")
    clipped = run_in_process(write_spec, "train.epochs=3", "train.clip_grad_norm=1e-4")
    assert series(free, "train/loss")[0] == series(clipped, "train/loss")[0]  # before any update
    epochs = [v for _, v in series(clipped, "train/epoch_loss")]
    assert epochs[-1] == pytest.approx(epochs[0], rel=0.01)  # steps of norm 1e-4 barely move the weights
    assert clipped.metrics["val/loss"] > free.metrics["val/loss"]


def test_label_smoothing_raises_the_loss_floor(write_spec) -> None:
    plain = series(run_in_process(write_spec), "train/loss")
    smooth = series(run_in_process(write_spec, "loss.kwargs={label_smoothing=0.2}"), "train/loss")
    assert smooth[0][1] != plain[0][1]


def test_adamw_with_kwargs(write_spec) -> None:
    result = run_in_process(write_spec, 'optim.name="adamw"', "optim.lr=0.01", "optim.kwargs={betas=[0.8, 0.99]}")
    assert math.isfinite(result.metrics["val/loss"])


def test_bad_optimizer_kwargs_is_a_spec_error(write_spec) -> None:
    from runner.errors import SpecError

    with pytest.raises(SpecError, match=r"optim\.kwargs"):
        run_in_process(write_spec, "optim.kwargs={nesterov_typo=true}")


def test_deterministic_mode_is_reproducible(write_spec) -> None:
    timing = ("epoch_time_s", "samples_per_s")

    def values(result):
        return [(step, {k: v for k, v in m.items() if k not in timing}) for step, m in result.history]

    a = run_in_process(write_spec, "deterministic=true")
    b = run_in_process(write_spec, "deterministic=true")
    assert values(a) == values(b)
    assert any("torch.use_deterministic_algorithms=True" in note for note in a.notes)
    assert torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(False)


def test_rank_0_builds_its_datasets_once_for_the_checks_and_the_training(write_spec, monkeypatch) -> None:
    from runner.training import data

    built = []
    build = data.build_datasets

    def counting(*args, **kwargs):
        built.append(1)
        return build(*args, **kwargs)

    monkeypatch.setattr(data, "build_datasets", counting)
    monkeypatch.setattr("runner.training.setup.build_datasets", counting)
    result = run_in_process(write_spec, "train.max_steps=1")
    assert result.workers[0].global_step == 1
    assert len(built) == 1  # the prebuild checks' datasets are the training's


def test_the_second_step_is_counted_and_gives_tflops_and_an_mfu_only_against_a_named_peak(write_spec) -> None:
    import statistics

    from runner.launch.driver import end_figures
    from runner.plan import make_plan

    spec = write_spec()
    sets = ["tracking.enabled=false", "checkpoint.enabled=false"]
    for extra, tag in (
        (["devices.peak_tflops=0.5"], "0.5 TFLOP/s fp32 peak per device: devices.peak_tflops"),
        ([], "no MFU: peak fp32 FLOP/s of cpu unknown; set devices.peak_tflops"),
        (["train.amp=bf16"], "no MFU: peak bf16 FLOP/s of cpu unknown; set devices.peak_tflops"),
    ):
        loaded = load_spec(spec, [*sets, *extra])
        (worker,) = exec_experiment(loaded, ExecOptions(in_process=True)).workers
        # batch 16 through Linear(8, 32) (forward, weight gradient: the input needs none) and Linear(32, 3)
        # (forward, input and weight gradients), 2 FLOPs a multiply-add; the loss and the optimizer count nothing
        assert worker.step_flops == 2 * 16 * 8 * 32 * 2 + 2 * 16 * 32 * 3 * 3
        metrics, line, said = end_figures(make_plan(loaded), ExecOptions(), [worker])
        assert said == tag
        tflops = metrics["perf/tflops_per_s/rank0"]
        assert tflops == pytest.approx(worker.step_flops / statistics.median(worker.step_times_s[2:]) / 1e12)
        assert metrics["perf/flops_per_step"] == worker.step_flops
        named = "peak" in str(extra)
        assert [k for k in metrics if k.startswith("perf/mfu/")] == (["perf/mfu/rank0"] if named else [])
        if named:
            assert metrics["perf/mfu/rank0"] == pytest.approx(tflops / 0.5) and line.endswith(f"MFU {tflops / 0.5:.1%}")
        else:
            assert line.endswith(tag)
    uncounted = exec_experiment(load_spec(spec, sets), ExecOptions(in_process=True, sync_timing=True)).workers
    assert uncounted[0].step_flops is None  # runner bench's timed steps run plain
    timed = ExecOptions(sync_timing=True)
    assert end_figures(make_plan(loaded), timed, uncounted)[1:] == ("", "no FLOPs counted: timed steps")
    assert end_figures(make_plan(loaded), ExecOptions(), [])[1:] == ("", "no FLOPs counted: no step taken")

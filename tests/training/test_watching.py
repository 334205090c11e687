"""A watched metric: early stopping, a plateau schedule, and the best checkpoints kept, exported and logged."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient

from runner.cli import main
from runner.training.checkpoint import list_checkpoints
from runner.training.shards import whole_model
from runner.training.watch import early_stop, improves
from tests.helpers import refusal, run_in_process, series, spec_object

pytestmark = pytest.mark.timeout(180)

STEPS_PER_EPOCH = 5  # helpers.MINIMAL: 72 training samples, global batch 16
NEVER = "early_stopping={metric='val/loss', patience=2, min_delta=1e9}"  # no evaluation improves by 1e9


def test_improves_in_the_goals_direction_beyond_min_delta_and_never_with_nan() -> None:
    assert improves(1.0, None, "min") and improves(0.5, 1.0, "min") and not improves(1.0, 1.0, "min")
    assert improves(2.0, 1.0, "max") and not improves(0.5, 1.0, "max")
    assert not improves(0.95, 1.0, "min", min_delta=0.1) and improves(0.85, 1.0, "min", min_delta=0.1)
    assert not improves(math.nan, None, "min") and not improves(math.nan, 1.0, "max")


def test_early_stopping_counts_evaluations_without_improvement_and_skips_epochs_without_the_metric() -> None:
    spec = spec_object(early_stopping={"metric": "val/loss", "patience": 2}).early_stopping
    record, why = early_stop(spec, {"val/loss": 1.0}, 5, None)
    assert record == {"best": 1.0, "step": 5, "bad": 0} and why is None
    record, why = early_stop(spec, {"train/epoch_loss": 9.0}, 10, record)  # no evaluation this epoch
    assert record == {"best": 1.0, "step": 5, "bad": 0} and why is None
    record, why = early_stop(spec, {"val/loss": 1.5}, 15, record)
    assert record["bad"] == 1 and why is None
    record, why = early_stop(spec, {"val/loss": 1.2}, 20, record)
    assert record["bad"] == 2 and why is not None
    assert "val/loss did not improve by more than 0 (min) for 2 evaluation(s); best 1 at step 5" in why


def test_early_stopping_ends_training_at_the_step_patience_runs_out(write_spec) -> None:
    free = run_in_process(write_spec, "train.epochs=6")
    assert free.workers[0].global_step == 6 * STEPS_PER_EPOCH and free.workers[0].stop_reason is None
    stopped = run_in_process(write_spec, "train.epochs=6", NEVER)
    assert stopped.workers[0].global_step == 3 * STEPS_PER_EPOCH  # the first evaluation, then 2 without improvement
    assert [s for s, _ in series(stopped, "val/loss")] == [5, 10, 15]
    assert "early stopping: val/loss did not improve" in (stopped.workers[0].stop_reason or "")


def test_a_plateau_schedule_steps_on_the_monitored_metric(write_spec) -> None:
    # mode max with an absolute threshold of 1e9: after the first evaluation no epoch improves, so with patience 0
    # the lr halves after every later epoch
    plateau = "{mode='max', patience=0, factor=0.5, threshold=1e9, threshold_mode='abs'}"
    result = run_in_process(
        write_spec, "train.epochs=4", f"scheduler={{name='ReduceLROnPlateau', monitor='val/loss', kwargs={plateau}}}"
    )
    lrs = dict(series(result, "lr"))
    assert [lrs[step] for step in (1, 6, 11, 16)] == pytest.approx([0.1, 0.1, 0.05, 0.025])


def test_the_best_checkpoints_stay_beside_the_newest_and_export_and_the_logged_model_take_the_best(
    write_spec, tmp_path: Path, store: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # val/loss falls, so with goal "max" the first epoch's checkpoint is the best: it must outlive the rotation
    monitor = "checkpoint={monitor='val/loss', goal='max', keep_best=1, keep_last=1}"
    result = run_in_process(write_spec, "train.epochs=4", monitor, "tracking.log_model=true", store=True)
    folder = Path(result.checkpoint_dir)
    assert [p.name for p in list_checkpoints(folder)] == ["step-00000005", "step-00000020"]
    losses = dict(series(result, "val/loss"))
    assert losses[5] == max(losses.values())
    assert result.workers[0].best == ("val/loss", pytest.approx(losses[5]), 5)
    run = MlflowClient(store).get_run(result.run_id)
    assert run.data.tags["runner.best_checkpoint"] == f"step 5: val/loss = {losses[5]:.6g}"
    assert "**best checkpoint**: step 5" in run.data.tags["mlflow.note.content"]

    out = tmp_path / "best.pt"
    assert main(["export", result.run_id, "--best", "--out", str(out), "--tracking-uri", store]) == 0
    assert "at step 5 (from step-00000005)" in capsys.readouterr().out
    best = whole_model(folder / "step-00000005")
    exported = torch.load(out, weights_only=True)
    assert exported.keys() == best.keys() and all(torch.equal(exported[k], best[k]) for k in best)
    last = whole_model(folder / "step-00000020")
    assert any(not torch.equal(last[k], best[k]) for k in best)  # the newest is another model

    import mlflow.pytorch

    logged = mlflow.pytorch.load_model(f"models:/{run.outputs.model_outputs[0].model_id}")
    weights = {k.removeprefix("model."): v for k, v in logged.state_dict().items()}
    assert all(torch.equal(weights[k], best[k]) for k in best)


def test_export_best_without_a_monitor_is_a_usage_error(write_spec, store: str, capsys) -> None:
    result = run_in_process(write_spec, "train.epochs=1", store=True)
    assert main(["export", result.run_id, "--best", "--tracking-uri", store]) == 2
    assert "set no checkpoint.monitor, so no checkpoint is the best: drop --best" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("table", "body", "key", "says"),
    [
        ("early_stopping", 'metric = "val/acc"', "early_stopping.metric", 'did you mean "val/accuracy"?'),
        ("early_stopping", 'metric = "val/loss"\npatience = 0', "early_stopping.patience", "got 0"),
        ("early_stopping", 'metric = "val/loss"\ngoal = "up"', "early_stopping.goal", '"min" or "max"'),
        ("early_stopping", 'metric = "val/loss"\nmin_delta = -1', "early_stopping.min_delta", "got -1"),
        ("early_stopping", "patience = 2", "early_stopping.metric", "missing"),
        ("checkpoint", 'monitor = "val/f1"', "checkpoint.monitor", "is not logged at the end of an epoch"),
        ("checkpoint", 'monitor = "val/loss"\nkeep_best = 0', "checkpoint.keep_best", "got 0"),
        ("checkpoint", 'monitor = "val/loss"\ngoal = "best"', "checkpoint.goal", '"min" or "max"'),
    ],
)
def test_bad_watching_keys_are_refused_at_their_line(
    tmp_path: Path, table: str, body: str, key: str, says: str
) -> None:
    path = tmp_path / "s.toml"
    text = refusal(path, table, body)
    assert f"{path}:" in text and key in text and says in text, text


def test_a_validation_metric_needs_a_validation_split(tmp_path: Path) -> None:
    path = tmp_path / "s.toml"
    text = refusal(path, "early_stopping", 'metric = "val/loss"', data={"val_fraction": 0.0})
    assert "early_stopping.metric" in text and "needs a validation split, but data.val_fraction = 0" in text

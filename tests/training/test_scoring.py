"""The test split: scored at the end of a run (the best checkpoint when monitored) and later by ``runner test``."""

from __future__ import annotations

from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from runner.cli import main
from runner.launch.driver import exec_experiment
from runner.launch.session import ExecOptions
from runner.spec.loading import load_spec
from tests.helpers import refusal

pytestmark = pytest.mark.timeout(180)


def _run(write_spec, *sets: str):
    return exec_experiment(load_spec(write_spec(), list(sets)), ExecOptions(in_process=True))


def _history(store: str, run_id: str, key: str) -> list[tuple[int, float]]:
    return [(m.step, m.value) for m in MlflowClient(store).get_metric_history(run_id, key)]


def test_a_run_scores_its_final_model_on_the_test_split(write_spec, store: str) -> None:
    plain = _run(write_spec, "data.val_fraction=0.2")
    assert not any(key.startswith("test/") for key in plain.metrics)
    result = _run(write_spec, "data.val_fraction=0.2", "data.test_fraction=0.25")
    assert result.metrics["test/loss"] > 0 and 0 <= result.metrics["test/accuracy"] <= 1
    assert _history(store, result.run_id, "test/loss") == [(result.workers[0].global_step, result.metrics["test/loss"])]
    inputs = MlflowClient(store).get_run(result.run_id).inputs.dataset_inputs
    assert sorted(tag.value for i in inputs for tag in i.tags if tag.key == "mlflow.data.context") == [
        "testing",
        "training",
        "validation",
    ]


def test_runner_test_scores_the_best_checkpoint_as_the_run_did_and_the_last_later(
    write_spec, store: str, capsys: pytest.CaptureFixture[str]
) -> None:
    monitor = "checkpoint={monitor='val/loss', goal='max', keep_best=1, keep_last=1}"  # the first epoch is the best
    result = _run(write_spec, "data.test_fraction=0.25", "train.epochs=3", "train.ema_decay=0.8", monitor)
    # 96 samples: 24 for validation, 24 for the test, 48 to train on: 3 steps an epoch
    assert result.workers[0].best is not None and result.workers[0].best[2] == 3
    at_end = _history(store, result.run_id, "test/loss")
    assert at_end == [(3, result.metrics["test/loss"])]  # logged at the best checkpoint's step

    assert main(["test", result.run_id, "--checkpoint", "best", "--tracking-uri", store]) == 0
    assert "step-00000003 (best) scored on the test split, logged at step 3" in capsys.readouterr().out
    assert _history(store, result.run_id, "test/loss") == at_end * 2  # the same weights, the same value
    assert main(["test", result.run_id, "--tracking-uri", store]) == 0
    last = [(step, value) for step, value in _history(store, result.run_id, "test/loss") if step != 3]
    assert [step for step, _ in last] == [9] and last[0][1] != at_end[0][1]
    assert MlflowClient(store).get_run(result.run_id).data.tags["runner.test.checkpoint"] == "step-00000009"


def test_runner_test_without_a_test_split_exits_2_naming_the_fix(write_spec, store: str, capsys) -> None:
    result = _run(write_spec, "train.epochs=1")
    assert main(["test", result.run_id, "--tracking-uri", store]) == 2
    assert "has no test split: set data.test_fraction" in capsys.readouterr().err


def test_fractions_that_leave_no_training_sample_are_refused_at_their_line(tmp_path: Path) -> None:
    path = tmp_path / "s.toml"
    body = 'dataset = "synthetic"\nbatch_size = 16\nval_fraction = 0.5\ntest_fraction = 0.5'
    text = refusal(path, "data", body, data=None)
    assert f"{path}:" in text and "data.test_fraction" in text, text
    assert "test_fraction = 0.5 and val_fraction = 0.5 leave no training sample: keep their sum below 1" in text

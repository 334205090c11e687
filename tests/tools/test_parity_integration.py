"""``runner parity`` end to end on CPU: none, the control and ddp (2 gloo processes); verdicts, causes, MLflow runs."""

from __future__ import annotations

import pytest
from mlflow.tracking import MlflowClient

from runner.cli import main

pytestmark = [pytest.mark.integration, pytest.mark.created_store, pytest.mark.timeout(600)]


def _parity(spec, capsys, *args: str) -> tuple[int, str]:
    status = main(["parity", str(spec), "--modes", "ddp", "--steps", "4", *args])
    return status, capsys.readouterr().out


def test_agreeing_modes_exit_0_with_the_sensitivity_and_record_a_parent_with_children(
    write_spec, store: str, capfd
) -> None:
    status = main(["parity", str(write_spec()), "--modes", "ddp", "--steps", "4"])
    out, err = capfd.readouterr()
    assert status == 0, out
    # none, none-float32, the control and ddp-2 train in deterministic mode: said once per process, not per run
    assert 1 <= err.count("note: deterministic mode:") <= 2, err
    assert "the modes agree (float64, 4 steps, deterministic)" in out
    assert "perturbation grows to" in out and "float32 runs of this spec will differ by about that much" in out

    client = MlflowClient(store)
    exp = client.get_experiment_by_name("tests/parity")
    runs = client.search_runs([exp.experiment_id])
    parent = next(r for r in runs if r.data.tags.get("runner.parity") == "parent")
    assert parent.info.status == "FINISHED"
    assert parent.data.tags["runner.parity.verdict"] == "agree"
    assert parent.data.tags["runner.parity.precision"] == "float64"
    children = {r.data.tags["runner.parity.config"]: r for r in runs if r is not parent}
    assert set(children) == {"none", "none-float32", "control", "ddp-2"}
    assert all(r.data.tags["mlflow.parentRunId"] == parent.info.run_id for r in children.values())
    history = client.get_metric_history(children["ddp-2"].info.run_id, "parity/abs_dloss")
    assert [m.step for m in history] == [1, 2, 3, 4]
    files = {f.path for f in client.list_artifacts(parent.info.run_id, "parity")}
    assert {"parity/parity.png", "parity/verdict.txt", "parity/parity.json"} <= files


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        (
            {"model": {"name": "cnn", "kwargs": {"width": 4, "batch_norm": True}}, "data": {"input_shape": [1, 6, 6]}},
            "BatchNorm2d without parallel.sync_batchnorm",
        ),
        (
            {"model": {"kwargs": {"hidden": [32], "dropout": 0.5}}},
            "Dropout: under ddp",
        ),
    ],
    ids=["batchnorm", "dropout"],
)
def test_a_known_cause_exits_1_and_is_named(write_spec, store: str, capsys, changes: dict, named: str) -> None:
    from tests.helpers import spec_text

    spec = write_spec(text=spec_text(tracking={"uri": store}, **changes))
    status, out = _parity(spec, capsys)
    assert status == 1, out
    assert "the modes differ beyond rounding" in out
    assert "ddp-2    differs from step" in out
    assert f"likely cause: {named}" in out


def test_the_mnist_examples_adadelta_and_steplr_agree_across_none_ddp_and_fsdp(write_spec, capsys) -> None:
    # pytorch/examples' mnist recipe: Adadelta (lr 1.0) and StepLR (gamma 0.7), which no spec could name before
    recipe = [
        "--set",
        'optim.name="adadelta"',
        "--set",
        "optim.lr=1.0",
        "--set",
        'scheduler={name="StepLR", kwargs={step_size=1, gamma=0.7}}',
    ]
    status = main(["parity", str(write_spec()), "--modes", "ddp,fsdp", "--steps", "6", *recipe])
    out = capsys.readouterr().out
    assert status == 0, out
    assert "the modes agree (float64, 6 steps, deterministic)" in out
    assert "ddp-2    max |Δ train/loss|" in out and "fsdp-2   max |Δ train/loss|" in out

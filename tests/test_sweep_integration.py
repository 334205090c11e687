"""``runner sweep`` end to end on CPU: one parent MLflow run, nested trial runs, failures, resume, ``--jobs``."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

import runner.tools.sweep
from runner.cli import main
from runner.errors import UsageError
from runner.tools.sweep import run_sweep

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

TINY = """
name = "tiny"
seed = 0

[model]
name = "{model}"
kwargs = {{ hidden = 16 }}

[data]
dataset = "synthetic"
num_samples = 96
input_shape = [8]
num_classes = 3
batch_size = 16
val_fraction = 0.25

[devices]
accelerator = "cpu"

[optim]
name = "sgd"
lr = 0.1

[train]
epochs = 1
progress = "off"

[tracking]
uri = "{store}"
experiment = "sweeps"
"""

FLAKY = '''
"""A model factory that fails on request, for sweeps with a failing trial."""
import torch.nn as nn


def make(hidden=16, explode=False):
    if explode:
        raise RuntimeError("exploded on purpose")
    return nn.Sequential(nn.Flatten(), nn.Linear(8, hidden), nn.ReLU(), nn.Linear(hidden, 3))
'''


@pytest.fixture
def flaky_spec(write_spec, store: str, tmp_path: Path) -> Path:
    (tmp_path / "flaky.py").write_text(FLAKY, encoding="utf-8")
    return write_spec(text=TINY.format(model="flaky:make", store=store))


def _children(client: MlflowClient, parent_id: str) -> list:
    exp_id = client.get_run(parent_id).info.experiment_id
    return client.search_runs(
        [exp_id], filter_string=f"tags.mlflow.parentRunId = '{parent_id}'", order_by=["attributes.start_time ASC"]
    )


def _all_runs(client: MlflowClient) -> list:
    return client.search_runs([client.get_experiment_by_name("sweeps").experiment_id])


def test_grid_sweep_gives_one_parent_with_nested_children_and_the_best_trial(write_spec, store: str, capsys) -> None:
    extra = '[sweep]\nmetric = "val/loss"\ngoal = "min"\n[sweep.params."optim.lr"]\nvalues = [0.1, 0.01]\n'
    spec = write_spec(extra, text=TINY.format(model="mlp", store=store).replace("hidden = 16", "hidden = [16]"))
    assert main(["sweep", str(spec), "--grid", "seed=0,1", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    client = MlflowClient(store)
    assert len(_all_runs(client)) == 5  # one parent, four trials
    parent = client.get_run(report["parent_run_id"])
    children = _children(client, parent.info.run_id)
    assert len(children) == 4 and all(c.info.status == "FINISHED" for c in children)
    expected = {0: (0.1, 0), 1: (0.1, 1), 2: (0.01, 0), 3: (0.01, 1)}
    for child in children:
        tags, params = child.data.tags, child.data.params
        index = int(tags["runner.sweep.trial"])
        lr, seed = expected[index]
        assert child.info.run_name == f"lr={lr} seed={seed}"  # named by its values
        assert (params["optim.lr"], params["seed"]) == (str(lr), str(seed))
        assert (tags["sweep.optim.lr"], tags["sweep.seed"]) == (str(lr), str(seed))
        assert json.loads(tags["runner.sweep.values"]) == {"optim.lr": lr, "seed": seed}
        assert not [k for k in params if k.startswith("sweep.")]  # trials are plain experiments
    assert sorted(int(c.data.tags["runner.sweep.trial"]) for c in children) == [0, 1, 2, 3]

    assert parent.info.status == "FINISHED" and parent.data.tags["runner.sweep"] == "parent"
    assert parent.data.params["sweep.params.optim.lr"] == "[0.1, 0.01]"
    assert parent.data.params["sweep.params.seed"] == "[0, 1]"
    assert (parent.data.params["sweep.method"], parent.data.params["sweep.seed"]) == ("grid", "0")
    assert "sweep.json" in {a.path for a in client.list_artifacts(parent.info.run_id)}

    losses = {c.info.run_id: c.data.metrics["val/loss"] for c in children}
    best_id = min(losses, key=losses.get)
    best = client.get_run(best_id)
    assert parent.data.tags["runner.sweep.best_run_id"] == best_id
    assert parent.data.tags["runner.sweep.best_trial"] == best.data.tags["runner.sweep.trial"]
    assert parent.data.metrics["best/val/loss"] == pytest.approx(losses[best_id])
    assert report["best"]["run_id"] == best_id and report["failed"] == 0
    assert [t["metric_value"] for t in report["trials"]] == pytest.approx(
        [losses[t["run_id"]] for t in report["trials"]]
    )


def test_a_failing_trial_is_recorded_and_the_sweep_goes_on(flaky_spec: Path, store: str, capsys) -> None:
    code = main(
        ["sweep", str(flaky_spec), "--grid", "model.kwargs.explode=false,true", "--grid", "optim.lr=0.1", "--json"]
    )
    captured = capsys.readouterr()
    assert code == 1 and "1 of 2 trials failed" in captured.err
    report = json.loads(captured.out)
    assert report["failed"] == 1
    assert [t["status"] for t in report["trials"]] == ["FINISHED", "FAILED"]
    assert "exploded on purpose" in report["trials"][1]["error"]
    client = MlflowClient(store)
    parent = client.get_run(report["parent_run_id"])
    children = {int(c.data.tags["runner.sweep.trial"]): c for c in _children(client, parent.info.run_id)}
    assert children[0].info.status == "FINISHED" and children[1].info.status == "FAILED"
    assert "exploded on purpose" in children[1].data.tags["runner.error"]
    assert report["trials"][1]["run_id"] == children[1].info.run_id  # found although the trial raised
    assert parent.info.status == "FAILED"
    assert parent.data.tags["runner.sweep.best_run_id"] == children[0].info.run_id


def test_resume_runs_only_the_trials_that_did_not_finish(flaky_spec: Path, store: str) -> None:
    grid = ["model.kwargs.explode=false,true", "optim.lr=0.1,0.01"]
    first = run_sweep(flaky_spec, [], grid=grid, num_trials=3)  # (ok, 0.1) (ok, 0.01) (explode, 0.1)
    assert first.failed == 1 and [t.status for t in first.trials] == ["FINISHED", "FINISHED", "FAILED"]
    client = MlflowClient(store)
    parent_id = first.parent_run_id
    client.set_terminated(first.trials[1].run_id, "KILLED")  # as if trial 1 had been interrupted

    with pytest.raises(UsageError, match="differs"):
        run_sweep(flaky_spec, [], grid=["optim.lr=0.5,0.05"], resume=parent_id)
    with pytest.raises(UsageError, match="not the parent run of a sweep"):
        run_sweep(flaky_spec, [], resume=first.trials[0].run_id)

    again = run_sweep(flaky_spec, [], resume=parent_id)  # the recorded definition is reused
    assert again.parent_run_id == parent_id
    assert [(t.status, t.reused) for t in again.trials] == [("FINISHED", True), ("FINISHED", False), ("FAILED", False)]
    assert again.trials[0].run_id == first.trials[0].run_id
    assert again.trials[0].metric_value == first.trials[0].metric_value
    children = _children(client, parent_id)
    assert Counter(int(c.data.tags["runner.sweep.trial"]) for c in children) == {0: 1, 1: 2, 2: 2}
    assert len(_all_runs(client)) == 6
    parent = client.get_run(parent_id)
    assert parent.info.status == "FAILED" and parent.data.tags["runner.sweep.failed"] == "1"


def test_jobs_run_trials_as_subprocesses_with_the_same_results(flaky_spec: Path, store: str, monkeypatch) -> None:
    grid = ["model.kwargs.explode=false,true", "optim.lr=0.1,0.01"]
    here = run_sweep(flaky_spec, [], grid=grid, num_trials=3)

    def not_here(*args, **kwargs):
        raise AssertionError("with --jobs 2 trials must run in subprocesses")

    monkeypatch.setattr(runner.tools.sweep, "_run_here", not_here)
    apart = run_sweep(flaky_spec, [], grid=grid, num_trials=3, jobs=2)
    assert [t.status for t in apart.trials] == ["FINISHED", "FINISHED", "FAILED"] and apart.failed == 1
    assert "exploded on purpose" in (apart.trials[2].error or "")
    for a, b in zip(apart.trials, here.trials, strict=False):
        assert a.values == b.values
        assert a.metric_value == pytest.approx(b.metric_value)
    client = MlflowClient(store)
    children = _children(client, apart.parent_run_id)
    assert len(children) == 3 and len(_all_runs(client)) == 8
    by_index = {int(c.data.tags["runner.sweep.trial"]): c for c in children}
    assert [by_index[i].info.status for i in range(3)] == ["FINISHED", "FINISHED", "FAILED"]
    assert [by_index[i].info.run_id for i in range(3)] == [t.run_id for t in apart.trials]
    assert by_index[1].data.tags["sweep.optim.lr"] == "0.01"
    assert by_index[1].info.run_name == "explode=false lr=0.01"  # a subprocess trial is named by its values too
    assert not [k for k in by_index[0].data.params if k.startswith("sweep.")]
    assert client.get_run(apart.parent_run_id).info.status == "FAILED"

"""Tests of runner.tracking.runs' parent runs: parent runs, their children and summaries, in a throw-away sqlite store."""

from __future__ import annotations

import time

import pytest

from runner.errors import TrackingError
from runner.tracking import runs
from runner.tracking.runs import TrackedRun
from runner.tracking.stored import search_runs
from runner.tracking.uri import client_for


@pytest.fixture
def store(uri: str) -> str:
    """The created store of ``conftest.uri`` (``client`` reads it)."""
    return uri


def _parent(store: str) -> str:
    client = client_for(store)
    run_id = str(
        client.create_run(runs.experiment_id(store, "group"), tags={"kind": "parent"}, run_name="p").info.run_id
    )
    client.log_param(run_id, "group.size", "3")
    return run_id


def test_the_experiment_is_created_once(store, client):
    eid = runs.experiment_id(store, "group")
    assert client.get_experiment(eid).name == "group"
    assert runs.experiment_id(store, "group") == eid  # found, not created again


def test_a_deleted_experiment_is_a_clear_error(store, client):
    client.delete_experiment(client.create_experiment("group"))
    with pytest.raises(TrackingError, match="is deleted"):
        _parent(store)


def test_find_run_and_search_runs_newest_first(store, client):
    parent = _parent(store)
    eid = client.get_run(parent).info.experiment_id
    children = []
    for i in range(3):
        children.append(client.create_run(eid, tags={"mlflow.parentRunId": parent, "i": str(i)}).info.run_id)
        time.sleep(0.01)
    client.create_run(eid, tags={"mlflow.parentRunId": "f" * 32})  # another parent's child
    client.log_metric(children[1], "val/loss", 0.25)
    TrackedRun(store, children[2]).end("FINISHED")

    name = client.get_experiment(eid).name
    found = search_runs(store, name, {runs.PARENT_TAG: parent})
    assert [r.run_id for r in found] == children[::-1]
    assert [r.tags["i"] for r in found] == ["2", "1", "0"] and {r.experiment for r in found} == {name}
    assert found[1].metrics == {"val/loss": 0.25} and found[0].status == "FINISHED"
    assert found[0].start_time_ms >= found[1].start_time_ms >= found[2].start_time_ms
    assert search_runs(store, name, {runs.PARENT_TAG: "0" * 32}) == []
    assert [r.run_id for r in search_runs(store, name, {runs.PARENT_TAG: parent}, limit=1)] == [children[2]]
    assert [r.run_id for r in search_runs(store, None, status="FINISHED")] == [children[2]]
    assert search_runs(store, "no-such-experiment") == []

    record = TrackedRun(store, parent).find()
    assert record is not None and record.run_id == parent and record.experiment_id == eid
    assert record.params == {"group.size": "3"} and record.tags["kind"] == "parent"
    assert TrackedRun(store, "0" * 32).find() is None


def test_record_summary_and_mark_running(store, client, tmp_path):
    run_id = _parent(store)
    chart = tmp_path / "chart.png"
    chart.write_bytes(b"\x89PNG")
    runs.TrackedRun(store, run_id).log(
        metrics={"best/val/loss": 0.5, "count": 3},
        params={"group.steps": "20"},
        tags={"group.best": "x"},
        texts={"report.json": "{}\n"},
        files=[chart],
        files_dir="figures",
    )
    run = client.get_run(run_id)
    assert run.data.metrics == {"best/val/loss": 0.5, "count": 3.0}
    assert [m.step for m in client.get_metric_history(run_id, "best/val/loss")] == [0]
    assert run.data.params["group.steps"] == "20" and run.data.tags["group.best"] == "x"
    names = {a.path for a in client.list_artifacts(run_id)} | {a.path for a in client.list_artifacts(run_id, "figures")}
    assert {"report.json", "figures/chart.png"} <= names

    TrackedRun(store, run_id).end("FAILED")
    runs.TrackedRun(store, run_id).reopen(resumed=False)
    assert client.get_run(run_id).info.status == "RUNNING"
    assert "runner.resume.count" not in client.get_run(run_id).data.tags  # only the status changes
    with pytest.raises(TrackingError, match="could not log to MLflow run"):
        runs.TrackedRun(store, "0" * 32).log(tags={"a": "b"})
    with pytest.raises(TrackingError, match="could not reopen"):
        runs.TrackedRun(store, "0" * 32).reopen(resumed=False)


def test_record_summary_writes_runner_tags_as_column_values_and_remarks_into_the_description(store, client):
    """As every tag runner writes: a ``runner.*`` value is one line of at most 80 characters, but the long texts."""
    run_id = _parent(store)
    long = "no MFU: peak fp32 FLOP/s of NVIDIA H100 80GB HBM3 unknown; set devices.peak_tflops and  more"
    summary = "the modes agree\n  ddp-2  " + "x" * 200
    tags = {"runner.mfu": long, "runner.parity.summary": summary, "other": long}
    runs.TrackedRun(store, run_id).log(tags=tags, remarks={"host load": "quiet"})
    got = client.get_run(run_id).data.tags
    assert got["runner.mfu"] == long.replace("  ", " ")[:79] + "…" and got["other"] == long
    assert got["runner.parity.summary"] == summary and "**host load**: quiet" in got["mlflow.note.content"]

"""Dataset inputs of a run: a dataset another run of the experiment logs at the same moment is no failure."""

from __future__ import annotations

import pytest
from mlflow.tracking import MlflowClient

from runner.errors import TrackingError
from runner.tracking import stored as datasets
from runner.tracking.runs import TrackedRun
from runner.tracking.stored import DatasetRecord, record_data

RECORD = DatasetRecord("synthetic train", "abc123", "training", 72, "synthetic", (8,))


def _two_runs(store: str) -> tuple[str, str]:
    client = MlflowClient(store)
    experiment = client.create_experiment("race")
    return client.create_run(experiment).info.run_id, client.create_run(experiment).info.run_id


def test_a_dataset_another_worker_logged_first_is_linked_not_failed(
    ready_store: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sweep race: both check, the other inserts the row, ours hits the UNIQUE constraint; the retry links it."""
    mine, other = _two_runs(ready_store)
    real, calls = MlflowClient.log_inputs, []

    def racing(self, run_id, datasets=None, models=None):
        calls.append(run_id)
        if len(calls) == 1:
            real(self, other, datasets=datasets)  # the other worker wins the insert
            raise RuntimeError(
                "(sqlite3.IntegrityError) UNIQUE constraint failed: datasets.experiment_id, datasets.name, "
                "datasets.digest"
            )
        return real(self, run_id, datasets=datasets)

    monkeypatch.setattr(MlflowClient, "log_inputs", racing)
    monkeypatch.setattr(datasets.time, "sleep", lambda s: None)
    record_data(TrackedRun(ready_store, mine), [RECORD], "f00d")
    client = MlflowClient(ready_store)
    for run_id in (mine, other):
        (logged,) = client.get_run(run_id).inputs.dataset_inputs
        assert (logged.dataset.name, logged.dataset.digest) == ("synthetic train", "abc123")
    assert client.get_run(mine).data.tags[datasets.VAL_SPLIT_TAG] == "f00d"


def test_a_store_error_that_is_not_transient_fails_at_once(ready_store: str, monkeypatch: pytest.MonkeyPatch) -> None:
    mine, _ = _two_runs(ready_store)
    calls = []

    def refused(self, run_id, datasets=None, models=None):
        calls.append(run_id)
        raise ValueError("schema rejected")

    monkeypatch.setattr(MlflowClient, "log_inputs", refused)
    with pytest.raises(TrackingError, match="could not record the datasets"):
        record_data(TrackedRun(ready_store, mine), [RECORD], None)
    assert len(calls) == 1

"""ddp: a check only the driver makes fails while the workers start: they train nothing, exit 2, no run is left."""

from __future__ import annotations

from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from runner.cli import main

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def test_driver_check_failing_under_ddp_stops_the_started_workers(write_spec, store: str, tmp_path: Path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder\n", encoding="utf-8")
    spec = write_spec(f'[checkpoint]\ndir = "{blocker}/checkpoints"\n')
    args = ["exec", str(spec), "--set", 'parallel.mode="ddp"', "--set", "parallel.nproc_per_node=2"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "checkpoint.dir" in err and f"{spec}:" in err and "Traceback" not in err
    client = MlflowClient(store)
    experiment = client.get_experiment_by_name("tests")
    runs = client.search_runs([experiment.experiment_id]) if experiment is not None else []
    assert runs == []

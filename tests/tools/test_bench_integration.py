"""``runner bench`` end to end on CPU: none vs ddp (1 and 2 gloo processes), MLflow parent and child runs, files."""

from __future__ import annotations

import json
import math
import textwrap
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from runner.cli import main

pytestmark = [pytest.mark.integration, pytest.mark.created_store, pytest.mark.timeout(300)]

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _bench(argv: list[str], capsys) -> tuple[int, dict]:
    status = main(["bench", *argv, "--json"])
    out = capsys.readouterr().out
    return status, json.loads(out)


def _runs(store: str, experiment: str = "tests/bench"):
    client = MlflowClient(store)
    exp = client.get_experiment_by_name(experiment)
    return client, client.search_runs([exp.experiment_id])


def test_bench_none_vs_ddp_agrees_on_losses_and_records_one_parent(
    write_spec, store: str, tmp_path: Path, capsys
) -> None:
    spec = write_spec()
    out_dir = tmp_path / "results"
    argv = [
        str(spec),
        "--modes",
        "none,dp,ddp",
        "--nproc",
        "1,2",
        "--steps",
        "5",
        "--warmup",
        "2",
        "--out",
        str(out_dir),
    ]
    status, report = _bench(argv, capsys)
    assert status == 0

    rows = {c["config"]: c for c in report["configurations"]}
    assert list(rows) == ["none", "dp-2", "ddp-1", "ddp-2"]
    dp = rows.pop("dp-2")
    assert dp["status"] == "skipped" and "dp" in dp["reason"] and dp["run_id"] is None
    for name, row in rows.items():
        assert row["status"] == "ok", (name, row["reason"])
        assert row["timed_steps"] == 5 and row["timed_samples"] > 0
        for key in ("samples_per_s", "step_time_median_s", "step_time_p90_s", "final_loss"):
            assert row[key] is not None and row[key] > 0, (name, key, row[key])
        # on a busy machine an efficiency beyond 100 % and the spread is withdrawn, and the row says why
        assert (row["scaling_efficiency"] or 0) > 0 or "a measurement problem" in " ".join(row["noise"]), (name, row)
        assert row["step_time_p90_s"] >= row["step_time_median_s"]
        assert 0 <= row["data_wait_fraction"] < 1
        assert len(row["peak_memory_bytes"]) == row["n"] and min(row["peak_memory_bytes"]) > 0
        assert row["peak_memory_kind"] == "cpu_rss"
    assert rows["none"]["scaling_efficiency"] == pytest.approx(1.0)
    assert rows["ddp-2"]["devices"] == ["cpu", "cpu"]
    # switching the parallel mode changes speed, not results (docs/design.md §3)
    base = rows["none"]["final_loss"]
    for name in ("ddp-1", "ddp-2"):
        assert math.isclose(rows[name]["final_loss"], base, rel_tol=1e-4), (name, rows[name]["final_loss"], base)
        assert rows[name]["loss_check"] == "ok" and rows[name]["loss_agrees_through_step"] == 7

    client, runs = _runs(store)
    parent_id = report["parent_run_id"]
    parent = client.get_run(parent_id)
    assert parent.info.status == "FINISHED" and parent.data.tags["runner.bench"] == "parent"
    assert report["recommendation"].startswith(("recommend: none — ", "recommend: ddp-", "recommend: inconclusive — "))
    assert parent.data.tags["runner.bench.recommendation"] == report["recommendation"]
    assert report["host_load"].startswith(("quiet: 1-min load", "busy: 1-min load"))  # beside the speed figures
    assert parent.data.tags["runner.host_busy"] == str(report["host_load"].startswith("busy")).lower()
    children = client.search_runs([parent.info.experiment_id], filter_string=f"tags.mlflow.parentRunId = '{parent_id}'")
    by_config = {r.data.tags["runner.bench.config"]: r for r in children}
    assert set(by_config) == {"none", "ddp-1", "ddp-2"}
    for name, run in by_config.items():
        assert run.info.status == "FINISHED" and run.info.run_id == rows[name]["run_id"]
        assert run.info.run_name.startswith(f"{name} bench ")  # the configuration first: the runs table cuts names
        assert run.data.params["train.max_steps"] == "7" and run.data.params["bench.mode"] == rows[name]["mode"]
        assert run.data.metrics["bench/samples_per_s"] == pytest.approx(rows[name]["samples_per_s"])
        assert len(client.get_metric_history(run.info.run_id, "train/loss")) == 7
    assert by_config["ddp-2"].data.params["parallel.nproc_per_node"] == "2"
    assert parent.data.metrics["bench/ddp-2/samples_per_s"] == pytest.approx(rows["ddp-2"]["samples_per_s"])
    assert {a.path for a in client.list_artifacts(parent_id, "bench")} == {"bench/bench.json", "bench/bench.png"}
    assert len(runs) == 4
    assert client.get_experiment_by_name("tests") is None  # the training experiment's charts stay clean
    assert report["experiment"] == "tests/bench"

    png = out_dir / "bench.png"
    assert png.read_bytes()[:8] == PNG_SIGNATURE
    from PIL import Image

    with Image.open(png) as image:
        image.verify()
    assert json.loads((out_dir / "bench.json").read_text())["configurations"] == report["configurations"]


FRAGILE = '''
import torch
from torch import nn


class Fragile(nn.Module):
    """An MLP whose forward fails under torch.distributed (a stand-in for a DDP-only bug)."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(1), nn.Linear(8, 3))

    def forward(self, x):
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            raise RuntimeError("fragile model breaks under DDP")
        return self.net(x)


def build():
    return Fragile()
'''


def test_a_configuration_that_fails_is_reported_and_fails_the_parent(
    write_spec, store: str, tmp_path: Path, capsys
) -> None:
    (tmp_path / "bench_fragile.py").write_text(textwrap.dedent(FRAGILE), encoding="utf-8")
    spec = write_spec("", name="fragile.toml")
    argv = [str(spec), "--set", 'model.name="bench_fragile:build"', "--set", "model.kwargs={}"]
    status, report = _bench([*argv, "--modes", "none,ddp", "--nproc", "1", "--steps", "2", "--warmup", "0"], capsys)
    assert status == 1
    rows = {c["config"]: c for c in report["configurations"]}
    assert rows["none"]["status"] == "ok"
    assert rows["ddp-1"]["status"] == "failed" and "fragile model breaks under DDP" in rows["ddp-1"]["reason"]
    client, _ = _runs(store)
    parent = client.get_run(report["parent_run_id"])
    assert parent.info.status == "FAILED"
    assert "ddp-1" in parent.data.tags["runner.error"]


def test_a_model_that_does_not_build_exits_2_and_leaves_no_run(write_spec, store: str, capsys) -> None:
    spec = write_spec("", name="bogus.toml")
    status = main(["bench", str(spec), "--set", "model.kwargs={bogus=1}", "--modes", "none,ddp", "--nproc", "1,2"])
    assert status == 2
    err = capsys.readouterr().err
    assert "model.kwargs" in err and "Traceback" not in err
    client = MlflowClient(store)
    for name in ("tests", "tests/bench"):
        experiment = client.get_experiment_by_name(name)
        assert experiment is None or client.search_runs([experiment.experiment_id]) == []

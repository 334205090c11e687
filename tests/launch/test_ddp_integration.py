"""DDP on CPU with gloo: one run per job, mode invariance, failures, two nodes, torchrun."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient

from runner.cli import main
from runner.devices.resolve import threads_per_process
from runner.training.checkpoint import load_latest
from runner.training.shards import whole_model
from tests.helpers import PROBES

pytestmark = [pytest.mark.integration, pytest.mark.created_store, pytest.mark.timeout(240)]

DDP = ['parallel.mode="ddp"', "parallel.nproc_per_node=2", "parallel.timeout_s=60"]


def _sets(items: list[str]) -> list[str]:
    out: list[str] = []
    for item in items:
        out += ["--set", item]
    return out


def _runs(store: str, experiment: str = "tests"):
    client = MlflowClient(store)
    exp = client.get_experiment_by_name(experiment)
    runs = [] if exp is None else client.search_runs([exp.experiment_id], order_by=["attributes.start_time ASC"])
    return client, runs


def _final_params(store: str, run_id: str) -> dict[str, torch.Tensor]:
    found = load_latest(Path(store[len("sqlite:///") :]).parent / "checkpoints" / run_id)
    assert found is not None
    return whole_model(found.path)


def test_none_ddp_and_torchrun_agree_step_by_step_and_no_training_process_holds_mlflow(
    write_spec, store: str, tmp_path: Path, monkeypatch
) -> None:
    """One job three ways: ``none``, ddp-2 launched by runner, ddp-2 under torchrun. Each is one FINISHED run whose
    steps are logged once (only rank 0 logs); losses and final weights agree. The process model (docs/design.md §6):
    every process that runs backward is a training process without mlflow; the driver (this process) trains nothing.
    """
    probe = tmp_path / "probe"
    probe.mkdir()
    monkeypatch.setenv("RUNNER_TEST_PROBE", str(probe))
    (tmp_path / "probes.py").write_text(PROBES, encoding="utf-8")
    spec = write_spec()
    model = ['model.name="probes:model"', "model.kwargs={in_features = 8, num_classes = 3}"]
    common = ["train.epochs=3", "data.shuffle=true", "optim.momentum=0.9", *model]
    assert main(["exec", str(spec), *_sets(common)]) == 0
    assert len(list(probe.glob("trains-*"))) == 1  # the none run's one training process
    profile = ["profile.ranks=[0, 1]", "profile.active=2"]  # [profile]: each rank's trace, uploaded by rank 0
    assert main(["exec", str(spec), *_sets(common + DDP + profile)]) == 0
    rdzv = ["--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", *rdzv, "-m", "runner", "exec"]
    done = subprocess.run(
        [*torchrun, str(spec), *_sets(common + DDP)], env=_env(), cwd=tmp_path, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr
    client, (single, ddp, launched) = _runs(store)
    a = [(m.step, m.value) for m in client.get_metric_history(single.info.run_id, "train/loss")]
    b = [(m.step, m.value) for m in client.get_metric_history(ddp.info.run_id, "train/loss")]
    c = [(m.step, m.value) for m in client.get_metric_history(launched.info.run_id, "train/loss")]
    # 72 training samples / global batch 16 -> 5 steps per epoch (4 full + 8), 3 epochs; a step logged twice would
    # mean that more than one rank logs
    assert [s for s, _ in a] == [s for s, _ in b] == [s for s, _ in c] == list(range(1, 16))
    for (step, va), (_, vb), (_, vc) in zip(a, b, c, strict=True):
        assert va == pytest.approx(vb, abs=1e-5), f"step {step}"
        assert vb == pytest.approx(vc, abs=1e-6), f"step {step} under torchrun"
    pa, pb = _final_params(store, single.info.run_id), _final_params(store, ddp.info.run_id)
    assert pa.keys() == pb.keys()
    for key in pa:
        torch.testing.assert_close(pa[key], pb[key], atol=1e-5, rtol=0)
    assert single.data.metrics["val/accuracy"] == pytest.approx(ddp.data.metrics["val/accuracy"], abs=1e-9)
    for run in (single, ddp, launched):
        assert run.info.status == "FINISHED" and run.data.params["model.name"] == "probes:model"
        assert [d.dataset.name for d in run.inputs.dataset_inputs] == ["synthetic train", "synthetic val"]
    assert [r.data.tags["runner.world_size"] for r in (single, ddp, launched)] == ["1", "2", "2"]
    traces = {a.path for a in client.list_artifacts(ddp.info.run_id, "profile")}
    assert traces == {f"profile/rank{r}.{kind}" for r in (0, 1) for kind in ("trace.json", "ops.txt")}
    trace = json.loads(
        Path(client.download_artifacts(ddp.info.run_id, "profile/rank1.trace.json", str(tmp_path))).read_text()
    )
    assert any(e.get("name") == "ProfilerStep#3" for e in trace["traceEvents"])  # steps 3 and 4: wait 1, warm-up 1
    assert not client.list_artifacts(single.info.run_id, "profile")  # off unless asked
    assert [k for k in sorted(ddp.data.metrics) if k.startswith("memory/")] == [
        "memory/peak_rss_mib/rank0",
        "memory/peak_rss_mib/rank1",
    ]  # each rank's peak, logged by the driver at the end
    # each rank counted its half of the global batch: the step's FLOPs are none's, and each rank's rate is logged
    assert ddp.data.metrics["perf/flops_per_step"] == single.data.metrics["perf/flops_per_step"] > 0
    assert {k for k in ddp.data.metrics if k.startswith("perf/tflops")} == {
        f"perf/tflops_per_s/rank{r}" for r in (0, 1)
    }
    notes = {p.name: p.read_text() for p in probe.glob("trains-*")}
    assert len(notes) == 5 and set(notes.values()) == {"clean"}, notes  # 1 + 2 + 2 processes ran backward
    assert f"trains-{os.getpid()}" not in notes  # nor did the driver: under torchrun rank 0's runs in its child
    cores = len(os.sched_getaffinity(0))  # one thread rule for every mode, recorded in each run
    for run, processes in ((single, 1), (ddp, 2)):
        expect = threads_per_process(0, os.environ, cores, processes)[0]
        assert run.data.params["runner.threads_per_process"] == str(expect)


FAILING = """
import os
import torch


class FailOnRank(torch.nn.Module):
    def __init__(self, rank: int = 1, at_call: int = 3):
        super().__init__()
        self.lin = torch.nn.Linear(8, 3)
        self.calls = 0
        self.rank, self.at_call = rank, at_call

    def forward(self, x):
        self.calls += 1
        if self.calls == self.at_call and int(os.environ.get("RANK", "0")) == self.rank:
            raise RuntimeError(f"rank {self.rank} exploded on purpose")
        return self.lin(x)


def build(**kwargs):
    return FailOnRank(**kwargs)
"""


def test_one_rank_failing_fails_the_job_fast(write_spec, store: str, tmp_path: Path, capsys) -> None:
    (tmp_path / "failing_factory.py").write_text(FAILING)
    spec = write_spec()
    start = time.monotonic()
    code = main(
        [
            "exec",
            str(spec),
            *_sets([*DDP, 'model.name="failing_factory:build"', "model.kwargs={}", "parallel.timeout_s=20"]),
        ]
    )
    elapsed = time.monotonic() - start
    assert code == 1
    assert elapsed < 200  # bounded well inside the test's own timeout, however loaded the machine
    err = capsys.readouterr().err
    # one message: the rank, the cause, the user's file and line, and a log file with the full tracebacks
    assert "rank 1 failed" in err and "exploded on purpose" in err and "failing_factory.py:" in err, err
    assert "Traceback" not in err and "Ctrl-C" not in err and len(err.splitlines()) < 12, err
    log = Path(err.rpartition("the ranks' full tracebacks: ")[2].strip())
    assert "Traceback" in log.read_text() and "exploded on purpose" in log.read_text()
    _, runs = _runs(store)
    assert [r.info.status for r in runs] == ["FAILED"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[2]), env.get("PYTHONPATH", "")])
    return env


def test_two_nodes_on_one_machine_make_one_run(write_spec, store: str, tmp_path: Path) -> None:
    port = _free_port()
    spec = write_spec()
    common = [
        sys.executable,
        "-m",
        "runner",
        "exec",
        str(spec),
        "--nnodes",
        "2",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        *_sets(['parallel.mode="ddp"', "parallel.nproc_per_node=1", "parallel.timeout_s=60"]),
    ]
    nodes = [
        subprocess.Popen(
            [*common, "--node-rank", str(r)],
            env=_env(),
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in (0, 1)
    ]
    outputs = [n.communicate(timeout=200)[0] for n in nodes]
    assert [n.returncode for n in nodes] == [0, 0], outputs
    client, runs = _runs(store)
    assert len(runs) == 1 and runs[0].info.status == "FINISHED", outputs
    assert runs[0].data.tags["runner.world_size"] == "2"
    steps = [m.step for m in client.get_metric_history(runs[0].info.run_id, "train/loss")]
    assert steps == list(range(1, 11))


UNUSED = """
import torch


class WithUnused(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.used = torch.nn.Linear(8, 3)
        self.spare_head = torch.nn.Linear(8, 3)

    def forward(self, x):
        return self.used(x)


def build():
    return WithUnused()
"""


def test_unused_parameters_error_names_them_and_the_spec_key(write_spec, store: str, tmp_path: Path, capsys) -> None:
    (tmp_path / "unused_factory.py").write_text(UNUSED)
    spec = write_spec()
    sets = [*DDP, 'model.name="unused_factory:build"', "model.kwargs={}", "parallel.timeout_s=20"]
    assert main(["exec", str(spec), *_sets(sets)]) == 1
    err = capsys.readouterr().err
    assert "spare_head.weight" in err and "parallel.find_unused_parameters" in err
    assert main(["exec", str(spec), *_sets([*sets, "parallel.find_unused_parameters=true"])]) == 0


def test_a_dataset_factory_that_raises_under_ddp_is_one_message_and_a_failed_run(
    write_spec, store: str, tmp_path: Path, capsys
) -> None:
    """It left a soft-deleted RUNNING run with artifacts, and a torch traceback. User code failing is a training
    failure (exit 1, the run FAILED, the cause at the user's file and line), as for a model's forward."""
    (tmp_path / "bad_data.py").write_text("def make(**kwargs):\n    raise ValueError('no such shard: train-0007')\n")
    spec = write_spec()
    code = main(["exec", str(spec), *_sets([*DDP, 'data.dataset="bad_data:make"', "data.kwargs={}"])])
    err = capsys.readouterr().err
    assert code == 1, err
    assert "no such shard: train-0007" in err and "bad_data.py:2" in err and "Traceback" not in err, err
    client = MlflowClient(store)
    runs = [r for e in client.search_experiments(view_type=3) for r in client.search_runs([e.experiment_id], "", 3)]
    assert [(r.info.status, r.info.lifecycle_stage) for r in runs] == [("FAILED", "active")]

"""``runner sweep`` end to end on CPU: one parent run, nested trial runs, failures, pruning, resume, workers, ``--jobs``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import optuna
import pytest
from mlflow.tracking import MlflowClient

from runner.cli import main
from runner.errors import Interrupted
from runner.tools.sweep import run_sweep
from runner.tools.sweep_trials import CommandLine
from tests.helpers import spec_text

pytestmark = [pytest.mark.integration, pytest.mark.created_store, pytest.mark.timeout(240)]

ROOT = Path(__file__).resolve().parents[2]


def tiny(store: str, model: str = "mlp", hidden: int | None = None) -> str:
    """The sweeps' one-epoch spec: ``helpers.MINIMAL`` named ``tiny`` in the experiment ``sweeps``."""
    return spec_text(
        name="tiny",
        model={"name": model, "kwargs": {"hidden": [16] if hidden is None else hidden}},
        train={"epochs": 1, "log_every_n_steps": None},
        tracking={"uri": store, "experiment": "sweeps"},
    )


FLAKY = '''
"""A model factory that fails or is interrupted on request, and notes the process that built it."""
import os
import signal
import torch.nn as nn


def make(hidden=16, explode=False, stop=False, die=False):
    with open(os.environ.get("RUNNER_TEST_PIDS", os.devnull), "a") as fh:
        fh.write(f"{os.getpid()}\\n")
    if explode:
        raise RuntimeError("exploded on purpose")
    if die:  # the process is gone at once, as after the kernel's OOM killer (os._exit in a factory is refused now)
        os.kill(os.getpid(), signal.SIGKILL)
    if stop and os.path.exists(os.environ.get("RUNNER_TEST_STOP", "")):
        raise KeyboardInterrupt  # as if Ctrl-C arrived while this trial builds
    return nn.Sequential(nn.Flatten(), nn.Linear(8, hidden), nn.ReLU(), nn.Linear(hidden, 3))
'''


@pytest.fixture
def flaky_spec(write_spec, store: str, tmp_path: Path) -> Path:
    (tmp_path / "flaky.py").write_text(FLAKY, encoding="utf-8")
    return write_spec(text=tiny(store, "flaky:make", 16))


def _children(client: MlflowClient, parent_id: str) -> list:
    exp_id = client.get_run(parent_id).info.experiment_id
    return client.search_runs(
        [exp_id], filter_string=f"tags.mlflow.parentRunId = '{parent_id}'", order_by=["attributes.start_time ASC"]
    )


def _all_runs(client: MlflowClient) -> list:
    return client.search_runs([client.get_experiment_by_name("sweeps").experiment_id])


def _study(tmp_path: Path, name: str) -> optuna.Study:
    return optuna.load_study(study_name=name, storage=f"sqlite:///{tmp_path}/optuna.db")


def test_grid_sweep_gives_one_parent_with_nested_children_and_the_best_trial(
    write_spec, store: str, tmp_path, capsys
) -> None:
    extra = '[sweep]\nmetric = "val/loss"\ngoal = "min"\n[sweep.params."optim.lr"]\nvalues = [0.1, 0.01]\n'
    spec = write_spec(extra, text=tiny(store))
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
        assert tags["runner.sweep.study"] == report["study"] and "runner.sweep.pruned" not in tags
        assert not [k for k in params if k.startswith("sweep.")]  # trials are plain experiments
    assert sorted(int(c.data.tags["runner.sweep.trial"]) for c in children) == [0, 1, 2, 3]

    assert parent.info.status == "FINISHED" and parent.data.tags["runner.sweep"] == "parent"
    assert parent.data.params["sweep.params.optim.lr"] == "[0.1, 0.01]"
    assert parent.data.params["sweep.params.seed"] == "[0, 1]"
    assert (parent.data.params["sweep.method"], parent.data.params["sweep.trials"]) == ("grid", "4")
    assert parent.data.tags["runner.sweep.study"] == report["study"]
    artifacts = {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert {"sweep.json", "sweep_report.json", "plots"} <= artifacts
    plots = {a.path for a in client.list_artifacts(parent.info.run_id, "plots")}
    assert plots == {"plots/optimization_history.png", "plots/param_importances.png"}

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
    study = _study(tmp_path, report["study"])  # Optuna holds the same values the runs hold
    assert [t.value for t in study.trials] == pytest.approx([t["metric_value"] for t in report["trials"]])
    assert study.direction == optuna.study.StudyDirection.MINIMIZE


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


def test_a_stopped_sweep_resumes_where_it_stopped(flaky_spec: Path, store: str, tmp_path: Path, monkeypatch) -> None:
    stop = tmp_path / "stop"
    stop.write_text("", encoding="utf-8")
    monkeypatch.setenv("RUNNER_TEST_STOP", str(stop))
    flags = CommandLine(grid=["model.kwargs.stop=false,true", "optim.lr=0.1,0.01"])  # trial 2 is stopped
    with pytest.raises(Interrupted):
        run_sweep(flaky_spec, [], cli=flags)
    client = MlflowClient(store)
    (parent,) = [r for r in _all_runs(client) if r.data.tags.get("runner.sweep") == "parent"]
    assert parent.info.status == "KILLED"
    first = {int(c.data.tags["runner.sweep.trial"]): c.info.status for c in _children(client, parent.info.run_id)}
    assert first == {0: "FINISHED", 1: "FINISHED"}  # trial 2 stopped while it built: its run was never made

    stop.unlink()
    again = run_sweep(flaky_spec, [], cli=flags)  # the same command continues the same study
    assert again.parent_run_id == parent.info.run_id and again.failed == 0
    assert [(t.index, t.status, t.reused) for t in again.trials] == [
        (0, "FINISHED", True),
        (1, "FINISHED", True),
        (2, "FINISHED", False),
        (3, "FINISHED", False),
    ]
    children = _children(client, parent.info.run_id)
    assert Counter(int(c.data.tags["runner.sweep.trial"]) for c in children) == {0: 1, 1: 1, 2: 1, 3: 1}
    assert client.get_run(parent.info.run_id).info.status == "FINISHED"
    third = run_sweep(flaky_spec, [], cli=flags)  # nothing left: no trial runs again
    assert len(_children(client, parent.info.run_id)) == 4 and all(t.reused for t in third.trials)


def test_pruning_stops_a_bad_trial_early(write_spec, store: str, tmp_path: Path) -> None:
    sweep = (
        '[sweep]\nmetric = "val/loss"\ngoal = "min"\npruner = "median"\npruner_startup_trials = 1\n'
        '[sweep.params."optim.lr"]\nvalues = [0.5, 1e-6]\n'
    )
    spec = write_spec(sweep, text=tiny(store))
    report = run_sweep(spec, ["train.epochs=4"])
    good, bad = report.trials
    assert not good.pruned and bad.pruned and bad.pruned_epoch == 0 and report.failed == 0
    client = MlflowClient(store)
    runs = {r.data.tags["runner.sweep.trial"]: r for r in _children(client, report.parent_run_id)}
    assert runs["1"].info.status == "FINISHED" and runs["1"].data.tags["runner.sweep.pruned"] == "true"
    assert "runner.sweep.pruned" not in runs["0"].data.tags
    epochs = {k: [m.value for m in client.get_metric_history(r.info.run_id, "epoch")] for k, r in runs.items()}
    assert epochs == {"0": [0.0, 1.0, 2.0, 3.0], "1": [0.0]}  # the bad trial stopped after its first epoch
    states = [t.state.name for t in _study(tmp_path, report.study).trials]
    assert states == ["COMPLETE", "PRUNED"]
    assert client.get_run(report.parent_run_id).data.tags["runner.sweep.pruned_trials"] == "1"


def _sweep_process(spec: Path, cwd: Path, *args: str) -> subprocess.Popen[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return subprocess.Popen(
        [sys.executable, "-m", "runner", "sweep", str(spec), *args, "--json"],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.timeout(600)
def test_workers_on_one_fresh_store_share_one_study(flaky_spec: Path, store: str, tmp_path: Path) -> None:
    """Three started at once on a store that does not exist yet: each trial runs once and none fails of the race
    (creating the store, logging the same dataset at the same moment)."""
    count = 3
    Path(store[len("sqlite:///") :]).unlink()  # fresh: the workers create it
    args = ("--method", "tpe", "--random", "optim.lr=1e-3:1:log", "--trials", "4")
    workers = [_sweep_process(flaky_spec, tmp_path, *args) for _ in range(count)]
    outputs = [w.communicate(timeout=500) for w in workers]
    assert [w.returncode for w in workers] == [0] * count, outputs
    reports = [json.loads(out) for out, _ in outputs]
    assert reports[0]["parent_run_id"] == reports[1]["parent_run_id"]
    ran = [line for _, err in outputs for line in err.splitlines() if line.startswith("[sweep ")]
    numbers = [int(line.split("] trial ")[1].split()[0]) for line in ran]
    assert sorted(numbers) == list(range(4)), ran  # 4 trials in total, none run twice
    client = MlflowClient(store)
    assert len(_all_runs(client)) == 5  # one parent, four trials
    children = _children(client, reports[0]["parent_run_id"])
    assert sorted(int(c.data.tags["runner.sweep.trial"]) for c in children) == list(range(4))
    assert len({c.data.params["optim.lr"] for c in children}) == 4  # each trial drew its own value
    assert client.get_run(reports[0]["parent_run_id"]).info.status == "FINISHED"
    study = _study(tmp_path, reports[0]["study"])
    assert [t.state.name for t in study.trials] == ["COMPLETE"] * 4


def test_jobs_run_trials_in_warm_workers_with_the_same_results(
    flaky_spec: Path, store: str, tmp_path: Path, monkeypatch
) -> None:
    flags = CommandLine(grid=["model.kwargs.explode=false,true", "optim.lr=0.1,0.01,0.001"], trials=5)
    here = run_sweep(flaky_spec, [], cli=flags, study="here")
    pids = tmp_path / "pids.txt"
    monkeypatch.setenv("RUNNER_TEST_PIDS", str(pids))
    apart = run_sweep(flaky_spec, [], cli=flags, jobs=2, study="apart")
    assert [t.status for t in apart.trials] == ["FINISHED"] * 3 + ["FAILED"] * 2 and apart.failed == 2
    assert "exploded on purpose" in (apart.trials[3].error or "")
    for a, b in zip(apart.trials, here.trials, strict=True):
        assert a.values == b.values
        assert a.metric_value == pytest.approx(b.metric_value)
    built_in = pids.read_text().split()
    assert len(built_in) == 5 and len(set(built_in)) <= 2  # five trials, at most two processes: reused
    assert str(os.getpid()) not in built_in
    client = MlflowClient(store)
    children = _children(client, apart.parent_run_id)
    assert len(children) == 5 and len(_all_runs(client)) == 12
    by_index = {int(c.data.tags["runner.sweep.trial"]): c for c in children}
    assert [by_index[i].info.status for i in range(5)] == ["FINISHED"] * 3 + ["FAILED"] * 2
    assert [by_index[i].info.run_id for i in range(5)] == [t.run_id for t in apart.trials]
    assert by_index[1].data.tags["sweep.optim.lr"] == "0.01"
    assert by_index[1].info.run_name == "explode=false lr=0.01"  # named by its values
    assert client.get_run(apart.parent_run_id).info.status == "FAILED"


def test_a_worker_process_that_dies_fails_its_trial_and_another_takes_over(flaky_spec: Path, store: str) -> None:
    flags = CommandLine(grid=["model.kwargs.die=true,false", "optim.lr=0.1"])  # trial 0 kills its process
    report = run_sweep(flaky_spec, [], cli=flags, processes=True)
    assert [t.status for t in report.trials] == ["FAILED", "FINISHED"]
    assert "the sweep worker process exited with status -9" in (report.trials[0].error or "")
    client = MlflowClient(store)
    children = {int(c.data.tags["runner.sweep.trial"]): c for c in _children(client, report.parent_run_id)}
    # Trial 0's process died while it built the model, before its run was made (docs/design.md §6): none is RUNNING.
    assert {i: c.info.status for i, c in children.items()} == {1: "FINISHED"}
    assert client.get_run(report.parent_run_id).info.status == "FAILED"


def test_a_trial_whose_worker_stopped_beating_is_run_again(tmp_path: Path, monkeypatch) -> None:
    import time

    import runner.tools.sweep_study as storage_module
    from runner.tools.sweep_study import SweepStudy, open_storage
    from runner.tools.sweep_trials import build_definition

    monkeypatch.setattr(storage_module, "GRACE_S", 1)
    definition = build_definition(None, CommandLine(grid=["seed=0,1"]))
    url = f"sqlite:///{tmp_path}/optuna.db"
    study, founded = SweepStudy.open(open_storage(url), url, "s", definition, found=lambda s: "p", spec_sha256="x")
    assert founded and study.parent_run_id == "p" and study.counts() == {"WAITING": 2}
    taken = study.next_trial()  # its worker dies now: no heartbeat follows
    assert taken is not None and study.values_of(taken).values == {"seed": 0}
    deadline, taken_over = time.monotonic() + 30, []
    while study.counts().get("RUNNING") and time.monotonic() < deadline:
        time.sleep(0.2)  # polling, until the heartbeat is older than the grace period
        taken_over += study.fail_stale()
    assert study.counts() == {"FAIL": 1, "WAITING": 2}
    assert taken_over == [taken.number]  # its old MLflow run is ended KILLED (SweepStore.kill_taken_over)
    again = [study.next_trial(), study.next_trial()]
    assert {study.values_of(t).index for t in again if t is not None} == {0, 1}  # number 0 kept its number
    assert study.next_trial() is None


def test_a_worker_that_finds_only_silent_running_trials_says_when_to_take_them_over(
    tmp_path: Path, monkeypatch
) -> None:
    """Its trials' workers died within the grace period: it exits non-zero, saying when to run again."""
    from types import SimpleNamespace

    import runner.tools.sweep as sweep_module
    from runner.errors import RunnerError
    from runner.tools.sweep_study import SweepStudy, open_storage
    from runner.tools.sweep_trials import build_definition
    from tests.helpers import wait_for

    definition = build_definition(None, CommandLine(grid=["seed=0,1"]))
    url = f"sqlite:///{tmp_path}/optuna.db"
    study, _ = SweepStudy.open(open_storage(url), url, "s", definition, found=lambda s: "p", spec_sha256="x")
    assert study.next_trial() is not None and study.next_trial() is not None  # both workers die now
    monkeypatch.setattr(sweep_module, "HEARTBEAT_S", 0.05)
    monkeypatch.setattr(sweep_module, "GRACE_S", 60)
    wait_for(lambda: min(study.silent_for()) > 0.3, "the trials' heartbeats to age", timeout_s=30)
    report = SimpleNamespace(definition=SimpleNamespace(metric="m"), best=None, trials=[], notes=[])
    with pytest.raises(RunnerError, match=r"unfinished: 2 trial\(s\) are RUNNING with no heartbeat") as info:
        sweep_module._finish(report, study, store=None, since=0.0)  # type: ignore[arg-type]
    assert info.value.exit_code != 0
    assert "can be taken over 60 s after their last heartbeat, at " in str(info.value) and "run `runner " in str(
        info.value
    )


def test_a_trial_another_worker_ends_just_before_the_last_check_counts_as_finished(tmp_path: Path) -> None:
    """Seen once with two workers on PostgreSQL: every trial COMPLETE, yet the parent run ended FAILED. The worker
    had read the results while the other's last trial still ran, and the pending count after that trial ended."""
    from types import SimpleNamespace

    import runner.tools.sweep as sweep_module
    from runner.tools.sweep_space import SweepReport, TrialResult
    from runner.tools.sweep_study import SweepStudy, open_storage
    from runner.tools.sweep_trials import build_definition

    definition = build_definition(None, CommandLine(grid=["seed=0,1"]))
    url = f"sqlite:///{tmp_path}/optuna.db"
    study, _ = SweepStudy.open(open_storage(url), url, "s", definition, found=lambda s: "p", spec_sha256="x")
    mine, theirs = study.next_trial(), study.next_trial()
    assert mine is not None and theirs is not None
    study.tell(mine, TrialResult(0, {"seed": 0}, "run0", "FINISHED", 0.5))
    report = SweepReport(definition, study.results(), parent_run_id="p", tracking_uri="", experiment="e")
    # read as the worker read them before the fix: "theirs" still runs
    assert [t.status for t in report.trials] == ["FINISHED", "RUNNING"]
    study.tell(theirs, TrialResult(1, {"seed": 1}, "run1", "FINISHED", 0.4))  # the other worker ends its trial
    ended: list[tuple[str, str | None]] = []
    store = SimpleNamespace(end=lambda run_id, status, error, *_: ended.append((status, error)))
    sweep_module._finish(report, study, store, since=0.0)  # type: ignore[arg-type]
    assert ended == [("FINISHED", None)] and [t.status for t in report.trials] == ["FINISHED", "FINISHED"]

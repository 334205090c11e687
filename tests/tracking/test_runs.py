"""Tests of runner.tracking.runs and runner.tracking.tags against a throw-away sqlite MLflow store (CPU, no server)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest
from mlflow.exceptions import MlflowException

import runner
from runner.errors import TrackingError
from runner.spec.loading import load_spec
from runner.tracking import runs as tracking
from runner.tracking.runs import (
    RunRecord,
    TrackedRun,
    start_run,
)
from runner.tracking.stored import continuable_runs

SPEC = """\
name = "demo"
description = "a test run"
seed = 1
tags = { team = "vision" }

[model]
name = "mlp"
kwargs = { hidden = [32, 16] }

[data]
dataset = "synthetic"
batch_size = 8

[optim]
lr = 1.0

[tracking]
experiment = "exp-demo"
"""

PLAN = {
    "accelerator": "cpu",
    "mode": "none",
    "devices": [{"id": 0, "name": "Fake GPU A"}, {"id": 1, "name": "Fake GPU B"}],
    "world_size": 1,
    "threads_per_process": 3,
}

needs_git = pytest.mark.skipif(shutil.which("git") is None, reason="needs the git executable")


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch, tmp_path, git_identity):
    """Restore MLFLOW_* variables, isolate git config, and keep MLflow's ./mlruns inside tmp_path."""
    for key in list(os.environ):
        if key.startswith("MLFLOW_"):
            monkeypatch.delenv(key)
    work = tmp_path / "cwd"
    work.mkdir()
    monkeypatch.chdir(work)
    yield
    import mlflow

    while mlflow.active_run() is not None:
        mlflow.end_run()


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout


def write_spec(folder: Path, text: str = SPEC, name: str = "demo.toml") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(text)
    return path


def make_repo(root: Path, text: str = SPEC) -> Path:
    """A committed git repo holding experiments/demo.toml; returns the spec path."""
    spec_path = write_spec(root / "experiments", text)
    git(root, "init", "-q", "-b", "main")
    git(root, "add", "-A")
    git(root, "commit", "-q", "-m", "init")
    return spec_path


def artifact_paths(client, run_id: str, path: str | None = None) -> set[str]:
    out: set[str] = set()
    for f in client.list_artifacts(run_id, path):
        out |= artifact_paths(client, run_id, f.path) if f.is_dir else {f.path}
    return out


def read_artifact(client, run_id: str, path: str, tmp_path: Path) -> str:
    dst = tmp_path / "dl"
    dst.mkdir(exist_ok=True)
    return Path(client.download_artifacts(run_id, path, str(dst))).read_text()


def new_run(client) -> str:
    exp = client.create_experiment(f"e{time.monotonic_ns()}")
    return client.create_run(exp).info.run_id


# --------------------------------------------------------------------------- start_run


@needs_git
def test_start_run_records_params_tags_and_artifacts(tmp_path, uri, client, monkeypatch):
    spec_path = make_repo(tmp_path / "repo")
    other = tmp_path / "other-repo"  # the cwd is a different repository
    other.mkdir()
    git(other, "init", "-q")
    monkeypatch.chdir(other)
    loaded = load_spec(spec_path)

    handle = start_run(loaded, PLAN, uri=uri)

    assert isinstance(handle, RunRecord) and handle.status == "RUNNING"
    exp = client.get_experiment_by_name("exp-demo")
    assert exp is not None and exp.experiment_id == handle.experiment_id and handle.experiment == "exp-demo"
    runs = client.search_runs([exp.experiment_id])
    assert [r.info.run_id for r in runs] == [handle.run_id]
    run = runs[0]
    assert run.info.status == "RUNNING"

    params = run.data.params
    assert params["name"] == "demo"
    assert params["seed"] == "1"
    assert params["optim.lr"] == "1.0"
    assert params["runner.threads_per_process"] == "3"
    assert params["data.batch_size"] == "8"
    assert params["data.shuffle"] == "true"
    assert params["model.kwargs.hidden"] == "[32, 16]"
    assert params["tracking.experiment"] == "exp-demo"

    tags = run.data.tags
    assert tags["mlflow.source.git.commit"] == git(spec_path.parent, "rev-parse", "HEAD").strip()
    assert tags["runner.git.branch"] == "main"
    assert tags["runner.git.dirty"] == "false"
    assert tags["runner.spec.path"] == "experiments/demo.toml"
    assert tags["runner.spec.sha256"] == loaded.sha256
    assert tags["runner.torch_version"]
    assert tags["runner.version"] == runner.__version__
    cuda = tags["runner.cuda_version"]  # a CPU plan: the torch build's CUDA, said to be only that
    assert cuda == "none" or cuda.endswith(" (torch build; no GPU used)"), cuda
    assert tags["runner.devices"] == "Fake GPU A, Fake GPU B"
    assert tags["runner.world_size"] == "1"
    assert tags["runner.hostname"] == socket.gethostname()
    assert tags["mlflow.note.content"] == "a test run"
    assert tags["team"] == "vision"
    assert "mlflow.parentRunId" not in tags

    assert artifact_paths(client, handle.run_id) == {"spec/demo.toml", "spec/resolved.toml", "spec/plan.json"}
    assert read_artifact(client, handle.run_id, "spec/demo.toml", tmp_path) == SPEC
    assert 'name = "demo"' in read_artifact(client, handle.run_id, "spec/resolved.toml", tmp_path)
    assert '"Fake GPU A"' in read_artifact(client, handle.run_id, "spec/plan.json", tmp_path)


@needs_git
def test_start_run_dirty_repository_logs_diff(tmp_path, uri, client):
    spec_path = make_repo(tmp_path / "repo")
    (spec_path.parent.parent / "train_helper.py").write_text("untracked = True\n")
    spec_path.write_text(SPEC.replace("lr = 1.0", "lr = 0.5"))
    handle = start_run(load_spec(spec_path), PLAN, run_name="r1", extra_tags={"team": "override"}, uri=uri)

    run = client.get_run(handle.run_id)
    assert run.data.tags["runner.git.dirty"] == "true"
    assert run.data.tags["runner.git.untracked_files"] == "1"
    assert run.data.tags["team"] == "override"
    assert run.info.run_name == "r1" and handle.run_name == "r1"
    assert run.data.params["optim.lr"] == "0.5"
    arts = artifact_paths(client, handle.run_id)
    assert {"git/diff.patch", "git/untracked.txt"} <= arts
    diff = read_artifact(client, handle.run_id, "git/diff.patch", tmp_path)
    assert "-lr = 1.0" in diff and "+lr = 0.5" in diff
    assert "train_helper.py" in read_artifact(client, handle.run_id, "git/untracked.txt", tmp_path)


def test_start_run_outside_git_and_experiment_reuse(tmp_path, uri, client):
    spec_path = write_spec(tmp_path / "loose")
    loaded = load_spec(spec_path)
    first = start_run(loaded, {}, uri=uri)
    second = start_run(loaded, {}, uri=uri)
    assert first.experiment_id == second.experiment_id and first.run_id != second.run_id
    tags = client.get_run(first.run_id).data.tags
    assert tags["runner.spec.path"] == str(spec_path.resolve())
    assert "mlflow.source.git.commit" not in tags and "runner.git.dirty" not in tags
    assert not any(p.startswith("git/") for p in artifact_paths(client, first.run_id))


def test_artifacts_lie_beside_the_sqlite_store_not_in_the_current_folder(tmp_path, uri, client):
    """The store is in tmp_path, the run starts in tmp_path/cwd: its files go to tmp_path/mlartifacts/<experiment>."""
    handle = start_run(load_spec(write_spec(tmp_path / "loose")), {}, uri=uri)
    assert not (Path.cwd() / "mlruns").exists()
    expected = tmp_path / "mlartifacts" / "exp-demo"
    assert client.get_experiment(handle.experiment_id).artifact_location == expected.as_uri()
    assert (expected / handle.run_id / "artifacts" / "spec" / "demo.toml").is_file()
    assert tracking.experiment_artifact_location("http://127.0.0.1:5000", "x") is None


def test_names_that_clean_alike_get_folders_of_their_own(tmp_path, uri):
    """``a b`` and ``a_b`` would both clean to ``a_b``: a cleaned name carries a hash of the name."""
    where = {n: tracking.experiment_artifact_location(uri, n) for n in ("a b", "a_b", "a/b", "a b/../c")}
    assert len(set(where.values())) == len(where)
    assert where["a_b"] == (tmp_path / "mlartifacts" / "a_b").as_uri()  # a safe name is its own folder
    assert where["a b"] == (tmp_path / "mlartifacts" / "a_b-c8687a08").as_uri()
    assert where["a b/../c"] == (tmp_path / "mlartifacts" / "a_b_.._c-0e3f70c6").as_uri()


def test_existing_experiment_keeps_its_artifact_location(tmp_path, uri, client):
    own = tmp_path / "elsewhere"
    client.create_experiment("exp-demo", artifact_location=own.as_uri())
    handle = start_run(load_spec(write_spec(tmp_path / "loose")), {}, uri=uri)
    assert (own / handle.run_id / "artifacts" / "spec" / "demo.toml").is_file()
    assert not (tmp_path / "mlartifacts").exists()


def test_experiments_carry_the_training_kind_and_keep_a_kind_of_their_own(tmp_path, uri, client):
    """MLflow 3 opens an experiment in its training view only with mlflow.experimentKind set."""
    client.create_experiment("old")  # made before runner set the kind: the next run writes it
    client.create_experiment("mine", tags={"mlflow.experimentKind": "genai_development"})
    for name in ("new", "old", "mine"):
        tracking.ensure_experiment(client, name, uri)
    kinds = {n: client.get_experiment_by_name(n).tags.get("mlflow.experimentKind") for n in ("new", "old", "mine")}
    assert kinds == {"new": "custom_model_development", "old": "custom_model_development", "mine": "genai_development"}


def test_start_run_defaults_experiment_to_spec_name(tmp_path, uri, client):
    spec_path = write_spec(tmp_path / "loose", SPEC.replace('experiment = "exp-demo"', 'run_name = "from-spec"'))
    handle = start_run(load_spec(spec_path), {}, uri=uri)
    assert handle.experiment == "demo"
    assert client.get_run(handle.run_id).info.run_name == "from-spec"


def test_start_run_deleted_experiment_is_a_clear_error(tmp_path, uri, client):
    client.delete_experiment(client.create_experiment("exp-demo"))
    with pytest.raises(TrackingError, match="is deleted"):
        start_run(load_spec(write_spec(tmp_path / "loose")), {}, uri=uri)


def test_start_run_truncates_long_params(tmp_path, uri, client):
    from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH

    blob = "x" * 10_000
    text = SPEC.replace("kwargs = { hidden = [32, 16] }", f'kwargs = {{ blob = "{blob}" }}')
    handle = start_run(load_spec(write_spec(tmp_path / "loose", text)), {}, uri=uri)
    value = client.get_run(handle.run_id).data.params["model.kwargs.blob"]
    assert len(value) <= MAX_PARAM_VAL_LENGTH
    assert value.startswith("xxxx") and "truncated from 10000 chars" in value and "resolved.toml" in value
    assert blob in read_artifact(client, handle.run_id, "spec/resolved.toml", tmp_path)


def test_start_run_with_active_fluent_run(tmp_path, uri, client, monkeypatch):
    import mlflow

    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    loaded = load_spec(write_spec(tmp_path / "loose"))
    with mlflow.start_run() as outer:
        with pytest.raises(TrackingError, match=r"already active.*mlflow\.end_run\(\).*nested=True") as err:
            start_run(loaded, {}, uri=uri)
        assert outer.info.run_id in str(err.value)
        child = start_run(loaded, {}, uri=uri, nested=True)
        assert mlflow.active_run().info.run_id == outer.info.run_id  # the fluent stack is untouched
    assert client.get_run(child.run_id).data.tags["mlflow.parentRunId"] == outer.info.run_id
    # only the outer run and the nested child exist: the refused call created nothing
    exp = client.get_experiment_by_name("exp-demo")
    assert [r.info.run_id for r in client.search_runs([exp.experiment_id])] == [child.run_id]


def test_start_run_unreachable_store_creates_nothing(tmp_path):
    loaded = load_spec(write_spec(tmp_path / "loose"))
    with pytest.raises(TrackingError):
        start_run(loaded, {}, uri=f"sqlite:///{tmp_path}/missing/mlflow.db")
    assert not (tmp_path / "missing").exists()


# --------------------------------------------------------------------------- end_run


def test_end_run_finished_and_failed(tmp_path, uri, client):
    ok = new_run(client)
    TrackedRun(uri, ok).end("FINISHED")
    run = client.get_run(ok)
    assert run.info.status == "FINISHED" and run.info.end_time
    assert "runner.error" not in run.data.tags

    bad = new_run(client)
    error = "Traceback (most recent call last):\n" + "  frame\n" * 500 + "RuntimeError: loss is nan"
    TrackedRun(uri, bad).end("FAILED", error=error)
    run = client.get_run(bad)
    assert run.info.status == "FAILED"
    assert run.data.tags["runner.error"] == "RuntimeError: loss is nan"  # the line that names it, for the column
    remark = run.data.tags["mlflow.note.content"]  # both ends of the traceback, on the run's page
    assert remark.startswith("#### runner\n**error**:\n```\nTraceback") and remark.endswith("loss is nan\n```")
    assert "chars cut; full text in artifact error.txt" in remark and len(remark) < 1100
    assert read_artifact(client, bad, "error.txt", tmp_path).strip() == error

    killed = new_run(client)
    TrackedRun(uri, killed).end("KILLED", error="interrupted by signal 2")
    assert client.get_run(killed).info.status == "KILLED"
    assert client.get_run(killed).data.tags["runner.error"] == "interrupted by signal 2"


def test_end_run_errors(uri, client):
    with pytest.raises(ValueError, match="FINISHED"):
        TrackedRun(uri, new_run(client)).end("DONE")
    with pytest.raises(TrackingError, match="could not end"):
        TrackedRun(uri, "f" * 32).end("FINISHED")


def test_module_import_is_light():
    code = (
        "import importlib, pkgutil, sys, runner.tracking as t\n"
        "names = [m.name for m in pkgutil.iter_modules(t.__path__, 'runner.tracking.')]\n"
        "for name in names: importlib.import_module(name)\n"
        "assert 'runner.tracking.runs' in names and 'runner.tracking.stored' in names, names\n"
        "heavy = [m for m in ('mlflow', 'torch') if m in sys.modules]\n"
        "assert not heavy, heavy"
    )
    subprocess.run([os.sys.executable, "-c", code], check=True)


def test_start_run_fails_before_creating_anything_when_spec_cannot_be_dumped(tmp_path, uri, client, monkeypatch):
    loaded = load_spec(write_spec(tmp_path / "loose"))

    def boom(spec):
        raise RuntimeError("cannot dump")

    monkeypatch.setattr("runner.spec.dump.dump_spec", boom)
    with pytest.raises(RuntimeError):
        start_run(loaded, {}, uri=uri)
    assert client.get_experiment_by_name("exp-demo") is None


def test_start_run_marks_run_failed_when_recording_fails(tmp_path, uri, client, monkeypatch):
    from mlflow.tracking import MlflowClient

    loaded = load_spec(write_spec(tmp_path / "loose"))

    def broken_log_text(self, run_id, text, artifact_file):
        raise OSError("disk full")

    monkeypatch.setattr(MlflowClient, "log_text", broken_log_text)
    with pytest.raises(TrackingError, match="disk full"):
        start_run(loaded, {}, uri=uri)
    exp = client.get_experiment_by_name("exp-demo")
    (run,) = client.search_runs([exp.experiment_id])
    assert run.info.status == "FAILED"


# --------------------------------------------------------------------------- looking runs up, reopening


def test_run_lookups_reopen_and_delete(tmp_path, uri, client):
    loaded = load_spec(write_spec(tmp_path / "loose"))
    assert continuable_runs(uri, "exp-demo") == []  # no such experiment yet
    first = start_run(loaded, {}, uri=uri).run_id
    parent = start_run(loaded, {}, uri=uri, extra_tags={"runner.sweep": "parent"}).run_id
    start_run(loaded, {}, uri=uri, extra_tags={"mlflow.parentRunId": parent})
    start_run(loaded, {}, uri=uri, extra_tags={"runner.bench": "parent"})
    TrackedRun(uri, start_run(loaded, {}, uri=uri).run_id).end("FINISHED")
    # sweep and bench parents, child runs and FINISHED runs are not candidates
    assert [r.run_id for r in continuable_runs(uri, "exp-demo")] == [first]

    assert TrackedRun(uri, first).find() is not None and TrackedRun(uri, "0" * 32).find() is None
    assert TrackedRun(uri, first).find().status == "RUNNING"  # type: ignore[union-attr]
    client.log_metric(first, "train/loss", 1.0, step=3)
    client.log_metric(first, "train/loss", 0.5, step=7)
    client.log_metric(first, "val/loss", 0.9, step=5)
    assert TrackedRun(uri, first).last_logged_steps() == {"train/loss": 7, "val/loss": 5}
    assert TrackedRun(uri, parent).last_logged_steps() == {}

    TrackedRun(uri, first).end("KILLED")
    TrackedRun(uri, first).reopen(spec_change=json.dumps({"train.epochs": [1, 2]}))
    TrackedRun(uri, first).reopen()
    run = client.get_run(first)
    assert run.info.status == "RUNNING" and run.data.tags["runner.resume.count"] == "2"
    assert json.loads(run.data.tags["runner.resume.spec_change"]) == {"train.epochs": [1, 2]}
    with pytest.raises(TrackingError, match="could not reopen"):
        TrackedRun(uri, "0" * 32).reopen()

    artifacts = Path(client.get_run(first).info.artifact_uri.removeprefix("file://"))
    assert artifacts.is_dir()
    TrackedRun(uri, first).delete()
    assert TrackedRun(uri, first).find() is None
    with pytest.raises(MlflowException):  # purged, as `mlflow gc` would, not only marked deleted
        client.get_run(first)
    assert not artifacts.exists()
    with pytest.raises(TrackingError, match="could not delete"):
        TrackedRun(uri, "0" * 32).delete()


def test_a_store_error_reading_a_run_is_not_mistaken_for_no_such_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """find_run once answered ``None`` for any MLflow error: a server's 500 read as "no such run"."""

    class Failing:
        def get_run(self, run_id: str) -> None:
            raise MlflowException("the database is locked", error_code="INTERNAL_ERROR")

    monkeypatch.setattr(tracking, "client_for", lambda uri: Failing())
    with pytest.raises(
        TrackingError, match="could not read MLflow run r1 at http://127.0.0.1:1: the database is locked"
    ):
        tracking.TrackedRun("http://127.0.0.1:1", "r1").find()
    with pytest.raises(TrackingError):
        tracking.TrackedRun("http://127.0.0.1:1", "r1").record()

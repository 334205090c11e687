"""Comparisons you can trust: the fixed split and its fingerprint, dataset inputs, the logged model, and
resume / reproduce / diff from a run id alone (the interrupted run's message works as printed)."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient

from runner.cli import main
from runner.spec.loading import load_spec
from runner.training.checkpoint import load_latest
from runner.training.data import build_datasets
from runner.training.shards import whole_model
from tests.helpers import ASSETS, write_spec_file

pytestmark = [pytest.mark.integration, pytest.mark.created_store, pytest.mark.timeout(300)]

REPO = Path(__file__).parents[2]
KEYS = ("train/loss", "train/epoch_loss", "train/accuracy", "val/loss", "val/accuracy", "lr")


def runs(store: str, experiment: str = "tests") -> list:
    client = MlflowClient(store)
    exp = client.get_experiment_by_name(experiment)
    return client.search_runs([exp.experiment_id], order_by=["attributes.start_time ASC"]) if exp else []


def histories(store: str, run_id: str) -> dict[str, list[tuple[int, float]]]:
    client = MlflowClient(store)
    return {k: [(m.step, m.value) for m in client.get_metric_history(run_id, k)] for k in KEYS}


def exec_ok(store: str, *args: str) -> str:
    """``runner exec`` in this process; the id of the run it made in ``store``."""
    assert main(["exec", *args]) == 0
    return str(runs(store)[-1].info.run_id)


# ----------------------------------------------------------------------------- the split, the datasets


def test_seeds_share_the_validation_split_and_the_runs_say_so(write_spec, store: str) -> None:
    spec = str(write_spec())
    first, second = exec_ok(store, spec, "--set", "seed=0"), exec_ok(store, spec, "--set", "seed=1")
    other = exec_ok(store, spec, "--set", "data.split_seed=5")
    again = exec_ok(store, spec, "--set", "seed=0")
    client = MlflowClient(store)

    def losses(run: str) -> list[tuple[int, float]]:
        return [(m.step, m.value) for m in client.get_metric_history(run, "train/loss")]

    assert losses(first) == losses(again) != losses(second)  # the same seed, the same metrics; another differs
    tag = {r: client.get_run(r).data.tags["runner.data.val_split_sha256"] for r in (first, second, other)}
    assert tag[first] == tag[second] != tag[other]
    loaded = load_spec(spec)
    bundle = build_datasets(loaded.spec, loaded.path.parent)
    assert tag[first] == bundle.info.val_split_sha256 and len(tag[first]) == 64
    inputs = client.get_run(first).inputs.dataset_inputs
    rows = {(d.dataset.name, d.tags[0].value): json.loads(d.dataset.profile)["num_rows"] for d in inputs}
    assert rows == {("synthetic train", "training"): 72, ("synthetic val", "validation"): 24}

    def digests(run: str) -> dict[str, str]:
        return {d.dataset.name: d.dataset.digest for d in client.get_run(run).inputs.dataset_inputs}

    assert digests(first) == digests(second) != digests(other)
    assert client.get_run(first).info.run_name == "t none-1 seed=0"
    assert client.get_run(first).data.tags["runner.overrides"] == "--set seed=0"


def test_exec_prints_and_records_what_runs_instead_of_a_value_that_cannot_apply(write_spec, store: str, capsys) -> None:
    run_id = exec_ok(store, str(write_spec()), "--set", "devices.ids=[0, 1]", "--set", "train.epochs=1")
    note = "devices.ids = [0, 1] is ignored: the run is on cpu"
    assert f"runner: note: {note}" in capsys.readouterr().err
    assert MlflowClient(store).get_run(run_id).data.tags["runner.notes"] == note


def test_the_logged_model_is_a_logged_model_with_the_normalisation_inside(tmp_path: Path, store: str) -> None:
    spec = tmp_path / "digits.toml"
    base = REPO / "experiments" / "digits_mlp.toml"
    spec.write_text(
        f'extends = "{base}"\n[tracking]\nuri = "{store}"\nexperiment = "tests"\nlog_model = true\n'
        'system_metrics = true\n[checkpoint]\nlog_to_mlflow = true\n[train]\nepochs = 1\nprogress = "off"\n'
    )
    run_id = exec_ok(store, str(spec))
    client = MlflowClient(store)
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and "model/MLmodel" in {a.path for a in client.list_artifacts(run_id, "model")}
    assert [a.path for a in client.list_artifacts(run_id, "checkpoints")] == ["checkpoints/step-00000023"]
    (model,) = client.search_logged_models([run.info.experiment_id])
    assert (
        model.source_run_id == run_id and model.name == "model" and model.params["optim.lr"] == "0.2"
    )  # experiments/base/digits.toml
    linked = {m.key: m.value for m in model.metrics or []}
    assert linked["val/accuracy"] == pytest.approx(run.data.metrics["val/accuracy"])  # linked to the run's metrics
    import mlflow

    mlflow.set_tracking_uri(store)  # models:/ URIs resolve in the fluent API's store: this test's, whatever ran before
    try:
        info = mlflow.models.get_model_info(f"models:/{model.model_id}")
        loaded_model = mlflow.pytorch.load_model(f"models:/{model.model_id}")
        from_run = mlflow.pytorch.load_model(f"runs:/{run_id}/model")  # the run's artifact path works as well
    finally:
        mlflow.set_tracking_uri(None)
    assert info.signature.inputs.inputs[0].shape == (-1, 1, 8, 8) and info.saved_input_example_info is not None
    assert from_run(torch.zeros(2, 1, 8, 8)).shape == (2, 10)
    bundle = build_datasets(load_spec(spec).spec, spec.parent)
    mean, std = bundle.info.normalization
    raw = bundle.val.x * std + mean  # pixels in [0, 1], as sklearn's digits / 16
    assert float(raw.min()) >= -1e-6 and float(raw.max()) <= 1 + 1e-6
    with torch.no_grad():
        accuracy = (loaded_model(raw).argmax(1) == bundle.val.y).float().mean().item()
    assert accuracy == pytest.approx(run.data.metrics["val/accuracy"], abs=1e-6)


# ----------------------------------------------------------------------------- resume, from the printed command


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PROBE_")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    return {**env, **extra}


def _slow_spec(tmp_path: Path, store: str) -> Path:
    """Three epochs of ``helpers.MINIMAL`` with the probe model (it marks step 6 when asked, then takes its time)."""
    shutil.copyfile(ASSETS / "probe_factory.py", tmp_path / "probe_factory.py")
    model = {"name": "probe_factory:build", "kwargs": {"in_features": 8, "num_classes": 3}}
    return write_spec_file(tmp_path / "spec.toml", model=model, train={"epochs": 3}, tracking={"uri": store})


def test_the_interrupt_message_is_runner_resume_and_works_as_printed(store: str, tmp_path: Path) -> None:
    spec = _slow_spec(tmp_path, store)
    sets = ["--set", "optim.lr=0.05", "--set", "seed=4"]  # the printed command must keep them
    full = subprocess.run(
        [sys.executable, "-m", "runner", "exec", str(spec), *sets],
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
    )
    assert full.returncode == 0, full.stderr
    marker = tmp_path / "marker"
    proc = subprocess.Popen(
        [sys.executable, "-m", "runner", "exec", str(spec), *sets],
        cwd=tmp_path,
        env=_env(PROBE_MARKER=str(marker), PROBE_AT="6"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 120
    while not marker.exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 130, out
    complete, stopped = runs(store)
    line = next(x for x in out.splitlines() if "Continue it with: " in x)
    printed = line.split("Continue it with: ", 1)[1].strip()
    assert printed == f"runner resume {stopped.info.run_id}"
    resumed = subprocess.run(
        [sys.executable, "-m", *shlex.split(printed)], cwd=tmp_path, env=_env(), capture_output=True, text=True
    )
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "resuming from step-" in resumed.stderr  # a note, before training
    assert len(runs(store)) == 2  # the same run continued
    again = MlflowClient(store).get_run(stopped.info.run_id)
    assert again.info.status == "FINISHED" and again.data.params["optim.lr"] == "0.05"
    assert histories(store, stopped.info.run_id) == histories(store, complete.info.run_id)
    folder = Path(store[len("sqlite:///") :]).parent / "checkpoints"
    finals = [load_latest(folder / run.info.run_id) for run in (complete, stopped)]
    assert finals[0] is not None and finals[1] is not None
    a, b = whole_model(finals[0].path), whole_model(finals[1].path)
    assert (
        a.keys() == b.keys() and a and all(torch.equal(a[key], b[key]) for key in a)
    )  # the resumed model, bit for bit


def test_resume_refuses_finished_unknown_and_foreign_runs(write_spec, store: str, tmp_path: Path, capsys) -> None:
    finished = exec_ok(store, str(write_spec()), "--set", "train.epochs=1")
    _export_replaces_only_a_regular_file(finished, tmp_path, capsys)
    capsys.readouterr()
    assert main(["resume", finished]) == 2
    assert f"run {finished} at {store} already FINISHED" in capsys.readouterr().err
    client = MlflowClient(store)
    foreign = client.create_run(client.get_experiment_by_name("tests").experiment_id).info.run_id
    for command in (["resume"], ["reproduce"], ["diff", finished]):
        assert main([*command, "f" * 32]) == 2
        err = capsys.readouterr().err
        assert f"no run {'f' * 32} at {store}" in err and "Traceback" not in err
        assert main([*command, foreign]) == 2
        assert f"run {foreign} at {store} has no spec stored by runner" in capsys.readouterr().err
    assert main(["resume", finished, "--tracking-uri", f"{store}-missing"]) == 2
    assert "there is no tracking store there" in capsys.readouterr().err


def _export_replaces_only_a_regular_file(run_id: str, tmp_path: Path, capsys) -> None:
    """``runner export --out`` refuses a folder, a link, a FIFO and a device, and leaves no partial file; past a newer
    damaged checkpoint it exports the last good one and names the one it skipped."""
    capsys.readouterr()
    folder, fifo, link, plain = tmp_path / "folder", tmp_path / "fifo", tmp_path / "link", tmp_path / "plain.pt"
    folder.mkdir()
    os.mkfifo(fifo)
    plain.write_text("old")
    link.symlink_to(plain)
    refused = {folder: "is a folder", fifo: "is not a regular file", link: "is a link"}
    refused |= {Path("/dev/null"): "is not a regular file", plain / "x.pt": "cannot write there"}
    for out, says in refused.items():
        assert main(["export", run_id, "--out", str(out)]) == 2, out
        err = capsys.readouterr().err
        assert f"--out {out}" in err and says in err and "Traceback" not in err, err
    assert folder.is_dir() and not any(folder.iterdir()) and fifo.is_fifo() and link.is_symlink()
    assert Path("/dev/null").is_char_device() and plain.read_text() == "old"
    assert not list(tmp_path.glob(".*.partial")), list(tmp_path.iterdir())
    assert main(["export", run_id, "--out", str(plain)]) == 0  # a regular file is replaced
    assert torch.load(plain, weights_only=True).keys()
    capsys.readouterr()
    newest = max(p for p in (tmp_path / "checkpoints" / run_id).iterdir() if p.is_dir())
    damaged = newest.with_name("step-99999999")  # a newer checkpoint, damaged: export names it and uses the last good
    shutil.copytree(newest, damaged)
    shutil.copyfile(f"{newest}.sha256", f"{damaged}.sha256")
    (damaged / "meta.pt").write_bytes(b"not a checkpoint")
    assert main(["export", run_id, "--out", str(plain)]) == 0
    out = capsys.readouterr().out
    assert f"(from {newest.name})" in out and f"\nnote: skipped {damaged}: damaged: " in out, out


# ----------------------------------------------------------------------------- reproduce, diff


def _git(repo: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True)


def test_reproduce_repeats_the_metric_history_and_warns_when_the_code_moved(
    write_spec, store: str, tmp_path: Path, capsys, git_identity
) -> None:
    spec = write_spec()
    _git(tmp_path, "init", "-q", "-b", "main")
    (tmp_path / ".gitignore").write_text("mlflow.db*\ncheckpoints/\n")
    _git(tmp_path, "add", "spec.toml", ".gitignore")
    _git(tmp_path, "commit", "-q", "-m", "spec")
    original = exec_ok(store, str(spec), "--set", "optim.lr=0.05")
    (tmp_path / "later.txt").write_text("a change\n")
    _git(tmp_path, "add", "later.txt")
    _git(tmp_path, "commit", "-q", "-m", "later")
    capsys.readouterr()
    assert main(["reproduce", original]) == 0
    err = capsys.readouterr().err
    assert "runner: warning: git commit differs: the run used" in err
    first, copy = runs(store)
    assert first.info.run_id == original
    assert copy.data.tags["runner.reproduced_from"] == original
    assert copy.info.run_name == f"{first.info.run_name} (reproduced)" == "t none-1 lr=0.05 (reproduced)"
    assert copy.data.params == first.data.params
    assert histories(store, copy.info.run_id) == histories(store, original)
    assert all(histories(store, original)[k] for k in KEYS)
    capsys.readouterr()
    assert main(["diff", original, copy.info.run_id, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    commits = [first.data.tags["mlflow.source.git.commit"], copy.data.tags["mlflow.source.git.commit"]]
    assert result["git"] == {"commit": commits} and commits[0] != commits[1]
    assert result["commits"] == [f"{c[:12]} clean" for c in commits] and result["spec"] == {}


def test_diff_names_the_keys_commits_and_environment_that_differ(write_spec, store: str, capsys) -> None:
    spec = str(write_spec())
    a = exec_ok(store, spec, "--set", "train.epochs=1")
    b = exec_ok(store, spec, "--set", "train.epochs=1", "--set", "optim.lr=0.05", "--set", 'parallel.mode="ddp"')
    capsys.readouterr()
    assert main(["diff", a, b, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["spec"] == {"parallel.mode": ["none", "ddp"], "optim.lr": [0.1, 0.05]}
    assert result["git"] == {} and result["environment"] == {} and result["commits"] == ["no git commit"] * 2
    assert result["a"].startswith(f"run {a} (t none-1 epochs=1)")
    assert main(["diff", a, spec]) == 0
    text = capsys.readouterr().out
    assert text.splitlines()[:2] == [f"A: run {a} (t none-1 epochs=1)", f"B: spec {spec}"]
    assert "spec: 1 difference(s)" in text and "train.epochs  1  2" in text
    assert "commits: A no git commit, B no git commit (same)" in text
    assert "git: same" in text and "environment: same" in text
    assert main(["diff", a, "nope.toml"]) == 2
    assert "nope.toml: spec file not found" in capsys.readouterr().err


def test_diff_names_the_user_files_that_differ_outside_git(write_spec, store: str, tmp_path: Path, capsys) -> None:
    # "git: same" said nothing for two runs whose model code differed in a folder that is no repository
    source = "from torch import nn\n\n\ndef build(in_features, num_classes):\n    return nn.Linear(in_features, num_classes)\n"
    (tmp_path / "user_net.py").write_text(source, encoding="utf-8")
    spec = str(write_spec())
    model = ["--set", 'model={name="user_net:build", kwargs={in_features=8, num_classes=3}}', "--set", "train.epochs=1"]
    a = exec_ok(store, spec, *model)
    (tmp_path / "user_net.py").write_text(source + "# tuned\n", encoding="utf-8")
    b = exec_ok(store, spec, *model)
    tags = [MlflowClient(store).get_run(run).data.tags["runner.code"] for run in (a, b)]
    assert all(re.fullmatch(r"user_net\.py:[0-9a-f]{12}", tag) for tag in tags) and tags[0] != tags[1]
    capsys.readouterr()
    assert main(["diff", a, b, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["environment"] == {"user code": tags}

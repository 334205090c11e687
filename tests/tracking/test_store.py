"""Tests of runner.tracking.uri: the first open of a sqlite store under its lock, and half-migrated stores refused."""

from __future__ import annotations

import hashlib
import logging
import shutil
import sqlite3
from pathlib import Path

import pytest

from runner.errors import TrackingError
from runner.tracking import uri as store_module
from runner.tracking.uri import open_store


@pytest.fixture(autouse=True)
def _forget_opened(monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> None:
    monkeypatch.setattr(store_module, "_opened", set())
    if request.node.get_closest_marker("integration") is None:  # no other client here: a damaged file is still
        monkeypatch.setattr(store_module, "STILL_S", 0.2)  # at once, not after 2 s of watching it


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_first_open_creates_the_store_beside_its_lock(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    from mlflow.tracking import MlflowClient

    for name in ("mlflow.store.db.utils", "alembic"):  # as in a fresh process: their INFO lines would print
        logging.getLogger(name).setLevel(logging.NOTSET)
    uri = f"sqlite:///{tmp_path}/new.db"
    open_store(uri)
    printed = capfd.readouterr()
    assert "database tables" not in printed.out + printed.err  # MLflow's INFO lines while it makes its tables
    assert (tmp_path / "new.db").is_file() and (tmp_path / "new.db.lock").exists()
    assert MlflowClient(uri).search_experiments()[0].name == "Default"


def _break(path: Path, sql: str) -> None:
    with sqlite3.connect(path) as db:
        db.execute(sql)


@pytest.mark.parametrize(
    ("sql", "found"),
    [
        ("CREATE TABLE _alembic_tmp_experiments (x INTEGER)", "temporary tables _alembic_tmp_experiments"),
        ("DELETE FROM alembic_version", "no schema version"),
    ],
)
def test_a_half_migrated_store_is_refused_with_the_fix_and_left_alone(
    ready_store: str, tmp_path: Path, sql: str, found: str
) -> None:
    from mlflow.tracking import MlflowClient

    uri, path = ready_store, Path(ready_store[len("sqlite:///") :])
    MlflowClient(uri).create_experiment("kept")  # something in it: not a new store to start afresh
    _break(path, sql)
    before = _digest(path)
    with pytest.raises(TrackingError) as info:
        open_store(uri)
    text = str(info.value)
    assert "half-migrated" in text and found in text
    assert f"mv {path} {path}.broken" in text and "holds no run" in text
    assert _digest(path) == before  # never made worse


def test_a_half_migrated_store_with_runs_says_so(ready_store: str) -> None:
    from mlflow.tracking import MlflowClient

    uri = ready_store
    client = MlflowClient(uri)
    client.create_run(client.create_experiment("x"))
    _break(Path(uri[len("sqlite:///") :]), "CREATE TABLE _alembic_tmp_runs (x INTEGER)")
    with pytest.raises(TrackingError, match=r"it holds 1 run\(s\): restore it from a backup"):
        open_store(uri)


def test_a_new_store_that_other_clients_left_half_migrated_and_empty_is_made_whole(ready_store: str) -> None:
    """Two other clients racing each other on a new file broke it before runner came: it holds nothing; replaced."""
    from mlflow.tracking import MlflowClient

    uri, path = ready_store, Path(ready_store[len("sqlite:///") :])
    _break(path, "CREATE TABLE _alembic_tmp_tags (x INTEGER)")
    open_store(uri)
    store_module.refuse_half_migrated(path)  # whole now
    assert [e.name for e in MlflowClient(uri).search_experiments()] == ["Default"]
    assert [p.name for p in path.parent.iterdir() if p.name.endswith(".creating")] == []


def test_a_new_store_that_another_client_breaks_during_runners_open_is_made_whole(
    ready_store: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`mlflow ui` migrating beside runner's first open left the file half-migrated after runner's own open: runner
    told the user to move the new, empty store away (exit 2, 1 try in 6)."""
    from mlflow.tracking import MlflowClient

    uri, path = ready_store, Path(ready_store[len("sqlite:///") :])
    real, opens = store_module._first_open, []

    def raced(target: str, at: Path | None = None) -> None:
        real(target, at)
        opens.append(target)
        if len(opens) == 1:  # the other client's migration step, interleaved with runner's
            _break(path, "CREATE TABLE _alembic_tmp_tags (x INTEGER)")

    monkeypatch.setattr(store_module, "_first_open", raced)
    monkeypatch.setattr(store_module, "wait_until_still", lambda *a, **k: True)
    open_store(uri)
    store_module.refuse_half_migrated(path)  # whole now
    assert [e.name for e in MlflowClient(uri).search_experiments()] == ["Default"]


def test_a_file_that_appears_while_runner_makes_its_store_aside_is_kept_not_replaced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Replacing a new file another client is migrating paired its journal with runner's file: "disk I/O error"."""
    uri, path = f"sqlite:///{tmp_path}/s.db", tmp_path / "s.db"
    path.write_bytes(b"")  # another client's new file, created while runner migrated its own aside
    store_module._create_aside(uri, path)
    assert path.stat().st_size == 0  # kept: opened as it is once still
    store_module._create_aside(uri, path, replace=True)  # it then proved broken: a second aside in one process
    assert store_module._holds_a_schema(path)
    path.unlink()

    def no_links(source: Path, target: Path) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(store_module.os, "link", no_links)
    store_module._create_aside(uri, path)  # a file system without hard links
    assert store_module._holds_a_schema(path)
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".creating")] == []


def test_exec_on_a_half_migrated_store_exits_2_without_a_traceback(
    write_spec, store: str, _created_store: Path, capsys
) -> None:
    from mlflow.tracking import MlflowClient

    from runner.cli import main

    path = Path(store[len("sqlite:///") :])
    shutil.copyfile(_created_store, path)
    MlflowClient(store).create_experiment("kept")
    _break(path, "CREATE TABLE _alembic_tmp_experiments (x INTEGER)")
    assert main(["exec", str(write_spec())]) == 2
    err = capsys.readouterr().err
    assert "half-migrated" in err and "Traceback" not in err


def test_a_file_that_is_not_sqlite_is_refused(tmp_path: Path) -> None:
    (tmp_path / "m.db").write_text("not a database" * 100)
    with pytest.raises(TrackingError, match="not a readable sqlite database"):
        open_store(f"sqlite:///{tmp_path}/m.db")


@pytest.mark.integration  # starts several processes
@pytest.mark.parametrize("race", ["create", "migrate", "add-column", "column-not-yet"])
def test_another_client_creating_the_tables_at_the_same_moment_is_waited_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, race: str
) -> None:
    """Another process creates the schema while runner's first open runs: CREATE TABLE or a step's ADD COLUMN fails,
    or alembic finds the version row moved under it (seen in CI: four runs and two clients on one new file), then the
    open works."""
    import subprocess
    import sys

    import mlflow.store.db.utils as db_utils
    from alembic.util import CommandError
    from sqlalchemy.exc import OperationalError

    moved = "Online migration expected to match one row when updating 'a' to 'b' in 'alembic_version'; 0 found"
    exists = OperationalError("CREATE TABLE experiments (...)", {}, Exception("table experiments already exists"))
    added = OperationalError("ALTER TABLE runs ADD COLUMN x", {}, Exception("duplicate column name: x"))
    unmigrated = AttributeError("dimension_attributes")  # `mlflow ui` migrating beside runner's first open
    error = {"create": exists, "migrate": CommandError(moved), "add-column": added, "column-not-yet": unmigrated}[race]

    uri = f"sqlite:///{tmp_path}/fresh.db"
    real, calls = db_utils._initialize_tables, []

    def raced(engine) -> None:
        calls.append(1)
        if len(calls) == 1:  # the other client (not under runner's lock) creates every table first
            code = f"from mlflow.tracking import MlflowClient; MlflowClient({uri!r}).search_experiments()"
            subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
            raise error
        real(engine)

    monkeypatch.setattr(db_utils, "_initialize_tables", raced)
    monkeypatch.setattr(store_module.time, "sleep", lambda s: None)
    open_store(uri)
    assert len(calls) == 2  # runner's own schema, made aside, was tried again and completed
    from mlflow.tracking import MlflowClient

    assert MlflowClient(uri).search_experiments()[0].name == "Default"
    store_module.refuse_half_migrated(tmp_path / "fresh.db")


@pytest.mark.integration  # starts several processes
@pytest.mark.timeout(1200)  # about 15 s a try on 2 cores; STORE_RACE_TRIES=20 takes 5 minutes
def test_mlflow_clients_opening_a_store_runner_is_creating_never_break_it(tmp_path: Path) -> None:
    """`runner exec` on a new sqlite file while two other MLflow clients open it (as `mlflow ui` or a notebook do).

    Two alembic migrations of one new sqlite file can break it (seen: 2 tries of 2 asked the user to move
    the store aside). STORE_RACE_TRIES sets the tries (1 here; the note of the change ran 20). The first try's
    clients start once runner has begun to create the store, the next try's at once with it, and so on (at once,
    beside three other runs: tests/launch/test_faults_integration.py).
    """
    import os
    import subprocess
    import sys

    from mlflow.tracking import MlflowClient

    from tests.helpers import REPO, wait_for, write_spec_file

    tries = int(os.environ.get("STORE_RACE_TRIES", "1"))
    spec = write_spec_file(tmp_path / "spec.toml", train={"max_steps": 2}, checkpoint={"enabled": False})
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for attempt in range(tries):
        folder = tmp_path / f"try-{attempt}"
        folder.mkdir()
        uri = f"sqlite:///{folder}/mlflow.db"
        runner = subprocess.Popen(
            [sys.executable, "-m", "runner", "exec", str(spec), "--set", f'tracking.uri="{uri}"'],
            cwd=folder, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        code = f"from mlflow.tracking import MlflowClient; MlflowClient({uri!r}).search_experiments()"
        if attempt % 2 == 0:  # every other try: the others start once runner has begun to create the store
            wait_for(lambda f=folder: any(f.iterdir()), "runner to touch the store", proc=runner)
        others = [subprocess.Popen([sys.executable, "-c", code], env=env) for _ in range(2)]
        out, _ = runner.communicate(timeout=300)
        for other in others:
            other.wait(timeout=300)
        assert runner.returncode == 0, (attempt, out[-2000:])
        (run,) = MlflowClient(uri).search_runs([MlflowClient(uri).get_experiment_by_name("tests").experiment_id])
        assert run.info.status == "FINISHED"
        store_module.refuse_half_migrated(folder / "mlflow.db")


def test_a_store_that_keeps_failing_is_one_line_not_an_sql_dump(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import mlflow.store.db.utils as db_utils
    from sqlalchemy.exc import OperationalError

    def always(engine) -> None:
        raise OperationalError("CREATE TABLE experiments (\n  id INTEGER\n)", {}, Exception("table x already exists"))

    monkeypatch.setattr(db_utils, "_initialize_tables", always)
    monkeypatch.setattr(store_module.time, "sleep", lambda s: None)
    with pytest.raises(TrackingError, match="MLflow cannot open the tracking store") as info:
        open_store(f"sqlite:///{tmp_path}/stuck.db")
    assert "\n" not in str(info.value) and "id INTEGER" not in str(info.value)

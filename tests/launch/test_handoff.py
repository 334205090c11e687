"""runner.launch.handoff: the driver's run reaches the workers in one file, or the news that its checks failed."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from runner.errors import SpecError, SpecIssue
from runner.launch.handoff import Cancelled, HandedRun, Handoff, wait_for_run, write_run_file
from runner.launch.worker import WorkerArgs


def _args(run_id: str | None) -> WorkerArgs:
    return WorkerArgs(
        loaded=None, plan=None, run_id=run_id, tracking_uri=None, checkpoint_dir="/ck/" + str(run_id), resume=True
    )  # type: ignore[arg-type]


def test_the_run_made_on_the_thread_reaches_a_waiting_worker(tmp_path: Path) -> None:
    path = tmp_path / "run.json"
    release = threading.Event()

    def prepare(go_on):
        release.wait(5)
        go_on()
        return _args("a" * 32)

    handoff = Handoff(prepare)
    handoff.start(path)
    seen: list[HandedRun | None] = []
    worker = threading.Thread(target=lambda: seen.append(wait_for_run(path)))
    worker.start()
    assert not path.exists()  # the worker waits while the driver prepares
    release.set()
    worker.join(10)
    assert seen == [HandedRun("a" * 32, "/ck/" + "a" * 32, True)]
    assert handoff.finish() == _args("a" * 32) and handoff.error is None


def test_failed_checks_tell_the_workers_to_end_and_keep_the_error(tmp_path: Path) -> None:
    path = tmp_path / "run.json"
    bad = SpecError([SpecIssue(None, None, "checkpoint.dir", "cannot be created")])

    def prepare(go_on):
        raise bad

    handoff = Handoff(prepare)
    handoff.start(path)
    assert wait_for_run(path) is None
    assert handoff.finish() is None and handoff.error is bad


def test_a_launch_that_ended_first_stops_the_run_from_being_made(tmp_path: Path) -> None:
    made: list[str] = []
    checked = threading.Event()
    release = threading.Event()

    def prepare(go_on):
        checked.set()
        release.wait(5)
        go_on()  # the launch ended meanwhile: no run
        made.append("run")
        return _args("b" * 32)

    handoff = Handoff(prepare)
    handoff.start(tmp_path / "run.json")
    checked.wait(5)
    threading.Timer(0.05, release.set).start()
    assert handoff.finish() is None
    assert isinstance(handoff.error, Cancelled) and made == []


def test_the_file_is_written_whole_or_not_at_all(tmp_path: Path) -> None:
    path = tmp_path / "run.json"
    write_run_file(path, {"run_id": None, "checkpoint_dir": "/c", "resume": False})
    assert [p.name for p in tmp_path.iterdir()] == ["run.json"]  # no part file left beside it
    assert wait_for_run(path) == HandedRun(None, "/c", False)


def test_a_folder_already_removed_is_not_an_error_on_the_thread(tmp_path: Path) -> None:
    handoff = Handoff(lambda go_on: _args(None))
    handoff.start(tmp_path / "gone" / "run.json")
    assert handoff.finish() == _args(None) and handoff.error is None


def test_wait_reads_abort_and_refuses_a_record_without_the_run(tmp_path: Path) -> None:
    path = tmp_path / "run.json"
    write_run_file(path, {"abort": True})
    assert wait_for_run(path) is None
    with pytest.raises(KeyError):
        write_run_file(path, {"run_id": "x"})
        wait_for_run(path)

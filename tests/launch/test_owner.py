"""Run owners: the process recorded on a run, whether it lives, and runs whose owner died marked KILLED."""

from __future__ import annotations

import subprocess
import sys

import pytest
from mlflow.tracking import MlflowClient

from runner.cli import main
from runner.errors import UsageError
from runner.launch.resume import Owner, claim_run, settle


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _run_owned_by(store: str, owner: Owner, status: str = "RUNNING") -> str:
    client = MlflowClient(store)
    experiment = client.get_experiment_by_name("owned")
    eid = experiment.experiment_id if experiment else client.create_experiment("owned")
    run = client.create_run(eid, tags={**owner.tags(), "runner.spec.path": "exp.toml"})
    if status != "RUNNING":
        client.set_terminated(run.info.run_id, status)
    return str(run.info.run_id)


def test_liveness_tells_alive_gone_reused_and_other_host() -> None:
    me = Owner.this_process()
    assert me.liveness() == "alive"
    assert Owner(me.host, _dead_pid(), me.start_time).liveness() == "gone"
    assert Owner(me.host, me.pid, me.start_time - 3600).liveness() == "gone"  # the pid now belongs to another process
    assert Owner("elsewhere.example", me.pid, me.start_time).liveness() == "unknown"
    assert Owner.from_tags(me.tags()) == Owner(me.host, me.pid, round(me.start_time, 2))
    assert Owner.from_tags({"runner.owner.pid": "x"}) is None


def test_a_running_run_whose_owner_died_is_marked_killed(ready_store: str) -> None:
    me = Owner.this_process()
    orphan = _run_owned_by(ready_store, Owner(me.host, _dead_pid(), me.start_time))
    alive = _run_owned_by(ready_store, me)
    remote = _run_owned_by(ready_store, Owner("elsewhere.example", 1, 0.0))
    settled = settle(ready_store, orphan)
    assert settled.marked_killed and settled.status == "KILLED"
    assert f"continue it with: runner resume {orphan} --tracking-uri {ready_store}" in settled.line()
    assert "runner exec" not in settled.line()  # `exec SPEC --resume` would drop the run's --set values
    run = MlflowClient(ready_store).get_run(orphan)
    assert run.info.status == "KILLED" and "is gone and never ended the run" in run.data.tags["runner.error"]
    assert (
        settle(ready_store, alive).status == "RUNNING"
        and MlflowClient(ready_store).get_run(alive).info.status == "RUNNING"
    )
    far = settle(ready_store, remote)
    assert far.status == "RUNNING" and "this host cannot tell whether it is alive" in far.line()


def test_runner_status_lists_running_runs_and_ends_orphans(ready_store: str, capsys) -> None:
    me = Owner.this_process()
    orphan = _run_owned_by(ready_store, Owner(me.host, _dead_pid(), me.start_time))
    alive = _run_owned_by(ready_store, me)
    assert main(["status", "--tracking-uri", ready_store]) == 0
    out = capsys.readouterr().out
    assert f"{orphan}  KILLED   its owner (pid" in out and f"{alive}  RUNNING  pid {me.pid}" in out
    assert "owner alive  [owned]" in out
    assert main(["status", "--tracking-uri", ready_store, orphan]) == 0
    assert f"{orphan}  KILLED" in capsys.readouterr().out
    assert main(["status", "--tracking-uri", ready_store, "0" * 32]) == 2
    assert "no such run" in capsys.readouterr().err


def test_status_on_an_empty_store_says_so(ready_store: str, capsys) -> None:
    assert main(["status", "--tracking-uri", ready_store]) == 0
    assert "no RUNNING run at" in capsys.readouterr().out


def test_resume_refuses_a_run_whose_owner_lives_and_takes_over_an_orphan(ready_store: str) -> None:
    me = Owner.this_process()
    alive = _run_owned_by(ready_store, me)
    with pytest.raises(UsageError, match=rf"still RUNNING in pid {me.pid} on host .*kill -TERM {me.pid}"):
        claim_run(ready_store, alive)
    orphan = _run_owned_by(ready_store, Owner(me.host, _dead_pid(), me.start_time))
    (note,) = claim_run(ready_store, orphan)
    assert "which is gone: marked KILLED" in note
    assert MlflowClient(ready_store).get_run(orphan).info.status == "KILLED"
    assert claim_run(ready_store, _run_owned_by(ready_store, me, status="KILLED")) == []
    (note,) = claim_run(ready_store, _run_owned_by(ready_store, Owner("elsewhere.example", 1, 0.0)))
    assert "cannot tell whether it is alive: continuing" in note


@pytest.mark.integration  # starts several processes: the driver's training child
def test_a_new_run_records_its_owner(write_spec, ready_store: str) -> None:
    assert main(["exec", str(write_spec()), "--set", "train.epochs=1", "--set", f'tracking.uri="{ready_store}"']) == 0
    client = MlflowClient(ready_store)
    (run,) = client.search_runs([client.get_experiment_by_name("tests").experiment_id])
    owner = Owner.from_tags(run.data.tags)
    assert owner is not None and owner.pid == Owner.this_process().pid
    assert owner.liveness() == "alive"  # this test process ran the driver in-process


def test_status_without_a_store_says_so_and_creates_none(tmp_path, capsys) -> None:
    assert main(["status"]) == 2  # the test's folder holds no mlflow.db
    err = capsys.readouterr().err
    assert f"no tracking store at sqlite:///{tmp_path / 'mlflow.db'}" in err and "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_the_owners_start_time_is_a_readable_utc_time_and_older_numbers_still_read() -> None:
    me = Owner.this_process()
    recorded = me.tags()["runner.owner.start_time"]
    import re

    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d\dZ", recorded), recorded
    back = Owner.from_tags(me.tags())
    assert back is not None and abs(back.start_time - me.start_time) < 0.01 and back.liveness() == "alive"
    older = Owner.from_tags({**me.tags(), "runner.owner.start_time": f"{me.start_time:.2f}"})
    assert older is not None and abs(older.start_time - me.start_time) < 0.01

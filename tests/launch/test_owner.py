"""Run owners: the process recorded on a run, whether it lives, and runs whose owner died marked KILLED."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from runner.cli import main
from runner.errors import UsageError
from runner.launch.resume import OWNER_FILE, Owner, claim_run, drop_claim, settle, take_claim
from runner.tracking.runs import TrackedRun

REPO = Path(__file__).parents[2]


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
    settled = settle(TrackedRun(ready_store, orphan))
    assert settled.marked_killed and settled.status == "KILLED"
    assert f"continue it with: runner resume {orphan} --tracking-uri {ready_store}" in settled.line()
    assert "runner exec" not in settled.line()  # `exec SPEC --resume` would drop the run's --set values
    run = MlflowClient(ready_store).get_run(orphan)
    assert run.info.status == "KILLED" and "is gone and never ended the run" in run.data.tags["runner.error"]
    assert (
        settle(TrackedRun(ready_store, alive)).status == "RUNNING"
        and MlflowClient(ready_store).get_run(alive).info.status == "RUNNING"
    )
    far = settle(TrackedRun(ready_store, remote))
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


def test_resume_refuses_a_run_whose_owner_lives_and_takes_over_an_orphan(ready_store: str, tmp_path: Path) -> None:
    me = Owner.this_process()
    alive = _run_owned_by(ready_store, me)
    with pytest.raises(UsageError, match=rf"still RUNNING in pid {me.pid} on host .*kill -TERM {me.pid}"):
        claim_run(TrackedRun(ready_store, alive), tmp_path / "alive")
    orphan = _run_owned_by(ready_store, Owner(me.host, _dead_pid(), me.start_time))
    (note,) = claim_run(TrackedRun(ready_store, orphan), tmp_path / "orphan")
    assert "which is gone: marked KILLED" in note
    assert MlflowClient(ready_store).get_run(orphan).info.status == "KILLED"
    assert (
        claim_run(TrackedRun(ready_store, _run_owned_by(ready_store, me, status="KILLED")), tmp_path / "killed") == []
    )
    (note,) = claim_run(
        TrackedRun(ready_store, _run_owned_by(ready_store, Owner("elsewhere.example", 1, 0.0))), tmp_path / "far"
    )
    assert "cannot tell whether it is alive: continuing" in note
    for folder in ("orphan", "killed", "far"):
        drop_claim(tmp_path / folder)
    assert not _claimed_elsewhere(tmp_path / "alive")  # a refused claim is let go at once


_CLAIMER = """
import sys, time
from pathlib import Path
from runner.errors import UsageError
from runner.launch.resume import take_claim
folder, go = Path(sys.argv[1]), Path(sys.argv[2])
while not go.exists():  # every claimer starts its claim at the same moment
    time.sleep(0.001)
try:
    take_claim(folder, "r1")
    print("won", flush=True)
    time.sleep(600)  # holds the claim until killed
except UsageError as exc:
    print(f"lost: {exc}", flush=True)
"""


def _claimer(folder: Path, go: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen(
        [sys.executable, "-c", _CLAIMER, str(folder), str(go)], stdout=subprocess.PIPE, text=True, env=env
    )


def _claimed_elsewhere(folder: Path) -> bool:
    """Whether a process other than this one holds ``folder``'s claim (a claim of this process's own is let go)."""
    try:
        take_claim(folder, "r1")
    except UsageError:
        return True
    drop_claim(folder)
    return False


@pytest.mark.integration  # starts several processes
def test_of_claims_started_together_exactly_one_wins_and_a_killed_owner_lets_go(tmp_path: Path) -> None:
    folder, go = tmp_path / "ck", tmp_path / "go"
    claimers = [_claimer(folder, go) for _ in range(4)]
    go.touch()  # exactly one wins however their starts interleave: the winner holds its claim until killed
    lines = {}
    for proc in claimers:
        assert proc.stdout is not None
        lines[proc] = proc.stdout.readline().strip()
    winners = [proc for proc, line in lines.items() if line == "won"]
    assert len(winners) == 1, list(lines.values())
    (winner,) = winners
    for proc, line in lines.items():
        if proc is not winner:
            assert f"the run is owned by pid {winner.pid} on host " in line, line
            assert f"kill -TERM {winner.pid}" in line and proc.wait(timeout=60) == 0
    with pytest.raises(UsageError, match=f"owned by pid {winner.pid}"):
        take_claim(folder, "r1")
    winner.kill()  # SIGKILL: no handler runs, and the kernel still lets go of the lock
    winner.wait(timeout=60)
    take_claim(folder, "r1")
    assert json.loads((folder / OWNER_FILE).read_text())["runner.owner.pid"] == str(os.getpid())
    drop_claim(folder)


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

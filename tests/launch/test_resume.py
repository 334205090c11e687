"""Resume refusals and the choice of ``--resume last``, before any training (runner.launch.resume; CPU, no worker)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from mlflow.tracking import MlflowClient

from runner.cli import main
from runner.launch.resume import Owner
from runner.tracking.runs import TrackedRun
from runner.tracking.uri import checkpoint_root

pytestmark = pytest.mark.created_store


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _run(store: str, name: str, start: int, status: str = "RUNNING", tags: dict[str, str] | None = None) -> str:
    """A run of experiment ``tests`` (the spec's) started at ``start`` ms, ended ``status``."""
    client = MlflowClient(store)
    experiment = client.get_experiment_by_name("tests")
    eid = experiment.experiment_id if experiment else client.create_experiment("tests")
    run_id = str(client.create_run(eid, start_time=start, tags=tags or {}, run_name=name).info.run_id)
    if status != "RUNNING":
        client.set_terminated(run_id, status)
    return run_id


def test_resume_last_skips_parents_children_finished_and_live_runs_and_names_its_choice(write_spec, store, capsys):
    me = Owner.this_process()
    killed = _run(store, "the-killed-one", 1_000, "KILLED")
    _run(store, "live", 2_000, tags=me.tags())
    _run(store, "done", 3_000, "FINISHED")
    parent = _run(store, "sweep", 4_000, "KILLED", {"runner.sweep": "parent"})
    _run(store, "trial", 5_000, "FAILED", {"mlflow.parentRunId": parent})
    _run(store, "bench", 6_000, "FAILED", {"runner.bench": "parent"})
    spec = write_spec()
    assert main(["exec", str(spec), "--resume", "last"]) == 2
    err = capsys.readouterr().err
    assert f"--resume last: run {killed} 'the-killed-one' (KILLED, started 1970-01-01" in err
    assert "nothing to resume: no checkpoint in" in err

    orphan = _run(store, "orphan", 7_000, tags=Owner(me.host, _dead_pid(), me.start_time).tags())
    assert main(["exec", str(spec), "--resume", "last"]) == 2
    assert f"run {orphan} 'orphan' (RUNNING, owner gone, started" in capsys.readouterr().err


def test_resume_last_without_a_candidate_says_what_qualifies(write_spec, store, capsys):
    _run(store, "done", 1_000, "FINISHED")
    assert main(["exec", str(write_spec()), "--resume", "last"]) == 2
    err = capsys.readouterr().err
    assert "has no run to resume (a KILLED or FAILED run" in err and "pass --resume RUN_ID" in err


def test_resuming_a_failed_run_without_a_checkpoint_points_to_reproduce(write_spec, store, capsys):
    from runner.spec.loading import load_spec
    from runner.tracking.runs import start_run

    run_id = start_run(load_spec(write_spec()), {}, uri=store).run_id
    TrackedRun(store, run_id).end("FAILED")
    assert main(["resume", run_id, "--tracking-uri", store]) == 2
    err = capsys.readouterr().err
    assert "nothing to resume: no checkpoint in" in err
    assert f"`runner reproduce {run_id}` starts it again from the same spec" in err  # the store is ./mlflow.db


def _killed_run_with_checkpoint(spec_path, store: str) -> str:
    """A KILLED run of ``spec_path`` with a checkpoint after epoch 1 of 2, written as the loop writes it."""
    import torch

    from runner.spec.dump import flatten_spec
    from runner.spec.loading import load_spec
    from runner.tracking.runs import start_run
    from runner.training import checkpoint as ckpt
    from runner.training.loop import TrainState

    loaded = load_spec(spec_path)
    run_id = start_run(loaded, {}, uri=store).run_id
    TrackedRun(store, run_id).end("KILLED")
    model = torch.nn.Linear(2, 2)
    payload = ckpt.build_payload(
        scheduler=None,
        scaler=None,
        state=TrainState(epoch=1, global_step=5, batch_in_epoch=0),
        rng_states=[{"torch": torch.get_rng_state()}],
        spec_flat=flatten_spec(loaded.spec),
        spec_sha256="x",
        run_id=run_id,
    )
    shards = {"model": model.state_dict(), "optimizer": {}}
    ckpt.save_checkpoint(checkpoint_root(store, None) / run_id, shards, payload, 5, 2, barrier=lambda: None)
    return run_id


def test_an_inactive_key_is_no_change_on_resume_but_an_active_one_is(write_spec, store):
    from runner.errors import SpecError
    from runner.launch.resume import prepare_resume
    from runner.plan import make_plan
    from runner.spec.loading import load_spec

    spec = write_spec()  # mode = "none": parallel.nproc_per_node is ddp's
    run_id = _killed_run_with_checkpoint(spec, store)
    inert = load_spec(spec, ["parallel.nproc_per_node=2", "parallel.backend=gloo"])
    point = prepare_resume(make_plan(inert), run_id)
    assert point.run.run_id == run_id and point.changes == {}
    changed = load_spec(spec, ["parallel.nproc_per_node=2", "optim.lr=0.5"])
    with pytest.raises(SpecError, match=r"optim\.lr: differs from the resumed run") as caught:
        prepare_resume(make_plan(changed), run_id)
    assert "nproc_per_node" not in str(caught.value)
    text = str(caught.value)  # which --set to repeat, and the command that needs none
    assert "was 0.1, now 0.5: repeat --set optim.lr=0.1 if the run was started with it" in text, text
    assert f"`runner resume {run_id}` continues it with its own spec and --set values" in text
    assert "--allow-spec-change optim.lr" in text


def test_a_none_run_continued_under_fsdp_is_not_refused_for_defaults_nobody_set(write_spec, store):
    from runner.errors import SpecError
    from runner.launch.resume import prepare_resume
    from runner.plan import make_plan
    from runner.spec.loading import load_spec

    spec = write_spec()  # mode = "none": parallel.backend does not apply, so the checkpoint has no value for it
    run_id = _killed_run_with_checkpoint(spec, store)
    fsdp = load_spec(spec, ["parallel.mode=fsdp", "parallel.nproc_per_node=2"])
    point = prepare_resume(make_plan(fsdp), run_id, ("parallel.mode",))
    assert point.changes == {"parallel.mode": ["none", "fsdp"], "parallel.nproc_per_node": [None, 2]}
    chosen = load_spec(spec, ["parallel.mode=fsdp", "parallel.nproc_per_node=2", "parallel.backend=gloo"])
    with pytest.raises(SpecError, match=r"parallel\.backend: differs from the resumed run"):  # set: a change
        prepare_resume(make_plan(chosen), run_id, ("parallel.mode",))


def test_only_the_node_that_owns_the_run_claims_it_on_resume(write_spec, store, monkeypatch):
    """A Slurm node other than node 0 (its node rank from SLURM_NODEID, not parallel.node_rank) leaves the run be."""
    import dataclasses

    import runner.launch.resume as resume
    from runner.plan import make_plan
    from runner.spec.loading import load_spec

    spec = write_spec('[parallel]\nmode = "ddp"\nnproc_per_node = 2\n')
    run_id = _killed_run_with_checkpoint(spec, store)
    claimed: list[str] = []
    monkeypatch.setattr(resume, "claim_run", lambda run, folder: claimed.append(run.run_id) or [])
    plan = make_plan(load_spec(spec))
    assert plan.rendezvous is not None and plan.owns_run
    resume.prepare_resume(plan, run_id)
    assert claimed == [run_id]
    other = dataclasses.replace(plan, rendezvous=dataclasses.replace(plan.rendezvous, node_rank=1))
    assert other.loaded.spec.parallel.node_rank == 0 and not other.owns_run
    resume.prepare_resume(other, run_id)
    assert claimed == [run_id]  # node 1 does not claim (mark KILLED, send the spool of) node 0's run


def test_the_interrupt_message_names_the_checkpoint_that_exists(tmp_path) -> None:
    """A rank that hung after the stop signal wrote no checkpoint: the message names the older one, or none."""
    from runner.errors import Interrupted
    from runner.launch.driver import checkpoint_note

    hung = {1: {"rank": 1, "where": "loop.py:10 in fit", "grace_s": 10.0}}
    assert (
        checkpoint_note(str(tmp_path), hung)
        == "no checkpoint was written at the stop (rank 1 hung first); the run has none"
    )
    (tmp_path / "step-00000010.pt").write_bytes(b"")
    note = checkpoint_note(str(tmp_path), hung)
    assert (
        note
        == "no checkpoint was written at the stop (rank 1 hung first); the newest is step-00000010.pt, from before the stop"
    )
    assert checkpoint_note(str(tmp_path), {}) == "a checkpoint was written at the stop (step-00000010.pt)"
    message = Interrupted(15, run_id="abc", command="runner resume abc", checkpoint=note).format_message()
    assert "a checkpoint was written" not in message and "step-00000010.pt, from before the stop" in message


def test_spec_changes_lists_changed_keys_and_ignores_tracking() -> None:
    from runner.launch.resume import spec_changes

    saved = {"optim.lr": 0.1, "seed": 0, "tracking.experiment": "a", "train.epochs": 3}
    now = {"optim.lr": 0.05, "seed": 0, "tracking.experiment": "b", "train.epochs": 3, "data.shuffle": False}
    assert spec_changes(saved, now) == ["data.shuffle", "optim.lr"]

"""``runner reproduce RUN_ID``: a new run from the resolved spec stored with an earlier one.

The new run trains the stored spec (every default written out, so later changes of a default
do not leak in), in the same store, tagged ``runner.reproduced_from = RUN_ID``. On the same
machine with the same seed its metric history equals the original's (docs/design.md §7). It
warns first when the code may differ: another git commit, or a dirty working tree on either side.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

from runner.errors import UsageError
from runner.launch.resume import RESUMABLE

if TYPE_CHECKING:  # pragma: no cover
    from runner.launch.driver import ExecResult
    from runner.tracking.stored import StoredRun

REPRODUCED_FROM_TAG = "runner.reproduced_from"


def reproduce_run(run_id: str, tracking_uri: str | None = None, *, run_name: str | None = None) -> ExecResult:
    """Start a new run from the spec stored with ``run_id`` and train it to the end.

    Args:
        tracking_uri: Its store, where the new run goes too. Default: ``$MLFLOW_TRACKING_URI``,
            else ``./mlflow.db``.
        run_name: Name of the new run. Default: the original's, followed by ``(reproduced)``.

    Returns:
        The new run's :class:`~runner.launch.driver.ExecResult`.

    Raises:
        UsageError: No such run, or a run without runner's stored spec (exit 2, naming run and store).
        SpecError: The stored spec no longer validates.
        TrackingError, DeviceError, TrainingError, Interrupted: As :func:`runner.launch.driver.exec_experiment`.
    """
    from runner.launch.driver import ExecOptions, exec_experiment
    from runner.tracking.stored import read_stored_run, store_uri

    uri = store_uri(tracking_uri)
    stored = read_stored_run(uri, run_id)
    loaded = stored.loaded()
    for warning in code_differences(stored, loaded.path):
        print(f"runner: warning: {warning}", file=sys.stderr, flush=True)
    name = run_name or f"{stored.run_name or run_id} (reproduced)"
    options = ExecOptions(run_name=name, tags=((REPRODUCED_FROM_TAG, run_id),), tracking_uri=uri)
    return exec_experiment(loaded, options)


def code_differences(stored: StoredRun, spec_path: Path) -> list[str]:
    """Why the code may differ from the run's: another git commit, or uncommitted changes then or now.

    Args:
        stored: The original run (its ``mlflow.source.git.commit`` and ``runner.git.dirty`` tags).
        spec_path: The spec file it came from; the git repository holding it is read now.

    Returns:
        One warning per difference (empty when commit and clean state agree).
    """
    from runner.tracking.tags import git_info

    was_commit = stored.tags.get("mlflow.source.git.commit")
    was_dirty = stored.tags.get("runner.git.dirty") == "true"
    info = git_info(spec_path) if spec_path.parent.is_dir() else None
    if info is None:
        return [f"{spec_path.parent} is not in a git repository now: the code cannot be compared"] if was_commit else []
    out = []
    if was_commit and info.commit != was_commit:
        out.append(
            f"git commit differs: the run used {was_commit[:12]}, the working tree is at {(info.commit or 'none')[:12]}"
        )
    if was_dirty:
        out.append("the run had uncommitted changes (artifact git/diff.patch): they may not be in the code now")
    if info.dirty:
        out.append(f"the working tree {info.root} has uncommitted changes now")
    return out


def resume_run(run_id: str, tracking_uri: str | None = None) -> ExecResult:
    """Continue a KILLED or FAILED run with the spec stored in it (``runner resume RUN_ID``).

    Args:
        tracking_uri: Its store. Default: ``$MLFLOW_TRACKING_URI``, else ``./mlflow.db``.

    Returns:
        The :class:`~runner.launch.driver.ExecResult` of the continued run.

    Raises:
        UsageError: No such run, a run without runner's stored spec, a FINISHED run, or no checkpoint
            (exit 2; each message names the run and the store).
        TrackingError: The store cannot be reached.
        TrainingError, Interrupted: As :func:`runner.launch.driver.exec_experiment`.
    """
    from runner.launch.driver import ExecOptions, exec_experiment
    from runner.tracking.stored import read_stored_run, store_uri

    uri = store_uri(tracking_uri)
    stored = read_stored_run(uri, run_id)
    if stored.status == "FINISHED":
        raise UsageError(
            f"run {run_id} at {uri} already FINISHED: there is nothing to resume; "
            f"`runner reproduce {run_id}` starts a new run from its spec"
        )
    if stored.status not in RESUMABLE:
        raise UsageError(f"run {run_id} at {uri} is {stored.status}: only a KILLED or FAILED run can be resumed")
    return exec_experiment(stored.loaded(), ExecOptions(resume=run_id, tracking_uri=uri))


def export_run(run_id: str, tracking_uri: str | None = None, out: str | None = None) -> str:
    """``runner export RUN_ID``: write the whole model of a run's newest checkpoint as a plain state dict.

    The file loads in plain PyTorch, whatever mode trained the run (fsdp's shards are gathered
    when the checkpoint is written): ``model.load_state_dict(torch.load(FILE))``.

    Args:
        tracking_uri: Its store. Default: ``$MLFLOW_TRACKING_URI``, else ``./mlflow.db``.
        out: The file to write. Default: ``<run id>-step-<step>.pt`` in the working directory.

    Returns:
        What was written, for the user.

    Raises:
        UsageError: No such run, a run without runner's stored spec, or no usable checkpoint.
    """
    import os

    import torch

    from runner.spec.reading import default_checkpoint_dir
    from runner.tracking.stored import read_stored_run, store_uri
    from runner.training.checkpoint import CheckpointError, load_latest

    uri = store_uri(tracking_uri)
    spec = read_stored_run(uri, run_id).loaded().spec
    directory = default_checkpoint_dir(uri, spec.checkpoint.dir, run_id)
    try:
        found = load_latest(directory)
    except CheckpointError as exc:
        raise UsageError(f"run {run_id}: {exc}") from None
    if found is None:
        raise UsageError(f"run {run_id} at {uri} has no checkpoint in {directory}: nothing to export")
    step = found.payload["state"]["global_step"]
    target = Path(out) if out else Path(f"{run_id}-step-{step:08d}.pt")
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{target.name}.partial")
    torch.save(found.payload["model"], partial)
    os.replace(partial, target)
    return (
        f"wrote {target}: the state dict of {spec.model.name} at step {step} (from {found.path.name}); "
        "load it with model.load_state_dict(torch.load(FILE))"
    )

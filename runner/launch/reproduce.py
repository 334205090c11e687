"""``runner reproduce RUN_ID``: a new run from the resolved spec stored with an earlier one.

The new run trains the stored spec (every default written out, so later changes of a default
do not leak in), in the same store, tagged ``runner.reproduced_from = RUN_ID``. On the same
machine with the same seed its metric history equals the original's (docs/design.md §7). It
warns first when the code may differ: another git commit, or a dirty working tree on either side.
"""

from __future__ import annotations

import io
import json
import os
import socket
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from runner.errors import DeviceError, UsageError, echo, show
from runner.launch.driver import exec_experiment
from runner.launch.resume import RESUMABLE
from runner.launch.session import ExecOptions
from runner.tracking.runs import TrackedRun
from runner.tracking.stored import read_stored_run, run_checkpoint_dir, store_uri
from runner.tracking.tags import code_digests, git_info
from runner.tracking.uri import checkpoint_root

if TYPE_CHECKING:
    from runner.launch.driver import ExecResult
    from runner.spec.loading import LoadedSpec
    from runner.spec.schema import ExperimentSpec
    from runner.tracking.stored import StoredRun


REPRODUCED_FROM_TAG = "runner.reproduced_from"


def reproduce_run(run_id: str, tracking_uri: str | None = None, *, run_name: str | None = None) -> ExecResult:
    """Start a new run from the spec stored with ``run_id`` in its store and train it to the end.

    ``run_name`` defaults to the original's followed by ``(reproduced)``. Raises UsageError: No such run, or one without
    runner's stored spec (naming run and store). SpecError: The stored spec no longer validates."""

    uri = store_uri(tracking_uri)
    stored = read_stored_run(TrackedRun(uri, run_id))
    loaded = stored.loaded()
    for warning in code_differences(stored, loaded.path):
        echo(f"runner: warning: {warning}", err=True)
    name = run_name or f"{stored.run_name or run_id} (reproduced)"
    options = ExecOptions(run_name=name, tags=((REPRODUCED_FROM_TAG, run_id),), tracking_uri=uri)
    return exec_experiment(loaded, options)


def code_differences(stored: StoredRun, spec_path: Path) -> list[str]:
    """One warning per way the code may differ from the run's: another git commit, or uncommitted changes then or
    now."""

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
    """Continue a KILLED or FAILED run with the spec stored in it (``runner resume RUN_ID``). Raises UsageError: No such
    run, no stored spec, a FINISHED run, or no checkpoint (naming run and store). TrackingError: The store cannot be
    reached."""

    uri = store_uri(tracking_uri)
    stored = read_stored_run(TrackedRun(uri, run_id))
    if stored.status == "FINISHED":
        raise UsageError(
            f"run {run_id} at {uri} already FINISHED: there is nothing to resume; "
            f"`runner reproduce {run_id}` starts a new run from its spec"
        )
    if stored.status not in RESUMABLE:
        raise UsageError(f"run {run_id} at {uri} is {stored.status}: only a KILLED or FAILED run can be resumed")
    return exec_experiment(stored.loaded(), ExecOptions(resume=run_id, tracking_uri=uri))


def _export_target(target: Path) -> Path:
    """``target`` when writing there replaces nothing but a regular file; UsageError otherwise."""
    try:
        mode = os.lstat(target).st_mode
    except FileNotFoundError:
        return target
    except OSError as exc:
        raise UsageError(f"--out {target}: cannot write there ({exc.strerror}); name a writable path") from None
    if stat.S_ISREG(mode):
        return target
    kind = "a folder" if stat.S_ISDIR(mode) else "a link" if stat.S_ISLNK(mode) else "not a regular file"
    fix = f"name a file in it, e.g. --out {target / 'model.pt'}" if stat.S_ISDIR(mode) else "name another path"
    raise UsageError(f"--out {target} is {kind}: export replaces only a regular file; {fix}")


def run_checkpoints(run_id: str, tracking_uri: str | None, best: bool, fix: str) -> tuple[TrackedRun, LoadedSpec, Path]:
    """``(run, stored spec, checkpoint folder)`` of ``run_id``, for export and scoring. Raises UsageError for no such
    run, or ``best`` without ``checkpoint.monitor`` (``fix``: what to do instead)."""
    run = TrackedRun(store_uri(tracking_uri), run_id)
    stored = read_stored_run(run)
    loaded = stored.loaded()
    if best and loaded.spec.checkpoint.monitor is None:
        raise UsageError(f"run {run_id} set no checkpoint.monitor, so no checkpoint is the best: {fix}")
    root = checkpoint_root(run.uri, loaded.spec.checkpoint.dir)
    return run, loaded, run_checkpoint_dir(run, root, stored.tags)


def export_run(
    run_id: str, tracking_uri: str | None = None, out: str | None = None, *, best: bool = False, ema: bool = False
) -> str:
    """``runner export RUN_ID``: write the whole model of a run's newest checkpoint (``best``: the best by
    ``checkpoint.monitor``; ``ema``: with the weights' moving average for its parameters) as a plain state dict.

    It loads in plain PyTorch whatever the mode (``model.load_state_dict(torch.load(FILE))``); ``out`` defaults to
    ``<run id>-step-<step>.pt``. Raises UsageError for no such run, no stored spec, no usable checkpoint, ``best``
    without a monitor, or ``ema`` without a moving average.
    """
    import torch

    from runner.training.checkpoint import CheckpointError, load_latest, write_atomic
    from runner.training.shards import read_with_model, whole_model

    run, loaded, directory = run_checkpoints(run_id, tracking_uri, best, "drop --best")
    spec = loaded.spec
    if ema and spec.train.ema_decay is None:
        raise UsageError(f"run {run_id} kept no moving average of its weights (train.ema_decay unset): drop --ema")
    goal = spec.checkpoint.goal if best else None
    try:  # a RUNNING run's rotation may delete one as it is read
        found = load_latest(directory, read_with_model, best=goal)
    except CheckpointError as exc:
        raise UsageError(f"run {run_id}: {exc}") from None
    if found is None:
        kind = f"checkpoint that recorded {spec.checkpoint.monitor}" if best else "checkpoint"
        raise UsageError(f"run {run_id} at {run.uri} has no {kind} in {directory}: nothing to export")
    step = found.payload["state"]["global_step"]
    target = _export_target(Path(out) if out else Path(f"{run_id}-step-{step:08d}.pt"))
    weights = found.payload["model"]
    if ema:  # the buffers stay the model's: only parameters are averaged
        weights = {**weights, **whole_model(found.path, "ema")}
    buffer = io.BytesIO()
    torch.save(weights, buffer)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(target.parent, buffer.getbuffer(), final=target)
    except OSError as exc:
        raise UsageError(f"--out {target}: cannot write there ({exc.strerror or exc}); name a writable path") from None
    skipped = "".join(f"\nnote: skipped {why}" for _, why in found.skipped)  # as a resume notes them
    return (
        f"wrote {target}: the state dict of {spec.model.name}{' (moving average)' if ema else ''} at step {step} "
        f"(from {found.path.name}); "
        f"load it with model.load_state_dict(torch.load(FILE)){skipped}"
    )


ABSENT = "(absent)"
_ENV_TAGS = {
    "torch": "runner.torch_version",
    "cuda": "runner.cuda_version",
    "devices": "runner.devices",
    "world size": "runner.world_size",
    "accelerator": "runner.accelerator",
    "host": "runner.hostname",
    "user code": "runner.code",
}


@dataclass(frozen=True)
class Side:
    """One side of a diff: its label, the spec's active and inactive keys, git commit and dirty state, environment."""

    label: str
    spec: dict[str, Any]
    inactive: frozenset[str] = frozenset()
    git: dict[str, str] = field(default_factory=dict)
    environment: dict[str, str] = field(default_factory=dict)


def _spec_keys(spec: ExperimentSpec, accelerator: str | None) -> tuple[dict[str, Any], frozenset[str]]:
    """The keys a run of ``spec`` on ``accelerator`` logs as params, and those that do not apply to it."""
    from runner.spec.dump import active_params, run_inactive_keys

    return active_params(spec, accelerator), frozenset(run_inactive_keys(spec, accelerator))


def side_of(arg: str, tracking_uri: str | None = None) -> Side:
    """A spec file when ``arg`` names one, else a run id at the store; UsageError for neither, SpecError if invalid."""
    from runner.spec.loading import load_spec

    path = Path(arg)
    if path.is_file():
        return _spec_side(load_spec(path))
    if path.suffix == ".toml":
        raise UsageError(f"{arg}: spec file not found (give a spec file or a run id)")
    stored = read_stored_run(TrackedRun(store_uri(tracking_uri), arg))
    tags = stored.tags
    git = {"commit": tags.get("mlflow.source.git.commit", "?"), "dirty": tags.get("runner.git.dirty", "?")}
    environment = {label: tags.get(tag, "?") for label, tag in _ENV_TAGS.items()}
    environment["cuda"] = environment["cuda"].split(" (")[0]  # "13.0 (torch build; no GPU used)" on a CPU run
    label = f"run {stored.run_id}" + (f" ({stored.run_name})" if stored.run_name else "")
    accelerator = tags.get("runner.accelerator")
    return Side(label, *_spec_keys(stored.loaded().spec, accelerator), git, environment)


def _spec_side(loaded: LoadedSpec) -> Side:
    """A spec file now: its flattened spec, its repository's git state, this machine's environment."""
    import torch

    from runner.plan import make_plan

    info = git_info(loaded.path)
    git = {
        "commit": (info.commit or "?") if info else "?",
        "dirty": ("true" if info.dirty else "false") if info else "?",
    }
    environment = {"torch": str(torch.__version__), "cuda": str(torch.version.cuda or "none")}
    accelerator = None
    try:
        devices = make_plan(loaded).devices
        environment.update(
            devices=", ".join(devices.names) or "cpu",
            **{"world size": str(devices.world_size), "accelerator": devices.accelerator},
        )
        accelerator = devices.accelerator
    except DeviceError as exc:
        environment["devices"] = f"cannot run here ({exc.message})"
    environment["host"] = socket.gethostname()
    environment["user code"] = code_digests(loaded)
    words = " ".join(loaded.command_line())
    return Side(
        f"spec {loaded.path}" + (f" {words}" if words else ""), *_spec_keys(loaded.spec, accelerator), git, environment
    )


def diff_sides(a: Side, b: Side) -> dict[str, Any]:
    """``{"a", "b", "spec", "commits", "git", "environment"}``: both sides' code in ``commits``, only what differs in
    the others (a key missing on one side is ``"(absent)"``)."""
    inert = {
        k for k in [*a.spec, *b.spec] if (k not in a.spec and k in a.inactive) or (k not in b.spec and k in b.inactive)
    }
    return {
        "a": a.label,
        "b": b.label,
        "spec": _differing(a.spec, b.spec, skip=inert),
        "commits": [_git_text(a.git), _git_text(b.git)],
        "git": _differing(a.git, b.git),
        "environment": _differing(a.environment, b.environment, unknown="?"),
    }


def _differing(
    a: dict[str, Any], b: dict[str, Any], unknown: str | None = None, skip: set[str] | None = None
) -> dict[str, list[Any]]:
    """Keys whose values differ; ``skip``: keys that apply on one side only (another mode's options)."""
    out: dict[str, list[Any]] = {}
    for key in [*a, *(k for k in b if k not in a)]:
        left, right = a.get(key, ABSENT), b.get(key, ABSENT)
        if left != right and unknown not in (left, right) and key not in (skip or set()):
            out[key] = [left, right]
    return out


def show_diff(a: str, b: str, tracking_uri: str | None = None, *, as_json: bool = False) -> None:
    """``runner diff A B``: print what differs between two runs or spec files, as text or JSON (errors as
    :func:`side_of`)."""
    result = diff_sides(side_of(a, tracking_uri), side_of(b, tracking_uri))
    echo(json.dumps(result, indent=2) if as_json else format_diff(result))


def format_diff(result: dict[str, Any]) -> str:
    """The differences as text: the two sides, then spec keys, git and environment, each as a table."""
    lines = [f"A: {result['a']}", f"B: {result['b']}"]
    same = "same" if not result["git"] else "differ"
    lines.append(f"commits: A {result['commits'][0]}, B {result['commits'][1]} ({same})")
    for title in ("spec", "git", "environment"):
        rows = result[title]
        if not rows:
            lines.append(f"{title}: same")
            continue
        lines.append(f"{title}: {len(rows)} difference(s)")
        width = max(len(k) for k in rows)
        shown = {k: [_text(v) for v in pair] for k, pair in rows.items()}
        left = max(len(pair[0]) for pair in shown.values())
        lines += [f"  {k:<{width}}  {pair[0]:<{left}}  {pair[1]}" for k, pair in shown.items()]
    return "\n".join(lines)


def _git_text(git: dict[str, str]) -> str:
    """``1a2b3c4d5e6f dirty``, ``1a2b3c4d5e6f clean`` or ``no git commit``."""
    commit = git.get("commit", "?")
    if commit == "?":
        return "no git commit"
    state = {"true": " dirty", "false": " clean"}.get(git.get("dirty", "?"), "")
    return f"{commit[:12]}{state}"


def _text(value: Any) -> str:
    return value if isinstance(value, str) else show(value)

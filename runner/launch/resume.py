"""Resume: ``runner resume RUN_ID`` from the run's stored spec; ``exec --resume`` with a spec file.

A resumed run continues the same MLflow run from its newest usable checkpoint. ``runner resume``
needs only the run id: the spec is the resolved one stored with the run (``spec/resolved.toml``),
so the ``--set`` values it started with come along, and it is what an interrupted run prints.
With ``exec --resume`` the spec may differ from the run's only in keys named by
``--allow-spec-change`` and in the process layout (``LAYOUT_KEYS``, e.g. ``--nproc-per-node 1``
for a run stopped with 2 processes); each change is recorded.
"""

from __future__ import annotations

import json
import os
import shlex
import socket
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from runner.errors import SpecError, SpecIssue, UsageError, did_you_mean, show, with_hint
from runner.tracking.runs import TrackedRun

if TYPE_CHECKING:
    from runner.plan import Plan
    from runner.spec.loading import LoadedSpec
    from runner.tracking.spool import Sent


RESUMABLE = ("KILLED", "FAILED", "RUNNING")  # RUNNING: its driver died without ending it
# How many processes on which devices: a resume may change them without --allow-spec-change, since
# the global batch and the data order do not depend on them (docs/design.md §2, §3, §8).
LAYOUT_KEYS = (
    "parallel.nproc_per_node",
    "parallel.nnodes",
    "parallel.node_rank",
    "parallel.rdzv_endpoint",
    "parallel.rdzv_id",
    "devices.ids",
)


@dataclass(frozen=True)
class ResumePoint:
    """A run to continue: the allowed spec changes ``{key: [old, new]}``, notes for the user, and the run's checkpoint
    folder (this process holds the run's claim on it when it owns the run: :func:`take_claim`)."""

    run: TrackedRun
    changes: dict[str, list[Any]]
    notes: list[str]
    folder: Path


def prepare_resume(plan: Plan, resume: str, allow_spec_change: tuple[str, ...] = ()) -> ResumePoint:
    """Find the run ``resume`` names (``--resume``: a run id or ``last``), claim it for this process and check the spec
    against its newest checkpoint; the keys in ``allow_spec_change`` may differ from it.

    Raises UsageError: Tracking is off, no such run, FINISHED with this spec, or another process owns it. SpecError:
    The spec differs in keys not allowed to change. CheckpointError: Every checkpoint of the run is damaged."""
    from runner.tracking.stored import run_checkpoint_dir

    uri = plan.tracking_uri
    if uri is None:
        raise UsageError("--resume needs tracking.enabled = true: the run to resume is found in MLflow")
    run, chosen = _resolve_resume(uri, plan.loaded.spec.experiment_name, resume)
    directory = run_checkpoint_dir(run, plan.checkpoint_root)
    claimed = claim_run(run, directory) if plan.owns_run else []
    try:
        changes, notes = _checked_resume(plan, allow_spec_change, run, directory)
    except BaseException as exc:
        drop_claim(directory)  # this process will not continue the run
        if isinstance(exc, UsageError):
            raise UsageError("; ".join([*chosen, str(exc)])) from None
        raise
    return ResumePoint(run, changes, chosen + claimed + notes, directory)


def _checked_resume(
    plan: Plan, allow_spec_change: tuple[str, ...], run: TrackedRun, directory: Path
) -> tuple[dict[str, list[Any]], list[str]]:
    """``(allowed spec changes, notes)`` of continuing ``run`` from ``directory``; a refusal for want of a
    checkpoint says how to start the run again instead."""
    from runner.training.checkpoint import CheckpointError

    run_id = run.run_id
    try:
        changes, complete, notes = _check_resume(
            plan.loaded, directory, allow_spec_change, plan.devices.accelerator, run_id
        )
    except _NoCheckpoint as exc:
        again = resume_command(run, "reproduce")
        hint = f"run {run_id} ended before its first checkpoint; `{again}` starts it again from the same spec, anew"
        raise UsageError(f"{exc}: {hint}") from None
    except CheckpointError as exc:
        again = resume_command(run, "reproduce")
        raise CheckpointError(f"{exc}\n`{again}` starts run {run_id} again from the same spec, anew") from None
    if complete and (found := run.find()) is not None and found.status == "FINISHED":
        raise UsageError(
            f"--resume {run_id}: the run already FINISHED with this spec; to train it further, change the "
            f"spec and name the change, e.g. --set train.epochs=N --allow-spec-change train.epochs"
        )
    return changes, notes


OWNER_LOCK = ".owner.lock"  # in a run's checkpoint folder: locked by the process that owns the run, while it does
OWNER_FILE = ".owner"  # beside it: that process, as the owner tags record it (JSON), for the refusal to name
_CLAIMS: dict[Path, Any] = {}  # this process's claims: checkpoint folder -> its held FileLock


def take_claim(folder: Path, run_id: str) -> None:
    """Claim ``run_id`` for this process in one atomic step: an exclusive lock (``flock``, through filelock) on
    ``folder/.owner.lock``, taken without waiting and held until :func:`drop_claim` or this process's end.

    Of two processes that claim one run at once, exactly one gets it: the kernel decides. Checking the owner tags
    first and recording them later left a window in which two resumes both saw no live owner and both ran. The
    kernel lets go of the lock however its holder ends (SIGKILL included), so a claim is never stale. Raises
    UsageError naming the holder when another process has the run."""
    from filelock import FileLock, Timeout

    from runner.training.checkpoint import write_atomic

    if folder in _CLAIMS:
        return
    folder.mkdir(parents=True, exist_ok=True)
    lock = FileLock(folder / OWNER_LOCK, timeout=0)
    try:
        lock.acquire()
    except Timeout:
        raise UsageError(_claimed_by_another(folder, run_id)) from None
    _CLAIMS[folder] = lock
    write_atomic(folder, json.dumps(Owner.this_process().tags()).encode(), final=folder / OWNER_FILE)


def drop_claim(folder: Path | str) -> None:
    """Let go of this process's claim on the run of checkpoint folder ``folder``, if it has one."""
    lock = _CLAIMS.pop(Path(folder), None)
    if lock is not None:
        lock.release()


def _claimed_by_another(folder: Path, run_id: str, wait_s: float = 5.0) -> str:
    """The refusal of a run another process has claimed, naming that process once it has recorded itself (it does
    right after its lock; the file may still name an earlier owner that is gone, so up to ``wait_s`` is waited)."""
    deadline = time.monotonic() + wait_s
    while (owner := _recorded_owner(folder)) is None or owner.liveness() == "gone":
        if time.monotonic() > deadline:
            owner = None
            break
        time.sleep(0.05)
    who = owner.describe() if owner is not None else "another process"
    stop = f"stop it first (kill -TERM {owner.pid}) or wait" if owner is not None else "wait"
    return (
        f"--resume {run_id}: the run is owned by {who}, which holds {folder / OWNER_LOCK}; a second process would "
        f"write the same checkpoints and metrics: {stop} for it to end"
    )


def _recorded_owner(folder: Path) -> Owner | None:
    """The owner that ``folder/.owner`` records, or ``None``."""
    try:
        return Owner.from_tags(json.loads((folder / OWNER_FILE).read_text()))
    except (OSError, ValueError):
        return None


def claim_run(run: TrackedRun, folder: Path) -> list[str]:
    """Claim ``run`` for this process (:func:`take_claim` on its checkpoint ``folder``), then make sure no live
    process owns it by its tags (docs/design.md §12): a gone owner's run is marked KILLED first.

    Returns notes (an owner on another host cannot be checked). Raises UsageError when another process holds the
    claim, or an owner here is alive (the claim is then dropped)."""
    take_claim(folder, run.run_id)
    try:
        return _settled_notes(run)
    except BaseException:
        drop_claim(folder)
        raise


def _settled_notes(run: TrackedRun) -> list[str]:
    """The notes of a run no live process owns, after :func:`settle`; UsageError when its owner here is alive."""
    run_id = run.run_id
    settled = settle(run)
    owner = settled.owner
    sent = settled.sent
    notes = [f"sent {sent.metrics} metric values its spool kept from before"] if sent and sent.metrics else []
    if settled.status != "RUNNING" and not settled.marked_killed:
        return notes
    if settled.marked_killed and owner is not None:
        return [*notes, f"run {run_id} was left RUNNING by {owner.describe()}, which is gone: marked KILLED"]
    if owner is not None and settled.liveness == "alive":
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(owner.start_time))
        raise UsageError(
            f"--resume {run_id}: the run is still RUNNING in {owner.describe()} (started {started}); a second "
            f"process would write the same checkpoints and metrics: stop it first (kill -TERM {owner.pid}), "
            "or wait for it to end"
        )
    who = owner.describe() if owner is not None else "a process that recorded no owner"
    return [f"run {run_id} is RUNNING, owned by {who}; this host cannot tell whether it is alive: continuing"]


def _resolve_resume(uri: str, experiment: str, resume: str) -> tuple[TrackedRun, list[str]]:
    """The run ``--resume`` names, and for ``last`` a note saying which run was chosen."""
    if resume == "last":
        return _last_run(uri, experiment)
    run = TrackedRun(uri, resume)
    if run.find() is None:
        raise UsageError(
            f"--resume {resume}: no such run at {uri} (copy the run id from the MLflow UI or use --resume last)"
        )
    return run, []


def _last_run(uri: str, experiment: str) -> tuple[TrackedRun, list[str]]:
    """The newest run of ``experiment`` that exec can continue: KILLED, FAILED, or RUNNING with its owner gone."""
    from runner.tracking.stored import continuable_runs

    for info in continuable_runs(uri, experiment):
        owner = Owner.from_tags(info.tags)
        if info.status == "RUNNING" and (owner is None or owner.liveness() != "gone"):
            continue  # alive, or cannot tell: not orphaned
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info.start_time_ms / 1000))
        state = "RUNNING, owner gone" if info.status == "RUNNING" else info.status
        chosen = f"--resume last: run {info.run_id} {info.run_name!r} ({state}, started {started})"
        return TrackedRun(uri, info.run_id), [chosen]
    raise UsageError(
        f"--resume last: experiment {experiment!r} at {uri} has no run to resume (a KILLED or FAILED run, or a "
        "RUNNING one whose owner is gone; sweep and bench runs are not candidates): pass --resume RUN_ID"
    )


class _NoCheckpoint(UsageError):
    """The run has no checkpoint to continue from."""


def _spec_changed(
    loaded: LoadedSpec, saved: dict[str, Any], current: dict[str, Any], keys: list[str], run_id: str
) -> SpecError:
    """The refusal of a resume whose spec differs from the run's in ``keys``: which --set to repeat, or how not to."""
    again = f"`runner resume {run_id}` continues it with its own spec and --set values, " if run_id else ""
    issues = []
    for k in keys:
        was, now = show(saved.get(k)), show(current.get(k))
        fix = f"repeat --set {k}={was} if the run was started with it; {again}or pass --allow-spec-change {k}"
        message = f"differs from the resumed run: was {was}, now {now}: {fix} to train on with the new value"
        issues.append(SpecIssue(loaded.path, None, k, message))
    return SpecError(issues)


def _check_resume(
    loaded: LoadedSpec, directory: Path, allowed: tuple[str, ...], accelerator: str | None = None, run_id: str = ""
) -> tuple[dict[str, list[Any]], bool, list[str]]:
    """``(changes, complete, notes)``: allowed spec changes; whether the newest usable checkpoint ends the training."""
    from runner.spec.dump import flatten_spec, is_inactive, run_inactive_keys, set_keys
    from runner.training.checkpoint import load_latest, peek

    current = flatten_spec(loaded.spec)
    found = load_latest(directory, peek)  # every checkpoint damaged: CheckpointError, exit 1
    if found is None:
        raise _NoCheckpoint(f"nothing to resume: no checkpoint in {directory}")
    saved = found.payload["spec"]
    known = set(saved) | set(current)
    for key in allowed:
        if not any(_under(k, [key]) for k in known):
            hint = did_you_mean(key, sorted(known), render=str)
            raise UsageError(with_hint(f"--allow-spec-change {key}: the spec has no such key", hint))
    inactive = run_inactive_keys(loaded.spec, accelerator)  # inert keys (§10) are no change, as in `runner diff`
    # A default that did not apply to the run (so its checkpoint has no value for it) and applies now, unset, is no
    # change either: a none run continued under fsdp takes parallel.backend's default, which nobody chose.
    chosen = set_keys(loaded.spec)
    changed = [
        k for k in spec_changes(saved, current) if not is_inactive(k, inactive) and (k in saved or _under(k, chosen))
    ]
    free = (*allowed, *LAYOUT_KEYS)
    unexpected = [k for k in changed if not _under(k, free)]
    if unexpected:
        raise _spec_changed(loaded, saved, current, unexpected, run_id)
    notes = [f"resuming from {found.path.name}"]  # the worker that loads it names the damaged files it skipped
    layout = [k for k in changed if k in LAYOUT_KEYS and k not in allowed]
    if layout:
        shown = ", ".join(f"{k} {saved.get(k)!r} -> {current.get(k)!r}" for k in layout)
        notes.append(
            f"process layout changed on resume ({shown}): the checkpoint holds the whole model and optimizer, "
            "re-sharded or replicated as this run needs; the global batch and the data order are unchanged"
        )
    if changed:
        notes.append("spec changed on resume: " + ", ".join(changed))
    state = found.payload["state"]
    train = loaded.spec.train
    complete = state["epoch"] >= train.epochs or (
        train.max_steps is not None and state["global_step"] >= train.max_steps
    )
    return {k: [saved.get(k), current.get(k)] for k in changed}, complete, notes


def spec_changes(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Dotted keys that differ between two flattened specs, leaving out those that cannot change results."""
    quiet = ("tracking.", "train.progress", "checkpoint.", "description")
    keys = set(saved) | set(current)
    return sorted(k for k in keys if not k.startswith(quiet) and saved.get(k) != current.get(k))


def _under(key: str, tables: Iterable[str]) -> bool:
    """Whether the dotted ``key`` is one of ``tables`` or a key inside one (``optim.lr`` is under ``optim``)."""
    return any(key == table or key.startswith(table + ".") for table in tables)


Liveness = Literal["alive", "gone", "unknown"]
TAGS = ("runner.owner.host", "runner.owner.pid", "runner.owner.start_time")
_TIME_FORMAT = "%Y-%m-%dT%H:%M:%S.%f"
_SAME_START_S = 0.5  # create times of one process agree to the clock tick; a reused pid differs by more


@dataclass(frozen=True)
class Owner:
    """The process that owns a run (``start_time`` in seconds since the epoch)."""

    host: str
    pid: int
    start_time: float

    @classmethod
    def this_process(cls) -> Owner:
        import psutil

        return cls(socket.gethostname(), os.getpid(), psutil.Process().create_time())

    @classmethod
    def from_tags(cls, tags: Mapping[str, str]) -> Owner | None:
        """The owner recorded in a run's tags, or ``None`` when there is none (runs made before owners were)."""
        try:
            text = tags[TAGS[2]]
            when = datetime.strptime(text.rstrip("Z"), _TIME_FORMAT).replace(tzinfo=UTC) if "T" in text else None
            started = when.timestamp() if when is not None else float(text)  # older runs: seconds since the epoch
            return cls(tags[TAGS[0]], int(tags[TAGS[1]]), started)
        except (KeyError, ValueError):
            return None

    def tags(self) -> dict[str, str]:
        """The run tags that record this owner; the start time in UTC, ISO 8601, to the hundredth of a second."""
        started = datetime.fromtimestamp(self.start_time, UTC).strftime(_TIME_FORMAT)[:-4] + "Z"
        return dict(zip(TAGS, (self.host, str(self.pid), started), strict=True))

    def liveness(self) -> Liveness:
        """``alive``; ``gone`` (no such process, a zombie, another process under the pid); ``unknown`` (other host)."""
        if self.host != socket.gethostname():
            return "unknown"
        import psutil

        try:
            process = psutil.Process(self.pid)
            if process.status() == psutil.STATUS_ZOMBIE:
                return "gone"
            started = process.create_time()
        except psutil.NoSuchProcess:
            return "gone"
        except psutil.Error:  # AccessDenied: another user's process still exists
            return "alive"
        return "alive" if abs(started - self.start_time) <= _SAME_START_S else "gone"

    def describe(self) -> str:
        """``pid 123 on host node1``."""
        return f"pid {self.pid} on host {self.host}"


@dataclass(frozen=True)
class Settled:
    """A run after :func:`settle`: its status now, the owner's liveness, whether it was marked KILLED, what was sent."""

    run: TrackedRun
    status: str
    owner: Owner | None
    liveness: Liveness
    marked_killed: bool = False
    sent: Sent | None = None

    def line(self) -> str:
        """What ``runner status`` prints about the run."""
        if self.sent is None:
            return self._state()
        ended = f", and its final status {self.sent.ended}" if self.sent.ended else ""
        return f"{self._state()}; sent the {self.sent.metrics} metric values its spool kept{ended}"

    def _state(self) -> str:
        who = self.owner.describe() if self.owner else "no owner recorded"
        run_id = self.run.run_id
        if self.marked_killed:
            return (
                f"{run_id}  KILLED   its owner ({who}) is gone and never ended it: marked KILLED; "
                f"continue it with: {resume_command(self.run)}"
            )
        if self.status != "RUNNING":
            return f"{run_id}  {self.status:<8} ({who})"
        state = {
            "alive": "owner alive",
            "gone": "owner gone",
            "unknown": "on another host: this host cannot tell whether it is alive",
        }[self.liveness]
        if self.owner is None:
            state = "no owner recorded: cannot tell whether it is alive"
        return f"{run_id}  RUNNING  {who}, {state}"


def settle(run: TrackedRun) -> Settled:
    """Mark a RUNNING run KILLED when its owner on this host is gone; UsageError for no such run."""
    from runner.tracking.spool import send_spool, spool_path
    from runner.tracking.stored import CHECKPOINT_DIR_TAG

    info = run.record()
    owner = Owner.from_tags(info.tags)
    liveness: Liveness = owner.liveness() if owner is not None else "unknown"
    sent = None
    if info.status != "RUNNING" or (owner is not None and liveness == "gone"):  # no live process uses the spool
        folder = info.tags.get(CHECKPOINT_DIR_TAG)  # where the run's spool is
        sent = send_spool(run, spool_path(folder)) if folder else None
        if sent is not None and sent.ended:
            return Settled(run, sent.ended, owner, liveness, sent=sent)
    if info.status != "RUNNING" or liveness != "gone" or owner is None:
        return Settled(run, info.status, owner, liveness, sent=sent)
    error = (
        f"the run's owner ({owner.describe()}) is gone and never ended the run (it was killed hard, or its "
        "machine stopped); marked KILLED by runner"
    )
    run.end("KILLED", error)
    return Settled(run, "KILLED", owner, liveness, marked_killed=True, sent=sent)


def status_lines(tracking_uri: str | None, run_id: str | None) -> list[str]:
    """What ``runner status`` prints: one run, or every RUNNING run, after :func:`settle`.

    Raises UsageError for no such run or no store (none is created), TrackingError when it cannot be used.
    """
    from runner.tracking.stored import STORE_HINT, search_runs, store_uri
    from runner.tracking.uri import local_store_missing, open_store

    uri = store_uri(tracking_uri)
    if local_store_missing(uri):
        raise UsageError(f"no tracking store at {uri}: there are no runs to show; {STORE_HINT}")
    open_store(uri)
    if run_id is not None:
        return [settle(TrackedRun(uri, run_id)).line()]
    running = search_runs(uri, None, status="RUNNING", limit=1000)
    if not running:
        return [f"no RUNNING run at {uri}"]
    return [f"{settle(TrackedRun(uri, info.run_id)).line()}  [{info.experiment}]" for info in running]


def resume_command(run: TrackedRun, verb: str = "resume") -> str:
    """``runner resume RUN_ID`` (or another verb), with ``--tracking-uri`` only when the command would not find the
    run's store."""
    from runner.tracking.uri import default_tracking_uri

    words = ["runner", verb, run.run_id]
    if run.uri != default_tracking_uri():
        words += ["--tracking-uri", run.uri]
    return shlex.join(words)

"""Checkpoints: every rank's DCP shards in one step folder, keep-last rotation, validated load with fall-back, resume
lookup.

A checkpoint holds everything needed to continue exactly (docs/design.md §8): the unwrapped
model state (no ``module.`` prefix), optimizer, scheduler, grad scaler, the
``runner.training.loop.TrainState`` (epoch, global step, batches consumed in the epoch) and
the RNG states of every rank, plus the flattened spec and its SHA-256.

Each checkpoint is a folder ``step-00000123/`` in the run's checkpoint folder, in every mode (``save_checkpoint``):
the model and optimizer through ``torch.distributed.checkpoint`` (DCP: each rank's shards under fsdp, whole
tensors elsewhere), beside ``meta.pt``, the rest of the payload. Each file is written to a
temporary file in the same folder, flushed, fsync'ed and renamed (``os.replace`` is
atomic on POSIX), so a crash mid-write never leaves a damaged latest checkpoint. Beside each one a
digest file ``step-00000123.sha256`` (``sha256sum`` format: one line per file of the folder) is written atomically
before the checkpoint is
renamed into place; a checkpoint whose bytes no longer match it, or that has none, counts as damaged
(``torch.load`` does not check the zip CRCs, so bytes changed in place would load silently).

A checkpoint holds only tensors and plain values (numbers, strings, lists, dicts; RNG states as
tensors) and is read with ``torch.load(weights_only=True)``, which rebuilds those and nothing else
(PyTorch docs, ``torch.load``: "weights_only"). A file that carries any other pickled object is
refused, not executed, so a checkpoint folder on a shared filesystem cannot run code on the nodes
that resume from it. Files of another format version are refused with the reason. DCP's own
``.metadata`` is a pickle: it is read with an unpickler that builds DCP's metadata classes by exact name
and nothing else, and the shards' non-tensor items are read with ``weights_only`` too (§8).
The driver checks a resume (the spec's changes, whether training is complete) with ``peek``: the
digests, then the checkpoint's plain fields read from ``torch.save``'s pickle with every tensor, dtype and
size taken as ``None`` and no other object built. It imports no torch and never holds the weights; the
training process's ``torch.load(weights_only=True)`` is what refuses a file carrying pickled objects.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import hashlib
import io
import math
import os
import pickle
import re
import shutil
import tempfile
import warnings
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from runner.errors import RunnerError, first_line

if TYPE_CHECKING:
    from torch.optim.lr_scheduler import LRScheduler

    from runner.strategies.base import Precision
    from runner.training.loop import TrainState

FORMAT_VERSION = 3  # 3: a DCP folder in every mode (2: one file outside fsdp); records the metrics logged before it
_NAME = re.compile(r"^step-(\d{8,})(\.pt)?$")  # a folder; a file is an earlier runner's, refused by its format
META = "meta.pt"  # in a checkpoint's folder: the payload without the model and optimizer
_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")
_PLAIN = (bool, int, float, str, bytes, type(None))
# DCP without a process group (modes none and dp, `runner export`) is meant: its warning would only alarm
warnings.filterwarnings("ignore", r"torch\.distributed is .*assuming the intent is to (save|load) in a single process")


class CheckpointError(RunnerError):
    """A checkpoint file is damaged, truncated, or not a runner checkpoint."""


@dataclass(frozen=True)
class LoadedCheckpoint:
    """A checkpoint read back: its payload, and the newer damaged files skipped (with why), newest first."""

    path: Path
    payload: dict[str, Any]
    skipped: tuple[tuple[Path, str], ...] = ()


def save_checkpoint(
    directory: Path,
    state: dict[str, Any],
    payload: dict[str, Any] | None,
    global_step: int,
    keep_last: int,
    barrier: Callable[[], None],
    *,
    background: bool = False,
    group: Any = None,
    keep_best: tuple[int, str] = (0, "min"),
) -> PendingSave | None:
    """Write ``step-<global_step>/`` with every rank's DCP shards of ``state`` (``Strategy.checkpoint_state``); a
    collective, no rank gathers the state.

    The writing rank passes ``payload`` (the rest; others ``None``): it fills a ``.partial`` folder, adds ``meta.pt``
    and every file's digest, renames it into place and rotates, keeping the newest ``keep_last`` and the ``(count,
    goal)`` of ``keep_best`` best by their monitored value. With ``background``, ``dcp.async_save`` on ``group``
    writes while the caller goes on; the returned :class:`PendingSave` finishes it.
    """
    import torch.distributed.checkpoint as dcp

    final = directory / f"step-{global_step:08d}"
    partial = directory / f".{final.name}.partial"
    if payload is not None:
        if (problem := plain_problem(payload)) is not None:
            raise CheckpointError(f"cannot save a checkpoint that torch.load(weights_only=True) refuses: {problem}")
        directory.mkdir(parents=True, exist_ok=True)
        for stale in directory.glob(".step-*.partial"):  # one save at a time: any other is a failed one's remains
            shutil.rmtree(stale, ignore_errors=True)
        partial.mkdir()
    barrier()  # the folder exists before any rank writes into it
    pending = PendingSave(final, partial, payload, keep_last, keep_best)
    if not background:
        try:
            dcp.save(state, checkpoint_id=partial)  # returns once every rank's shards and the metadata are written
        except (Exception, dcp.CheckpointException) as exc:  # DCP's own exception is no Exception
            raise pending.failed(exc) from None
        pending.finish()
        return None
    pending.future = dcp.async_save(state, checkpoint_id=partial, process_group=group)
    return pending


class PendingSave:
    """A checkpoint being written; :meth:`finish` waits and puts it in place, or names its failure."""

    def __init__(
        self,
        final: Path,
        partial: Path,
        payload: dict[str, Any] | None,
        keep_last: int,
        keep_best: tuple[int, str] = (0, "min"),
    ) -> None:
        self.final = final
        self.partial = partial
        self.payload = payload
        self.keep_last = keep_last
        self.keep_best = keep_best
        self.future: Any = None

    def finish(self) -> None:
        """Wait for the shards, then (writing rank) add ``meta.pt`` and the digest and rename the folder;
        CheckpointError, naming the checkpoint, when the background save failed on this rank."""
        if self.future is not None:
            import torch.distributed.checkpoint as dcp

            try:
                self.future.result()
            except (Exception, dcp.CheckpointException) as exc:
                raise self.failed(exc) from None
        if self.payload is None:
            return
        try:
            self._put_in_place()
        except OSError as exc:
            raise self.failed(exc) from None

    def _put_in_place(self) -> None:
        """Add ``meta.pt`` and the digest, rename the folder into place and rotate (the writing rank)."""
        import torch

        final = self.final
        partial = self.partial
        buffer = io.BytesIO()
        torch.save(self.payload, buffer)
        write_atomic(partial, buffer.getbuffer(), final=partial / META)
        files = sorted(p for p in partial.rglob("*") if p.is_file())
        write_digest(final, {f"{final.name}/{p.relative_to(partial).as_posix()}": _sha256(p) for p in files})
        if final.exists():  # an epoch's checkpoint at the step of a step checkpoint
            shutil.rmtree(final)
        os.replace(partial, final)
        _fsync_dir(final.parent)
        _rotate(final.parent, self.keep_last, *self.keep_best)

    def failed(self, exc: BaseException) -> CheckpointError:
        """The error of a save that failed with ``exc``; its ``.partial`` folder is removed, so a full disk does not
        stay full of it (every rank may remove it: the folder is shared)."""
        shutil.rmtree(self.partial, ignore_errors=True)
        cause = dcp_error(exc) if not isinstance(exc, OSError) else f"{type(exc).__name__}: {exc}"
        message = f"checkpoint {self.final.name} was not saved in {self.final.parent} ({cause}); it is not used"
        if _disk_full(exc):
            message += (
                "; the disk is full (ENOSPC): free space there, lower checkpoint.keep_last, or point checkpoint.dir "
                "at a disk with room; the run can be resumed from its last checkpoint once there is room"
            )
        return CheckpointError(message)


def _disk_full(exc: BaseException) -> bool:
    """Whether ``exc``, or a rank's cause that DCP wrapped in it, is a full disk or quota (ENOSPC, EDQUOT)."""
    for cause in [exc, *rank_causes(exc).values()]:
        error: BaseException | None = cause
        while error is not None:
            if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
                return True
            error = error.__cause__ or error.__context__
    return False


def _sha256(path: Path) -> str:
    with path.open("rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def _rotate(directory: Path, keep_last: int, keep_best: int = 0, goal: str = "min") -> None:
    """Delete all but the newest ``keep_last`` checkpoints (files or folders) and the ``keep_best`` best by their
    monitored value (``goal``), with their digests."""
    found = list_checkpoints(directory)
    kept = set(found[-keep_last:])
    if keep_best:
        kept |= set(ranked(found, goal)[:keep_best])
    for old in (path for path in found if path not in kept):
        if old.is_dir():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink(missing_ok=True)
        digest_path(old).unlink(missing_ok=True)


def digest_path(checkpoint: Path) -> Path:
    """The digest file of a checkpoint file or folder: ``<name>.sha256`` beside it."""
    return checkpoint.with_name(checkpoint.name + ".sha256")


def write_digest(checkpoint: Path, digests: dict[str, str]) -> Path:
    """Write ``checkpoint``'s digest file (``sha256sum`` format, paths relative to its folder) atomically."""
    text = "".join(f"{sha}  {name}\n" for name, sha in sorted(digests.items()))
    return write_atomic(checkpoint.parent, text.encode(), final=digest_path(checkpoint))


def verify_digest(checkpoint: Path) -> None:
    """Check a checkpoint file or folder against its digest file.

    Raises CheckpointError for a missing digest file, a missing or unlisted file, or a SHA-256 that differs.
    """
    try:
        lines = digest_path(checkpoint).read_text().splitlines()
        pairs = [line.split("  ", 1) for line in lines if line.strip()]
        recorded = {name: sha for sha, name in pairs}
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{checkpoint}: no readable digest file {digest_path(checkpoint).name} ({exc})") from None
    base = checkpoint.parent
    present = [checkpoint] if checkpoint.is_file() else sorted(p for p in checkpoint.rglob("*") if p.is_file())
    names = {p.relative_to(base).as_posix() for p in present}
    if names != set(recorded):
        change = sorted(names ^ set(recorded))
        raise CheckpointError(f"{checkpoint}: damaged: its files differ from the ones recorded at save ({change})")
    for name, sha in sorted(recorded.items()):
        if _sha256(base / name) != sha:
            raise CheckpointError(
                f"{checkpoint}: damaged: the SHA-256 of {name} differs from the one recorded when it was saved"
            )


def write_atomic(directory: Path, data: bytes | memoryview, final: Path) -> Path:
    """Write ``data`` to an fsync'ed temporary file in ``directory``, then rename it to ``final``."""
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=directory)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, final)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return final


def checkpoint_step(path: Path) -> int:
    """The global step of a checkpoint, from its name ``step-<global step>``."""
    match = _NAME.match(path.name)
    return int(match.group(1)) if match else -1


def list_checkpoints(directory: Path) -> list[Path]:
    """Checkpoints in ``directory``, oldest first (by global step); temporary files are ignored."""
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found)]


def plain_problem(obj: Any, where: str = "checkpoint") -> str | None:
    """The first value under ``obj`` that is neither a tensor nor plain (e.g. ``checkpoint["scheduler"][...] is a
    function``), or ``None``."""
    import torch

    if isinstance(obj, (torch.Tensor, *_PLAIN)):
        return None
    if isinstance(obj, dict):
        for key, value in obj.items():
            problem = plain_problem(key, f"{where} key") or plain_problem(value, f"{where}[{key!r}]")
            if problem is not None:
                return problem
        return None
    if isinstance(obj, (list, tuple)):
        return next((p for i, v in enumerate(obj) if (p := plain_problem(v, f"{where}[{i}]")) is not None), None)
    return f"{where} is a {type(obj).__module__}.{type(obj).__qualname__}"


def pickled_objects(exc: pickle.UnpicklingError) -> str:
    """The globals that ``torch.load(weights_only=True)`` refused to build, as its error names them."""
    return ", ".join(sorted(set(_GLOBAL.findall(str(exc))))) or "an object that is not a tensor or plain value"


def ranked(paths: list[Path], goal: str) -> list[Path]:
    """The checkpoints among ``paths`` that recorded ``checkpoint.monitor``'s value, best first for ``goal`` ("min"
    or "max"; of equal values the earliest, which reached it first); one whose ``meta.pt`` does not read is left
    out. Each value is read from ``meta.pt`` alone, without the digest of the shards."""
    valued = [(value, step, path) for step, path in enumerate(paths) if (value := monitored_value(path)) is not None]
    sign = 1.0 if goal == "min" else -1.0
    return [path for value, step, path in sorted(valued, key=lambda vsp: (sign * vsp[0], vsp[1]))]


def monitored_value(path: Path) -> float | None:
    """The value of ``checkpoint.monitor`` a checkpoint recorded, or ``None`` (none, NaN, or unreadable)."""
    try:
        value = _plain_meta(path).get("monitored")
    except Exception:
        return None
    return float(value) if isinstance(value, (int, float)) and not math.isnan(value) else None


def read_checkpoint(path: Path) -> dict[str, Any]:
    """Load and check a checkpoint folder's ``meta.pt`` after every file's digest, ``weights_only``.

    Raises CheckpointError, naming the file: truncated or damaged, pickled objects (never executed), another format
    version, or runner's fields missing.
    """
    import torch

    verify_digest(path)
    try:
        payload = torch.load(path / META if path.is_dir() else path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise CheckpointError(
            f"{path}: refused: it carries pickled objects ({pickled_objects(exc)}) that loading would execute; "
            "runner checkpoints hold only tensors and plain values and are read with torch.load(weights_only=True)"
        ) from None
    except Exception as exc:  # torch raises RuntimeError, EOFError, ...
        raise CheckpointError(f"{path}: damaged or truncated checkpoint ({type(exc).__name__}: {exc})") from None
    return _checked(path, payload)


def peek(path: Path) -> dict[str, Any]:
    """What :func:`read_checkpoint` returns, every tensor, dtype and size ``None``, without torch: the driver checks
    a resume with it and never holds the weights. Unpickles nothing but plain values. Raises as
    :func:`read_checkpoint`, except for the pickled objects that only the training process's load refuses."""
    verify_digest(path)
    try:
        payload = _plain_meta(path)
    except Exception as exc:
        raise CheckpointError(f"{path}: damaged or truncated checkpoint ({type(exc).__name__}: {exc})") from None
    return _checked(path, payload)


def _plain_meta(path: Path) -> Any:
    """A checkpoint's ``meta.pt`` unpickled with every global and storage read as ``None`` (:class:`_Plain`)."""
    with zipfile.ZipFile(path / META if path.is_dir() else path) as archive:
        name = next(n for n in archive.namelist() if n.endswith("/data.pkl"))
        return _Plain(io.BytesIO(archive.read(name))).load()


class _Plain(pickle.Unpickler):
    """torch.save's pickle with every global (tensor rebuilders, dtypes, sizes) and storage read as ``None``."""

    def find_class(self, module: str, name: str) -> Any:
        return collections.OrderedDict if (module, name) == ("collections", "OrderedDict") else lambda *a, **k: None

    def persistent_load(self, pid: Any) -> None:
        return None


def _checked(path: Path, payload: Any) -> dict[str, Any]:
    """``payload`` when it is a runner checkpoint of this format; CheckpointError naming ``path`` otherwise."""
    version = payload.get("format") if isinstance(payload, dict) else None
    if isinstance(version, int) and version != FORMAT_VERSION:
        raise CheckpointError(
            f"{path}: written in checkpoint format {version} by another version of runner; this one reads format "
            f"{FORMAT_VERSION} only, so it cannot continue from it (start the run again, or resume it with the "
            "runner version that wrote it)"
        )
    if version != FORMAT_VERSION or "state" not in payload:
        raise CheckpointError(f"{path}: not a runner checkpoint (format {FORMAT_VERSION} expected)")
    return payload


def dcp_error(exc: BaseException) -> str:
    """The cause of a DCP failure: each rank's, where DCP wrapped them (its ``CheckpointException``)."""
    causes = rank_causes(exc)
    if not causes:
        return first_line(exc)
    return "; ".join(f"rank {rank}: {first_line(cause)}" for rank, cause in sorted(causes.items()))


def rank_causes(exc: BaseException) -> dict[int, BaseException]:
    """The exception of each rank that DCP wrapped in its ``CheckpointException`` (its failures are ``(exception,
    frames)`` pairs), by rank; empty for any other exception."""
    failures = getattr(exc, "failures", None)
    if not isinstance(failures, dict):
        return {}
    return {rank: e[0] if isinstance(e, tuple) else e for rank, e in failures.items()}


def load_latest(
    directory: Path, read: Callable[[Path], dict[str, Any]] = read_checkpoint, best: str | None = None
) -> LoadedCheckpoint | None:
    """The newest checkpoint of ``directory`` that ``read`` reads back, past damaged or refused ones; ``None`` when
    there is none. With ``best`` (a goal, "min" or "max"), the best by monitored value instead (:func:`ranked`),
    past damaged ones to the next best. The folder is listed again after each failure, so a checkpoint that a
    running job's rotation deleted while it was read is passed over (not reported) and one saved meanwhile is tried.

    Raises CheckpointError, listing each file and why, when none of them reads.
    """
    skipped: list[tuple[Path, str]] = []
    tried: set[Path] = set()
    while untried := [p for p in _candidates(directory, best) if p not in tried]:
        path = untried[0]
        tried.add(path)
        try:
            return LoadedCheckpoint(path, read(path), tuple(skipped))
        except CheckpointError as exc:
            if path.exists():  # else rotated away while it was read
                skipped.append((path, str(exc)))
    if skipped:
        raise CheckpointError(
            f"no usable checkpoint in {directory}: every one is damaged, so none is used:\n"
            + "\n".join(reason for _, reason in skipped)
        )
    return None


def _candidates(directory: Path, best: str | None) -> list[Path]:
    """The checkpoints of ``directory`` in the order :func:`load_latest` tries them."""
    found = list_checkpoints(directory)
    return ranked(found, best) if best is not None else found[::-1]


def build_payload(
    *,
    scheduler: LRScheduler | None,
    scaler: Precision | None,
    state: TrainState,
    rng_states: list[dict[str, Any]],
    spec_flat: dict[str, Any],
    spec_sha256: str,
    run_id: str | None,
    metrics_recorded: int = 0,
    monitored: float | None = None,
) -> dict[str, Any]:
    """Assemble ``meta.pt``: scheduler and scaler, the loop state, every rank's RNG states, the flattened spec and
    ``metrics_recorded`` (values sent or spooled when it was taken: a resume sends the spooled ones before it and
    recomputes those after) and ``monitored``, the value of ``checkpoint.monitor`` logged at this step (``None``: no
    evaluation here); the model and optimizer are the folder's shards."""
    return {
        "format": FORMAT_VERSION,
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "scaler": scaler.state_dict() if scaler is not None else None,
        "state": dict(vars(state)),  # TrainState(**payload["state"]) rebuilds it
        "rng": rng_states,
        "spec": spec_flat,
        "spec_sha256": spec_sha256,
        "run_id": run_id,
        "tracking": {"metrics_recorded": int(metrics_recorded)},
        "monitored": monitored,
    }


def _fsync_dir(directory: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

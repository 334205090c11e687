"""Exception hierarchy: every error raised on purpose, each class carrying its exit status (docs/design.md §9) and
heading; notes, and the wording helpers of messages.

Errors are classified where they are raised, so that the command line maps each to its exit status with one
``except`` and a message that names the cause never travels as a traceback.
"""

from __future__ import annotations

import contextlib
import difflib
import json
import numbers
import re
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

_TRACEBACK = "Traceback (most recent call last)"


def first_line(error: BaseException | str) -> str:
    """The line of an error that names it, for quoting it: the first (torch's errors from C++ carry a stack trace
    below it), or a traceback's last (``Type: message``)."""
    lines = [line for line in str(error).strip().splitlines() if line.strip()] or [""]
    return lines[-1] if lines[0].startswith(_TRACEBACK) else lines[0]


_AUTHORITY = re.compile(r"\b(?P<scheme>[a-zA-Z][\w+.-]*)://(?P<authority>[^\s/?#]*)")
_QUERY_SECRET = re.compile(r"(?i)(?P<head>[?&;](?:password|passwd|pwd|token|access_token|secret|api_key)=)[^&;\s'\"]*")


def mask_secrets(text: str) -> str:
    """``text`` with every URL's credentials replaced by ``***``: passwords, a bare http(s) user (a token), and
    ``password=``/``token=`` query values.

    The authority is read as ``urllib.parse`` reads it: the user information runs to its last ``@`` and the user name
    to its first ``:``, so an e-mail address as user name (``http://alice@corp.example:pw@host``) and a ``'`` in a
    user or a token are masked too; a user name alone is kept, except over http(s), where it is a token."""
    return _QUERY_SECRET.sub(r"\g<head>***", _AUTHORITY.sub(_masked_authority, text))


def _masked_authority(match: re.Match[str]) -> str:
    """One ``scheme://authority`` with its credentials masked (see :func:`mask_secrets`)."""
    scheme, authority = match.group("scheme"), match.group("authority")
    userinfo, at, host = authority.rpartition("@")
    if not at:
        return match.group(0)
    user, colon, _ = userinfo.partition(":")
    if colon:
        return f"{scheme}://{user}:***@{host}"
    return f"{scheme}://***@{host}" if scheme.lower() in ("http", "https") else match.group(0)


class RunnerError(Exception):
    """Base class of every error raised on purpose; ``exit_code`` and ``heading`` (``runner: <heading>: ...``)."""

    exit_code: ClassVar[int] = 1
    heading: ClassVar[str] = "error"

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickle by state, not by ``__init__``'s arguments: an error crosses from a training process to the driver."""
        return (_rebuild, (type(self), self.args, self.__dict__))

    def format_message(self) -> str:
        """The text ``runner`` prints after ``runner: `` (a message of several lines is indented below)."""
        text = mask_secrets(str(self))
        if "\n" not in text:
            return f"{self.heading}: {text}"
        return f"{self.heading}:\n" + "\n".join("  " + line for line in text.splitlines())


def _rebuild(cls: type[RunnerError], args: tuple[Any, ...], state: dict[str, Any]) -> RunnerError:
    error = cls.__new__(cls)
    error.args = args
    error.__dict__.update(state)
    return error


@dataclass(frozen=True)
class SpecIssue:
    """One problem found in a spec: file and 1-based line (``None`` when unknown), dotted key, message, ``origin``."""

    file: Path | None
    line: int | None
    key: str
    message: str
    origin: str | None = None

    def format(self) -> str:
        """Return ``FILE:LINE: dotted.key: message`` (parts that are unknown are left out)."""
        where = ""
        if self.file is not None:
            where = f"{self.file}:{self.line}: " if self.line else f"{self.file}: "
        elif self.origin:
            where = f"{self.origin}: "
        key = f"{self.key}: " if self.key else ""
        return f"{where}{key}{self.message}"


class SpecError(RunnerError):
    """A spec or override is invalid (exit 2); holds every problem of one file, so all are fixed at once."""

    exit_code = 2

    def __init__(self, issues: list[SpecIssue] | SpecIssue | str):
        if isinstance(issues, str):
            issues = [SpecIssue(None, 0, "", issues)]
        elif isinstance(issues, SpecIssue):
            issues = [issues]
        self.issues: list[SpecIssue] = list(issues)
        super().__init__("\n".join(i.format() for i in self.issues))


class UsageError(RunnerError):
    """The command line is wrong (bad flag combination, missing file); exit status 2."""

    exit_code = 2


class DeviceError(RunnerError):
    """The spec asks for devices this machine lacks (exit 2), raised when devices are resolved, never by the schema.

    Names its ``key``; once :meth:`located`, reads ``FILE:LINE: dotted.key: message``.
    """

    exit_code = 2

    def __init__(self, message: str, key: str = "", file: Path | None = None, line: int | None = None):
        self.message = message
        self.key = key
        self.file = file
        self.line = line
        super().__init__(SpecIssue(file, line, key, message).format())

    def located(self, file: Path, line: int | None) -> DeviceError:
        """The same error placed at ``file`` and ``line`` (the line of :attr:`key` in the spec file)."""
        return DeviceError(self.message, self.key, file, line)


class TrackingError(RunnerError):
    """The store cannot be reached or used (exit 2, before training; during training it is a TrainingError)."""

    exit_code = 2


@contextlib.contextmanager
def store_errors(what: str) -> Iterator[None]:
    """Raise what fails in the block as ``TrackingError("could not {what}: {message}")``: runner's one mapping of
    MLflow's errors onto its own. An ``MlflowException`` gives its own message; another error its type and text."""
    try:
        yield
    except TrackingError:
        raise
    except Exception as exc:
        message = getattr(exc, "message", None)
        if not isinstance(message, str):
            message = f"{type(exc).__name__}: {exc}"
        raise TrackingError(f"could not {what}: {message}") from exc


class TrainingError(RunnerError):
    """The training job failed (an exception in the loop or a worker); exit status 1."""

    exit_code = 1
    heading = "training failed"


class UserCodeError(TrainingError):
    """An exception inside the user's code (exit 1), named by spec key, exception, the user's file and line and
    frames."""


def user_code_error(exc: BaseException, key: str | None = None) -> UserCodeError | None:
    """``exc`` as a :class:`UserCodeError` when its traceback passes through the user's code (outside runner, the
    standard library and packages), else ``None``; ``key`` defaults to the spec key read off the last runner frame."""
    import traceback

    frames = list(traceback.walk_tb(exc.__traceback__))
    ours = [i for i, (frame, _) in enumerate(frames) if _is_runner_file(frame.f_code.co_filename)]
    last_ours = ours[-1] if ours else -1  # the user's code is what runner called last
    user = [(f, line) for f, line in frames[last_ours + 1 :] if _is_user_file(f.f_code.co_filename)]
    if not user:
        return None
    if key is None:
        key = _key_of(frames[last_ours][0] if ours else None)
    last, line = user[-1]
    where = f"{last.f_code.co_filename}:{line}"
    summary = traceback.StackSummary.extract((f, n) for f, n in user[-_USER_FRAMES:])
    lines = [f"  {Path(s.filename).name}:{s.lineno} in {s.name}: {s.line}" for s in summary]
    message = f"{key}: your code raised {type(exc).__name__}: {first_line(exc)} (at {where}, in {last.f_code.co_name})"
    return UserCodeError("\n".join([message, "your frames (most recent call last):", *lines]))


_USER_FRAMES = 5  # the user's frames shown, the innermost ones
_RUNNER_DIR = Path(__file__).resolve().parent
_KEYS = {"batches.py": "model.name", "models.py": "model.name", "losses.py": "loss.name"}


def _is_runner_file(filename: str) -> bool:
    return Path(filename).resolve().is_relative_to(_RUNNER_DIR)


def _is_user_file(filename: str) -> bool:
    import sysconfig

    if filename.startswith("<") or _is_runner_file(filename):
        return False
    path = Path(filename).resolve()
    library = {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    return not any(path.is_relative_to(Path(p).resolve()) for p in library)


def _key_of(frame: Any) -> str:
    """The spec key of the user's code that runner's ``frame`` called."""
    if frame is None:
        return "model.name"
    recipe = frame.f_locals.get("recipe")
    if recipe is not None and hasattr(recipe, "key"):
        return str(recipe.key)
    return _KEYS.get(Path(frame.f_code.co_filename).name, "data.dataset")


def signal_name(signum: int) -> str:
    """``SIGTERM`` for 15; ``unknown signal`` for a number that names none."""
    import signal

    try:
        return signal.Signals(signum).name
    except ValueError:
        return "unknown signal"


def stop_code(signum: int, rank: int) -> int:
    """One int for "signal ``signum`` reached ``rank``", so that a MAX all-reduce agrees on one (lowest rank wins)."""
    return (signum << 16) | (0xFFFF - rank)


def stop_origin(code: int) -> tuple[int, int]:
    """``(signum, rank)`` of a :func:`stop_code`."""
    return code >> 16, 0xFFFF - (code & 0xFFFF)


class Interrupted(RunnerError):
    """The job was stopped by SIGINT or SIGTERM; exit status 130 (128 + SIGINT, as shells report it)."""

    exit_code = 130
    heading = "interrupted"

    def __init__(
        self,
        signum: int = 2,
        run_id: str | None = None,
        command: str | None = None,
        checkpoint: str | None = None,
        rank: int | None = None,
    ):
        self.signum = signum
        self.run_id = run_id
        self.command = command
        self.checkpoint = checkpoint  # which checkpoint exists, e.g. "a checkpoint was written at the stop (...)"
        self.rank = rank  # the rank the signal reached, in a job of several
        where = f" at rank {rank}" if rank is not None else ""
        super().__init__(f"interrupted by signal {signum} ({signal_name(signum)}){where}")

    def hint(self) -> str:
        """The run that was stopped and the command that continues it (``command``, else ``runner resume RUN_ID``)."""
        where = f" at rank {self.rank}" if self.rank is not None else ""
        by = f"{signal_name(self.signum)}{where}"
        if self.run_id or self.command:
            command = self.command or f"runner resume {self.run_id}"
            killed = f"run {self.run_id} is KILLED ({by}); " if self.run_id else ""
            return f"{killed}{self.checkpoint or 'a checkpoint was written'}. Continue it with: {command}"
        return f"stopped ({by})"

    def format_message(self) -> str:
        """``interrupted: <hint>``: the run that was stopped and how to continue it."""
        return f"{self.heading}: {mask_secrets(self.hint())}"


def echo(text: str, *, err: bool = False, end: str = "\n") -> None:
    """The console sink: ``text`` with credentials masked (:func:`mask_secrets`), flushed to standard output, or to
    standard error with ``err``. Messages carry URLs as they are and are masked here, at ``format_message``, and where
    they are recorded (MLflow runs, the Optuna storage, report files)."""
    print(mask_secrets(text), end=end, file=sys.stderr if err else sys.stdout, flush=True)


def show_notes(notes: list[str]) -> None:
    """Print each note as ``runner: note: ...`` on standard error; standard output is the run's summary."""
    for note in notes:
        echo(f"runner: note: {note}", err=True)


_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


def toml_value(value: Any) -> str:
    """The one TOML value writer: a value on one line as ``--set key=<text>`` reads it back (``true``, ``"text"``,
    ``[1, 2]``, ``{ a = 1, "b c" = 2 }``, ``nan``, ``-inf``); TypeError for a value TOML cannot write (``None``)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, numbers.Integral):  # numpy's integers too
        return str(int(value))
    if isinstance(value, numbers.Real):  # numpy's floats too, without their repr; nan, inf and -inf as TOML writes them
        return repr(float(value))
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)  # a JSON string is a TOML basic string
    if isinstance(value, list | tuple):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        quoted = {k: k if _BARE_KEY.fullmatch(str(k)) else json.dumps(str(k), ensure_ascii=False) for k in value}
        return "{ " + ", ".join(f"{quoted[k]} = {toml_value(v)}" for k, v in value.items()) + " }" if value else "{}"
    if hasattr(value, "isoformat"):
        return str(value.isoformat())
    raise TypeError(f"{value!r} ({type(value).__name__}) has no TOML form")


def show(value: Any, limit: int = 60) -> str:
    """:func:`toml_value` (``str`` of a value TOML cannot write), cut to about ``limit`` characters."""
    try:
        text = toml_value(value)
    except TypeError:
        text = str(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def join_or(parts: Sequence[str]) -> str:
    """Return ``a``, ``a or b``, ``a, b or c`` for one, two, three or more parts."""
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " or " + parts[-1]


def with_hint(message: str, hint: str) -> str:
    """Return ``message (hint)``, or ``message`` alone when ``hint`` is empty."""
    return f"{message} ({hint})" if hint else message


CUTOFF = 0.6  # difflib.get_close_matches' default similarity bound


def close_matches(word: str, choices: Iterable[str] | Mapping[str, str], n: int = 1) -> list[str]:
    """Up to ``n`` ``choices`` close to ``word`` ignoring case (a mapping matches its keys, suggests its values);
    closest first; an exact match alone."""
    table = dict(choices) if isinstance(choices, Mapping) else {c: c for c in choices}
    lowered: dict[str, str] = {}
    for match_text, name in table.items():
        lowered.setdefault(match_text.lower(), name)
    word = word.lower()
    if word in lowered:
        return [lowered[word]]
    return [lowered[c] for c in difflib.get_close_matches(word, list(lowered), n=n, cutoff=CUTOFF)]


def suggest(candidates: Sequence[str], render: Callable[[str], str] = show) -> str:
    """``did you mean "a" or "b"?`` for ``candidates`` (empty text for none), each written by ``render``."""
    return f"did you mean {join_or([render(c) for c in candidates])}?" if candidates else ""


def did_you_mean(
    word: object,
    choices: Iterable[str] | Mapping[str, str],
    n: int = 1,
    render: Callable[[str], str] = show,
) -> str:
    """``did you mean "x"?`` for the choices closest to ``word``, or empty text."""
    return suggest(close_matches(str(word), choices, n), render)


STORE_LEFT_HANGING: list[str] = []  # tracking URIs a tracker stopped waiting for, with a request still in flight


def exit_quickly(code: int) -> None:
    """Exit with ``code`` after ``gc.freeze()`` (docs/design.md §6, step 6); with ``os._exit`` once a tracker gave up
    on a store that hangs (:data:`STORE_LEFT_HANGING`): MLflow's threads would hold the process for minutes (§12)."""
    import gc
    import os

    gc.freeze()
    if STORE_LEFT_HANGING:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)

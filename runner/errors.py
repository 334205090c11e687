"""Exception hierarchy: every error the CLI maps to an exit status."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


class RunnerError(Exception):
    """Base class of every error raised on purpose by runner."""


@dataclass(frozen=True)
class SpecIssue:
    """One problem found in a spec.

    Attributes:
        file: The spec file the problem is in (``None`` when it is not in a file).
        line: 1-based line number in ``file``, or ``None`` when it cannot be located.
        key: Dotted key, e.g. ``parallel.mode``; empty for whole-file problems.
        message: What is wrong and how to fix it.
        origin: Where the value came from when not from ``file``, e.g. ``"--set"``.
    """

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
    """A spec (or an override of it) is invalid; the CLI exits with status 2.

    Holds every problem found in one file, so that users fix them all at once.
    """

    def __init__(self, issues: list[SpecIssue] | SpecIssue | str):
        if isinstance(issues, str):
            issues = [SpecIssue(None, 0, "", issues)]
        elif isinstance(issues, SpecIssue):
            issues = [issues]
        self.issues: list[SpecIssue] = list(issues)
        super().__init__("\n".join(i.format() for i in self.issues))


class UsageError(RunnerError):
    """The command line is wrong (bad flag combination, missing file); exit status 2."""


class DeviceError(RunnerError):
    """The spec asks for devices this machine does not have; exit status 2.

    Raised when devices are resolved (``plan``, ``exec``), never by the schema, so
    ``runner validate`` works on any laptop.
    """


class TrackingError(RunnerError):
    """The MLflow tracking store cannot be reached or used; exit status 2 when raised before training."""


class TrainingError(RunnerError):
    """The training job failed (an exception in the loop or a worker); exit status 1."""


class Interrupted(RunnerError):
    """The job was stopped by SIGINT or SIGTERM; exit status 130."""

    def __init__(self, signum: int = 2, run_id: str | None = None, spec: str | None = None):
        self.signum = signum
        self.run_id = run_id
        self.spec = spec
        super().__init__(f"interrupted by signal {signum}")

    def hint(self) -> str:
        """What to tell the user: the run that was stopped and how to continue it."""
        if self.run_id and self.spec:
            return (
                f"run {self.run_id} is KILLED; a checkpoint was written. Continue it with: "
                f"runner exec {self.spec} --resume {self.run_id}"
            )
        return "stopped"

"""How a run ends: its final status set in MLflow, or, while the tracking store does not answer, kept in its spool.

The spool file (:mod:`runner.tracking.spool`) then holds the metric values that could not be sent
and the final status; ``runner status RUN_ID`` sends both once the store answers (docs/design.md §12).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from runner.errors import mask_secrets


@dataclass(frozen=True)
class Spooled:
    """What of a run waits in its spool file because the tracking store did not answer.

    Attributes:
        path: The spool file.
        metrics: Metric values in it.
        status: The final status kept in it, or ``None`` when the run's status was set.
    """

    path: str
    metrics: int
    status: str | None

    @classmethod
    def of(cls, checkpoint_dir: str | Path) -> Spooled | None:
        """The run's spool, or ``None`` when nothing waits in it."""
        from runner.tracking.spool import read, spool_path

        path = spool_path(checkpoint_dir)
        if not path.is_file():
            return None
        contents, _ = read(path)
        if not contents.items and contents.end is None:
            return None
        return cls(str(path), len(contents.items), contents.end[0] if contents.end else None)

    def describe(self, run_id: str | None) -> str:
        """The end of the status line: what is only in the spool, and how it reaches MLflow."""
        kept = [f"{self.metrics} metric values"] if self.metrics else []
        if self.status:
            kept.append(f"the status {self.status}")
        return (
            f" (the tracking store did not answer: {' and '.join(kept)} could only be spooled to {self.path}; "
            f"`runner status {run_id}` sends them once it answers)"
        )


def end_run_or_spool(uri: str, run_id: str, status: str, error: str | None, checkpoint_dir: str) -> None:
    """Give the run its final status; while the store does not answer, keep it in the run's spool instead.

    ``runner status RUN_ID`` (or a resume) sets it later; a store that does not answer is not waited
    for beyond one quick check (:func:`runner.tracking.uri.check_reachable`).
    """
    import sys

    from runner.errors import TrackingError
    from runner.tracking import runs as tracking
    from runner.tracking.spool import append, spool_path
    from runner.tracking.uri import check_reachable

    try:
        check_reachable(uri)
        tracking.end_run(uri, run_id, status, error)
    except TrackingError:
        path = spool_path(checkpoint_dir)
        append(path, end=(status, error))
        print(
            f"runner: the tracking store at {mask_secrets(uri)} did not answer: run {run_id}'s status {status} is "
            f"kept in {path}; `runner status {run_id}` sets it once the store answers",
            file=sys.stderr,
            flush=True,
        )

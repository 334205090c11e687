"""``runner test RUN_ID``: score a run's checkpoint on its test split later, into the same run.

A run scores its final model on the test split when it ends; this scores another of its checkpoints (the newest or
the best) after the fact, for a run that ended before its test split existed or to compare both. The stored spec is
rebuilt in this process on one device (mode none: a checkpoint of any mode loads whole into it), so the test metrics
are those the run's own end computes for the same weights: every test sample counted once, the moving average of
the weights when the run kept one. They are logged as ``test/*`` at the checkpoint's step.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any

from runner.errors import UsageError

if TYPE_CHECKING:
    from runner.spec.loading import LoadedSpec
    from runner.training.checkpoint import LoadedCheckpoint


def score_run(run_id: str, tracking_uri: str | None = None, checkpoint: str = "last") -> str:
    """Score checkpoint ``checkpoint`` (``"last"`` or ``"best"``) of ``run_id`` on the test split and log ``test/*``
    to the run; returns the summary. Raises UsageError: no such run, no test split, no checkpoint, or ``"best"``
    without ``checkpoint.monitor``. SpecError: the stored spec no longer builds."""
    from runner.launch.reproduce import run_checkpoints
    from runner.spec.schema_parallel import ParallelSpec

    run, loaded, directory = run_checkpoints(run_id, tracking_uri, checkpoint == "best", "use --checkpoint last")
    spec = loaded.spec.model_copy(update={"parallel": ParallelSpec(mode="none")})
    found, scored = _score(dataclasses.replace(loaded, spec=spec), directory, checkpoint, run_id)
    step = int(found.payload["state"]["global_step"])
    run.log(metrics=scored, step=step, tags={"runner.test.checkpoint": found.path.name})
    lines = [f"run {run_id}: {found.path.name} ({checkpoint}) scored on the test split, logged at step {step}:"]
    return "\n".join(lines + [f"  {key:<21}  {value:.6g}" for key, value in sorted(scored.items())])


def _score(
    loaded: LoadedSpec, directory: Path, checkpoint: str, run_id: str
) -> tuple[LoadedCheckpoint, dict[str, float]]:
    """Build the spec's parts on one device, load the checkpoint (past damaged ones) and evaluate the test split."""
    from runner.plan import make_plan
    from runner.strategies import make_strategy
    from runner.tracking.trackers import NullTracker
    from runner.training import setup
    from runner.training.checkpoint import CheckpointError, load_latest, read_checkpoint
    from runner.training.loop import LoopParts, evaluate

    spec = loaded.spec
    strategy = make_strategy(spec.parallel, make_plan(loaded).devices)
    strategy.setup()
    try:
        parts = setup.build_parts(spec, loaded.path.parent, strategy)
        if parts.loaders.test is None:
            fix = "set data.test_fraction (imagefolder: a test/ folder; a factory: a third set) in a new run"
            raise UsageError(f"run {run_id} has no test split: {fix}")

        def read(path: Path) -> dict[str, Any]:
            payload = read_checkpoint(path)
            setup.load_weights(parts, strategy, path)
            return payload

        try:
            found = load_latest(directory, read, best=spec.checkpoint.goal if checkpoint == "best" else None)
        except CheckpointError as exc:
            raise UsageError(f"run {run_id}: {exc}") from None
        if found is None:
            raise UsageError(f"run {run_id} has no checkpoint in {directory}: nothing to score")
        if parts.ema is not None:
            parts.ema.copy_to_model()
        return found, evaluate(LoopParts(**vars(parts), strategy=strategy, tracker=NullTracker()), "test")
    finally:
        strategy.teardown()

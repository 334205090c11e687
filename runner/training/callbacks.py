"""Your callbacks (``[[callbacks]]``): objects whose hooks training calls at its milestones, with a context that
reads where training stands and logs to the run.

A spec declares training, but a researcher still wants a figure of the confusion matrix after each evaluation, a
sample of generated images, a metric of their own. A callback is any object with some of the hooks
``on_train_start(ctx)``, ``on_validation_end(ctx, metrics)``, ``on_epoch_end(ctx)`` and ``on_train_end(ctx)``
(Lightning's names); ``pkg.module:factory`` with ``kwargs`` makes it on every rank. Its hooks run on rank 0 only
unless it sets ``every_rank = True``. What it logs goes through the rank's tracker, so through the driver like every
other value (no MLflow in a training process); only rank 0's tracker reaches the run. An exception in a hook ends
the run FAILED, naming the callback's key and the user's file and line.
"""

from __future__ import annotations

import contextlib
import inspect
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from runner.errors import first_line, user_code_error
from runner.training.models import resolve_factory, spec_issue

if TYPE_CHECKING:
    from torch import nn

    from runner.spec.schema_loop import CallbackSpec
    from runner.tracking.trackers import Tracker

HOOKS = ("on_train_start", "on_validation_end", "on_epoch_end", "on_train_end")


@dataclass
class CallbackContext:
    """What a hook reads (``step``, ``epoch``, ``rank``, ``model``: the user's module, ``metrics``: the last logged)
    and how it logs: metrics at ``step``, a matplotlib figure or an image array as PNG, any file."""

    rank: int
    model: nn.Module
    tracker: Tracker
    folder: Path  # where figures and images are written before the driver uploads them
    step: int = 0
    epoch: int = 0
    metrics: dict[str, float] = field(default_factory=dict)

    def log_metrics(self, metrics: dict[str, float]) -> None:
        self.tracker.log_metrics({key: float(value) for key, value in metrics.items()}, step=self.step)

    def log_figure(self, figure: Any, name: str) -> None:
        """Save ``figure`` (``matplotlib.figure.Figure``) as ``figures/<name>.png`` of the run."""
        path = self._file(name)
        figure.savefig(path, format="png")
        self.log_artifact(path, "figures")

    def log_image(self, array: Any, name: str) -> None:
        """Save ``array`` (height x width, or x 3 or 4 channels; uint8, or floats in [0, 1]) as
        ``images/<name>.png``."""
        import numpy as np
        from PIL import Image

        pixels = np.asarray(array.detach().cpu() if hasattr(array, "detach") else array)
        if pixels.dtype != np.uint8:
            pixels = (np.clip(pixels, 0.0, 1.0) * 255).round().astype(np.uint8)
        path = self._file(name)
        Image.fromarray(pixels).save(path, format="PNG")
        self.log_artifact(path, "images")

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        self.tracker.log_artifact(str(path), artifact_path)

    def _file(self, name: str) -> Path:
        """A new PNG file for ``name`` (made safe as a file name), step-stamped so an upload never meets a rewrite."""
        stem = re.sub(r"[^\w.-]+", "_", name).strip("._") or "figure"
        out = self.folder / f"step-{self.step:08d}"
        out.mkdir(parents=True, exist_ok=True)
        return out / f"{stem}.png"


class Callbacks:
    """The built callbacks of one rank, each called only where it runs (rank 0, or every rank), and their context
    (set by the worker, which holds the tracker and the run's folder)."""

    def __init__(self, built: list[tuple[str, Any]], rank: int) -> None:
        self.built = [(key, obj) for key, obj in built if rank == 0 or getattr(obj, "every_rank", False)]
        self.ctx: CallbackContext | None = None

    def call(self, hook: str, step: int, epoch: int, metrics: dict[str, float], *args: Any) -> None:
        """Run ``hook`` of each callback that defines it, the context at ``step`` and ``epoch`` with ``metrics``; a
        failure in the user's code names its key, file and line."""
        assert self.ctx is not None, "the worker sets the context first"
        self.ctx.step = step
        self.ctx.epoch = epoch
        self.ctx.metrics = dict(metrics)
        for key, obj in self.built:
            method = getattr(obj, hook, None)
            if method is None:
                continue
            try:
                method(self.ctx, *args)
            except Exception as exc:
                if (located := user_code_error(exc, key)) is None:
                    raise
                raise located from exc


def build_callbacks(specs: list[CallbackSpec], spec_dir: Path | str | None, rank: int) -> Callbacks | None:
    """Make each ``[[callbacks]]`` entry (``factory(**kwargs)``); ``None`` without any. Raises SpecError at its key:
    the factory does not import, its signature rejects the kwargs, or it returns an object with none of
    :data:`HOOKS`."""
    built = []
    for i, spec in enumerate(specs):
        key = f"callbacks[{i}].name"
        factory = resolve_factory(spec.name, spec_dir, key)
        with contextlib.suppress(ValueError):  # ValueError: no signature to read; the call decides
            try:
                inspect.signature(factory).bind(**spec.kwargs)
            except TypeError as exc:
                raise spec_issue(f"callbacks[{i}].kwargs", f"{spec.name!r}: {first_line(exc)}") from None
        try:
            obj = factory(**spec.kwargs)
        except Exception as exc:
            if (located := user_code_error(exc, key)) is None:
                raise
            raise located from exc
        if not any(callable(getattr(obj, hook, None)) for hook in HOOKS):
            raise spec_issue(key, f"{spec.name!r} returned a {type(obj).__name__} with none of {', '.join(HOOKS)}")
        built.append((key, obj))
    return Callbacks(built, rank) if built else None

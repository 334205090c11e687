"""Progress display: a tqdm bar on a terminal, plain periodic lines elsewhere (CI, log files).

Both show the optimizer step, the latest values (loss, epoch, validation metrics), the
training throughput in samples/s (global samples of the steps shown, divided by the seconds
spent training since the display started, evaluation left out) and the phase: while
evaluation runs the bar reads ``validating`` instead of sitting silently at its last step.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tqdm import tqdm


class Progress:
    """Shows training progress on rank 0.

    Args:
        style: ``"auto"`` (bar on a TTY, lines otherwise), ``"bar"``, ``"lines"`` or ``"off"``.
        total: Optimizer steps the run will take.
        enabled: False on non-zero ranks: nothing is printed.
        every_s: Minimum seconds between two plain lines.
    """

    def __init__(self, style: str, total: int, *, enabled: bool = True, initial: int = 0, every_s: float = 10.0):
        self.enabled = enabled and style != "off"
        self.total = total
        self.done = initial
        self.every_s = every_s
        self.samples = 0
        self._start = time.perf_counter()
        self._excluded_s = 0.0  # seconds spent in phases (evaluation), left out of samples/s
        self._last_line = 0.0
        self._values = ""
        self._bar: tqdm | None = None
        use_bar = style == "bar" or (style == "auto" and sys.stderr.isatty())
        if self.enabled and use_bar:
            from tqdm.auto import tqdm

            self._bar = tqdm(
                total=total,
                initial=initial,
                unit="step",
                dynamic_ncols=True,
                leave=False,
                desc="train",
                file=sys.stderr,
            )

    @property
    def samples_per_s(self) -> float:
        """Global training samples per second of training time so far (0 before the first step)."""
        elapsed = time.perf_counter() - self._start - self._excluded_s
        return self.samples / elapsed if elapsed > 0 and self.samples else 0.0

    def update(self, n: int = 1, *, samples: int = 0) -> None:
        """Advance by ``n`` optimizer steps that trained on ``samples`` global samples."""
        self.done += n
        self.samples += samples
        if self._bar is not None:
            self._bar.set_postfix_str(self._postfix(), refresh=False)
            self._bar.update(n)

    def show(self, **values: Any) -> None:
        """Display the latest values (loss, epoch, ...): as the bar's postfix or as a plain line."""
        if not self.enabled:
            return
        self._values = " ".join(f"{k}={_fmt(v)}" for k, v in values.items())
        if self._bar is not None:
            self._bar.set_postfix_str(self._postfix(), refresh=False)
            return
        now = time.monotonic()
        if now - self._last_line >= self.every_s or self.done >= self.total:
            self._last_line = now
            print(f"step {self.done}/{self.total} {self._postfix()}", file=sys.stderr, flush=True)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Show ``name`` (e.g. ``"validating"``) as the phase while the block runs, then ``train`` again.

        The block's time is left out of samples/s.
        """
        start = time.perf_counter()
        if self.enabled and self._bar is None:
            print(f"step {self.done}/{self.total} {name}", file=sys.stderr, flush=True)
        if self._bar is not None:
            self._bar.set_description_str(name, refresh=True)
        try:
            yield
        finally:
            self._excluded_s += time.perf_counter() - start
            if self._bar is not None:
                self._bar.set_description_str("train", refresh=True)

    def close(self) -> None:
        """Remove the bar (plain lines need no closing)."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def _postfix(self) -> str:
        rate = f"samples/s={self.samples_per_s:.4g}" if self.samples else ""
        return " ".join(part for part in (self._values, rate) if part)


def _fmt(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)

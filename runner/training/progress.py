"""Progress display: a tqdm bar on a terminal, plain periodic lines elsewhere (CI, log files)."""

from __future__ import annotations

import sys
import time
from typing import Any


class Progress:
    """Shows training progress on rank 0.

    Args:
        style: ``"auto"`` (bar on a TTY, lines otherwise), ``"bar"``, ``"lines"`` or ``"off"``.
        total: Optimizer steps the run will take.
        enabled: False on non-zero ranks: nothing is printed.
        initial: Steps already done (resume).
        every_s: Minimum seconds between two plain lines.
    """

    def __init__(self, style: str, total: int, *, enabled: bool = True, initial: int = 0, every_s: float = 10.0):
        self.enabled = enabled and style != "off"
        self.total = total
        self.done = initial
        self.every_s = every_s
        self._last_line = 0.0
        self._bar: Any | None = None
        use_bar = style == "bar" or (style == "auto" and sys.stderr.isatty())
        if self.enabled and use_bar:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True, leave=False)

    def update(self, n: int = 1) -> None:
        """Advance by ``n`` optimizer steps."""
        self.done += n
        if self._bar is not None:
            self._bar.update(n)

    def show(self, **values: Any) -> None:
        """Display the latest values (loss, epoch, ...): as the bar's postfix or as a plain line."""
        if not self.enabled:
            return
        text = " ".join(f"{k}={_fmt(v)}" for k, v in values.items())
        if self._bar is not None:
            self._bar.set_postfix_str(text, refresh=False)
            return
        now = time.monotonic()
        if now - self._last_line >= self.every_s or self.done >= self.total:
            self._last_line = now
            print(f"step {self.done}/{self.total} {text}", file=sys.stderr, flush=True)

    def close(self) -> None:
        """Remove the bar (plain lines need no closing)."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def _fmt(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)

"""``mode = "none"``: one process, one device."""

from __future__ import annotations

from runner.strategies.base import Strategy


class SingleDevice(Strategy):
    """``mode = "none"``: one process, one device (``cuda:0`` after narrowing, or cpu)."""

    mode = "none"
